"""Two teachers of different tokenizer families in one run against each teacher alone: three
``xtoken run`` runs of the same student, shape and steps (bench_pipeline.py's ``pipeline``: queue,
collator, teacher groups and trainer ranks as real processes), colocated on the same GPUs:
teacher A alone, teacher B alone, then A with B as ``extra_teachers`` (weights 0.5 / 0.5).

Each row: tokens/s of all ranks after the warm-up, end-to-end MFU over the GPUs' dense bf16 peak
(the student step's and every teacher forward's FLOPs, causal count), peak trainer memory, and
for the two-teacher run its tokens/s over each single-teacher run's (``vs_a``, ``vs_b``) and
``vs_serial`` = its tokens/s x (1/a + 1/b): above 1 when one run with both teachers costs less
than the two single-teacher runs back to back (the student step is paid once).

Usage (GPU)::

    python benchmarks/teachers/bench_two_teachers.py --teacher-a qwen2.5-7b:deepseek \\
        --teacher-b teacher-1.5b:qwen3 --student qwen3-1.7b --shape 1x4096

CPU smoke test (tiny models)::

    python benchmarks/teachers/bench_two_teachers.py --device cpu --teacher-a tiny:smollm2 \\
        --teacher-b tiny:deepseek --student tiny --shape 1x64 --steps 2 --warmup 1 \\
        --transport shm
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))
sys.path.insert(0, str(ROOT / "benchmarks" / "teachers"))

from benchmarks._common import append_rows, commit, device_name  # noqa: E402


def teacher_spec(text: str) -> tuple[str, str]:
    """``MODEL:TOKENIZER`` as its two parts."""
    model, sep, tokenizer = text.rpartition(":")
    if not sep or not model or not tokenizer:
        raise argparse.ArgumentTypeError(f"{text!r}: give a teacher as MODEL:TOKENIZER")
    return model, tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-a", type=teacher_spec, default=("qwen2.5-7b", "deepseek"))
    p.add_argument("--teacher-b", type=teacher_spec, default=("teacher-1.5b", "qwen3"))
    p.add_argument("--student", default="qwen3-1.7b")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=1, help="trainer ranks, each with both teachers")
    p.add_argument("--shape", default="1x4096")
    p.add_argument("--mode", default="pkl")
    p.add_argument("--transport", default="cuda_ipc")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=["a", "b", "ab"], choices=["a", "b", "ab"])
    p.add_argument("--work", default="/tmp/xtoken_bench_two_teachers")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "teachers.jsonl"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    args.pack = False
    args.pack_window = 1
    args.mps = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_pipeline import build_projection, long_corpus, pipeline
    from bench_teachers import PEAK_BF16, shape_of

    from xtoken_core.tokenizers import load_tokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    B, T = (int(x) for x in args.shape.split("x"))
    corpus = long_corpus(work / f"corpus_{T}.jsonl", chars=6 * T, count=400)
    student = shape_of(args.student, load_tokenizer(args.student_tokenizer).vocab_size)
    s_flops = 6 * student["params"] + 6 * student["layers"] * student["q_dim"] * T
    teachers = {}
    for arm, (model, tokenizer) in (("a", args.teacher_a), ("b", args.teacher_b)):
        targs = copy.copy(args)
        targs.teacher_tokenizer = tokenizer
        shape = shape_of(model, load_tokenizer(tokenizer).vocab_size)
        teachers[arm] = {
            "model": model,
            "tokenizer": tokenizer,
            "projection": build_projection(targs, work) if args.mode != "ce" else None,
            "flops": 2 * shape["params"] + 2 * shape["layers"] * shape["q_dim"] * T,
        }
    device = device_name() if args.device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    gpus = list(range(args.gpus))
    rows, rate = [], {}
    for arm in args.arms:
        first = teachers[arm[0]]
        targs = copy.copy(args)
        targs.teacher_tokenizer = first["tokenizer"]
        teacher_extra: dict = {"weight": 0.5 if arm == "ab" else 1.0}
        trainer_extra: dict = {}
        if args.device == "cuda":
            teacher_extra["gpus"] = gpus
            trainer_extra["gpus"] = gpus
        run_extra = {}
        if arm == "ab":
            second = teachers["b"]
            run_extra["extra_teachers"] = [
                {
                    "model": second["model"],
                    "tokenizer": second["tokenizer"],
                    "projection": second["projection"],
                    "weight": 0.5,
                }
            ]
        t0 = time.perf_counter()
        got = pipeline(
            targs, args.mode, B, T, args.student, first["model"], corpus, first["projection"],
            args.transport, work / f"run_{arm}", trainers=args.gpus, grad_accum=args.grad_accum,
            teacher_extra=teacher_extra, trainer_extra=trainer_extra, run_extra=run_extra,
        )  # fmt: skip
        tps = got.get("tokens_per_s")
        rate[arm] = tps
        flops = s_flops + sum(teachers[t]["flops"] for t in arm)
        row = {
            "bench": "two_teachers",
            "commit": commit(),
            "date": time.strftime("%Y-%m-%d"),
            "device": device,
            "gpus": args.gpus,
            "layout": "coloc",
            "teachers": [f"{teachers[t]['model']}:{teachers[t]['tokenizer']}" for t in arm],
            "teacher": teachers[arm[0]]["model"],
            "student": args.student,
            "shape": args.shape,
            "grad_accum": args.grad_accum,
            "mode": args.mode,
            "transport": args.transport,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / args.gpus if tps else None,
            "mfu_e2e": flops * tps / (args.gpus * peak) if tps and peak else None,
            "peak_mem_gib": (got.get("peak_mem_mb") or 0) / 1024 or None,
            "step_s": got.get("step_s"),
            "teacher_wait_ms": got.get("teacher_wait_ms"),
            "error": got.get("error"),
            "wall_s": time.perf_counter() - t0,
            "tag": args.tag,
        }
        if arm == "ab" and tps:
            a, b = rate.get("a"), rate.get("b")
            row["vs_a"] = tps / a if a else None
            row["vs_b"] = tps / b if b else None
            row["vs_serial"] = tps * (1 / a + 1 / b) if a and b else None
        rows.append(row)
        append_rows(Path(args.out), [row])
        print(json.dumps({k: row.get(k) for k in ("teachers", "tokens_per_s", "mfu_e2e", "error")}))
    print(f"\n{'teachers':44} {'tok/s':>9} {'MFU':>6} {'peak GiB':>8}")
    for r in rows:
        print(
            f"{' + '.join(r['teachers']):44} {r['tokens_per_s'] or 0:9.0f} "
            f"{r['mfu_e2e'] or 0:6.3f} {r['peak_mem_gib'] or 0:8.1f}"
            + (f"  vs A {r['vs_a']:.3f}, vs B {r['vs_b']:.3f}" if r.get("vs_a") else "")
            + (f"  error: {r['error']}" if r["error"] else "")
        )
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
