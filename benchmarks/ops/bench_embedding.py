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
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.ops.embedding import NativeEmbeddingOp  # noqa: E402

RESULTS = _common.RESULTS_DIR / "ops_embedding.jsonl"
MiB = 1024 * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small table (CPU smoke)")
    parser.add_argument("--no-save", action="store_true", help="do not append to results")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_name = _common.device_name(device)
    vocab, hidden = (4096, 256) if args.quick else (151_936, 4_096)
    batches = [(2, 64)] if args.quick else [(1, 4096), (8, 2048)]
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=gen, device=device).to(torch.bfloat16)
    table_bytes = weight.numel() * weight.element_size()
    op = NativeEmbeddingOp()
    commit = args.commit or _common.commit()
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
            extra = _common.extra_peak_bytes(lambda ids=ids: op.forward_fp32(ids, weight))
            naive = _common.extra_peak_bytes(
                lambda ids=ids: F.embedding(ids.long(), weight.float())
            )
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
                _common.time_ms(
                    lambda ids=ids: op.forward_fp32(ids, weight), device, reps, warmup=10, rep=50
                ),
                4,
            ),
            fwd_torch_ms=round(
                _common.time_ms(
                    lambda ids=ids: F.embedding(ids.long(), weight).float(),
                    device,
                    reps,
                    warmup=10,
                    rep=50,
                ),
                4,
            ),
            fwdbwd_native_ms=round(
                _common.time_ms(fwd_bwd_native, device, reps, warmup=10, rep=50), 4
            ),
            fwdbwd_torch_ms=round(
                _common.time_ms(fwd_bwd_torch, device, reps, warmup=10, rep=50), 4
            ),
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
        _common.append_rows(RESULTS, rows)
        print(f"appended {len(rows)} rows to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
