"""One rollout worker alone: new tokens/s and device memory per batch, KV cache kinds side by side.

A :class:`~services.rollout.worker.RolloutWorker` (the student preset with random weights) samples
``--batches`` batches of ``--batch`` prompts of ``--prompt-tokens`` random ids, ``--new-tokens``
each (random weights: a row rarely meets an EOS), once per ``--kv-cache`` kind
(``dynamic``: the cache grows a token per step; ``static``: allocated once per batch). Per kind:
the first batch's seconds (on CUDA with ``static``, transformers compiles the decoding step in
it), new tokens/s over the later batches, the peak device memory allocated in a batch and what the
worker still holds reserved after it (expandable segments and the cache handed back:
``services/rollout/worker.py``).

Usage (GPU)::

    python benchmarks/e2e/bench_rollout.py --batch 64 --kv-cache dynamic static

CPU smoke test (tiny model; prints the table, writes no rows unless ``--results``)::

    python benchmarks/e2e/bench_rollout.py --device cpu --student tiny --batch 2 \\
        --prompt-tokens 8 --new-tokens 8 --batches 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import RESULTS_DIR, append_rows, commit, device_name  # noqa: E402

GIB = 2**30


def measure(args, kv_cache: str, weights: Path) -> dict:
    """The figures of one KV cache kind (a worker of its own)."""
    from services.rollout.config import RolloutConfig
    from services.rollout.worker import RolloutWorker

    cfg = RolloutConfig(
        student=args.student,
        device=args.device,
        student_tokenizer=args.student_tokenizer,
        teacher_tokenizer=args.teacher_tokenizer,
        weights=str(weights),
        ctx_student=args.prompt_tokens + args.new_tokens,
        ctx_teacher=args.prompt_tokens + args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        batch=args.batch,
        kv_cache=kv_cache,
    )
    worker = RolloutWorker(cfg)
    cuda = worker.device.type == "cuda"
    low, high = 100, min(worker.tokenizer.vocab_size, 30_000)
    g = torch.Generator().manual_seed(0)
    seconds, peaks, held, new = [], [], [], []
    for i in range(args.batches):
        prompts = [
            torch.randint(low, high, (args.prompt_tokens,), generator=g).tolist()
            for _ in range(args.batch)
        ]
        if cuda:
            torch.cuda.synchronize(worker.device)
            torch.cuda.reset_peak_memory_stats(worker.device)
        t0 = time.perf_counter()
        rows = worker.sample(prompts, seed=i)
        if cuda:
            torch.cuda.synchronize(worker.device)
            peaks.append(torch.cuda.max_memory_allocated(worker.device) / GIB)
            held.append(torch.cuda.memory_reserved(worker.device) / GIB)
        seconds.append(time.perf_counter() - t0)
        new.append(sum(len(r) - args.prompt_tokens for r in rows))  # a row ends at an EOS
    later = slice(1, None) if len(seconds) > 1 else slice(None)
    row = {
        "kv_cache": kv_cache,
        "first_batch_s": seconds[0],
        "batch_s": statistics.median(seconds[later]),
        "new_tokens_per_s": sum(new[later]) / sum(seconds[later]),
        "peak_alloc_gib": max(peaks) if peaks else None,
        "reserved_after_gib": held[-1] if held else None,
    }
    del worker
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", default="qwen3-0.6b", help="student preset (random weights)")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64, help="prompts sampled together")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=384)
    p.add_argument("--batches", type=int, default=3, help="batches per kind (the first warms)")
    p.add_argument("--kv-cache", nargs="+", default=["dynamic", "static"])
    p.add_argument("--work", default="/tmp/xtoken_bench_rollout", help="an empty weights folder")
    p.add_argument(
        "--results",
        default=None,
        help="rows appended here (default on a GPU: benchmarks/results/e2e_rollout.jsonl; CPU "
        "runs write none unless given)",
    )
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_rollout: --device cuda but this machine has no CUDA device; pass --device cpu")
        return 2
    weights = Path(args.work) / "policy"  # nothing published: the worker keeps its own init
    dev = device_name(args.device) if args.device.startswith("cuda") else "cpu"
    stamp = {
        "commit": commit(),
        "device": dev,
        "student": args.student,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"device {dev}; student {args.student}; {args.batch} x ({args.prompt_tokens} + "
          f"{args.new_tokens}) tokens a batch")  # fmt: skip
    rows = [{**stamp, **measure(args, kind, weights)} for kind in args.kv_cache]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"{'kv cache':>8} {'first s':>8} {'batch s':>8} {'new tok/s':>10} {'peak GiB':>9} "
          f"{'held GiB':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['kv_cache']:>8} {f(r['first_batch_s'], '.2f'):>8} {f(r['batch_s'], '.2f'):>8} "
              f"{f(r['new_tokens_per_s'], '.0f'):>10} {f(r['peak_alloc_gib'], '.2f'):>9} "
              f"{f(r['reserved_after_gib'], '.2f'):>9}")  # fmt: skip
    results = args.results or (
        str(RESULTS_DIR / "e2e_rollout.jsonl") if args.device.startswith("cuda") else None
    )
    if results:
        append_rows(results, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
