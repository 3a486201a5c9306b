"""Benchmark: NativeEmbeddingOp.forward_fp32 memory (rows, not the table) and time, fwd and bwd.

Usage (GPU):  python benchmarks/ops/bench_embedding.py
Smoke (CPU):  python benchmarks/ops/bench_embedding.py --quick   (times only, no memory figures)

Table: Qwen3-8B input embedding, 151,936 x 4,096 bf16. For each batch of ids it measures the extra
peak GPU memory of ``forward_fp32`` against the bytes of the fp32 rows it returns and the bytes of
the table, next to the naive ``F.embedding(ids, weight.float())`` that upcasts the whole table.
It also times forward_fp32 and the deterministic backward against ``F.embedding``'s.
Rows are appended to benchmarks/results/ops_embedding.jsonl.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from xtoken_core.ops.embedding import NativeEmbeddingOp

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results" / "ops_embedding.jsonl"
MiB = 1024 * 1024


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _time_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _extra_peak_bytes(fn) -> int:
    """Peak bytes allocated by fn() beyond what was live before it (result kept alive)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small table (CPU smoke)")
    parser.add_argument("--no-save", action="store_true", help="do not append to results")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    vocab, hidden = (4096, 256) if args.quick else (151_936, 4_096)
    batches = [(2, 64)] if args.quick else [(1, 4096), (8, 2048)]
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=gen, device=device).to(torch.bfloat16)
    table_bytes = weight.numel() * weight.element_size()
    op = NativeEmbeddingOp()
    commit = args.commit or _commit()
    rows = []
    for b, t in batches:
        ids = torch.randint(0, vocab, (b, t), generator=gen, device=device, dtype=torch.int32)
        # Zipf-like collisions for the backward: a few ids take most positions.
        ids[:, ::3] = ids[:, ::3] % 64
        out = op.forward_fp32(ids, weight)
        assert torch.equal(out, weight[ids.long()].float())
        rows_bytes = out.numel() * 4
        del out
        row = {
            "commit": commit,
            "device": dev_name,
            "vocab": vocab,
            "hidden": hidden,
            "tokens": b * t,
            "table_bf16_MiB": round(table_bytes / MiB, 1),
            "rows_fp32_MiB": round(rows_bytes / MiB, 1),
        }
        if device == "cuda":
            extra = _extra_peak_bytes(lambda ids=ids: op.forward_fp32(ids, weight))
            naive = _extra_peak_bytes(lambda ids=ids: F.embedding(ids.long(), weight.float()))
            row.update(
                extra_peak_MiB=round(extra / MiB, 1),
                naive_extra_peak_MiB=round(naive / MiB, 1),
                extra_over_rows=round(extra / rows_bytes, 3),
                extra_over_table=round(extra / table_bytes, 4),
            )
        reps = 3 if args.quick else 10
        grad_out = torch.randn(b, t, hidden, generator=gen, device=device)
        leaf = weight.detach().requires_grad_(True)

        def fwd_bwd_native(ids=ids, leaf=leaf, grad_out=grad_out):
            leaf.grad = None
            op.forward_fp32(ids, leaf).backward(grad_out)

        def fwd_bwd_torch(ids=ids, leaf=leaf, grad_out=grad_out):
            leaf.grad = None
            F.embedding(ids.long(), leaf).float().backward(grad_out)

        row.update(
            fwd_fp32_ms=round(
                _time_ms(lambda ids=ids: op.forward_fp32(ids, weight), device, reps), 4
            ),
            fwd_torch_ms=round(
                _time_ms(lambda ids=ids: F.embedding(ids.long(), weight).float(), device, reps), 4
            ),
            fwdbwd_native_ms=round(_time_ms(fwd_bwd_native, device, reps), 4),
            fwdbwd_torch_ms=round(_time_ms(fwd_bwd_torch, device, reps), 4),
        )
        rows.append(row)
        del grad_out, leaf
    print(f"NativeEmbeddingOp on {dev_name}: table {vocab} x {hidden} bf16")
    header = (
        f"{'tokens':>7} | {'table MiB':>9} {'rows MiB':>8} {'extra MiB':>9} {'naive MiB':>9} "
        f"{'extra/rows':>10} | {'fwd32 ms':>8} {'F.emb ms':>8} | {'f+b ms':>8} {'F f+b ms':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tokens']:>7} | {r['table_bf16_MiB']:>9.1f} {r['rows_fp32_MiB']:>8.1f} "
            f"{r.get('extra_peak_MiB', float('nan')):>9.1f} "
            f"{r.get('naive_extra_peak_MiB', float('nan')):>9.1f} "
            f"{r.get('extra_over_rows', float('nan')):>10.3f} | {r['fwd_fp32_ms']:>8.3f} "
            f"{r['fwd_torch_ms']:>8.3f} | {r['fwdbwd_native_ms']:>8.3f} {r['fwdbwd_torch_ms']:>8.3f}"
        )
    if not args.no_save and not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"appended {len(rows)} rows to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
