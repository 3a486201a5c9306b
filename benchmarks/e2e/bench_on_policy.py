"""On-policy distillation at the hardware's pace: the trainer's tokens/s with
``data.on_policy_fraction`` 0, 0.5 and 1, the rollout workers' generated tokens/s, and how long
the trainer waits for rollouts.

For each fraction, ``xtoken run`` of the same models on one machine (queue, collator unless the
fraction is 1, teacher, trainer, and with a fraction above 0 the rollout workers, all on the
GPU; the weights reach the rollouts by CUDA IPC):

* trainer tokens/s from rank 0's step records after the warm-up (wall time between their starts; the
  tokens of on-policy samples are their prompt and continuation), its step-time split, the share
  of its step it waits for data (``data_wait``) and for rollouts (``on_policy.wait_s``);
* the rollouts' generated tokens/s: all workers' continuation tokens over the wall time of their
  batches (waits included), and while sampling only; samples/s;
* the on-policy samples' mean staleness (weight publications), the samples dropped as stale, and
  the teacher's log-prob per byte of the continuations at the first and last measured steps.

The bar: at fraction 0.5 the trainer waits < 5% of its step for data.

Usage (GPU; presets with random weights, saved once as local folders like bench_pipeline.py)::

    python benchmarks/e2e/bench_on_policy.py --shape 4x2048 --fractions 0 0.5 1 [--kv-cache dynamic static]

CPU smoke test (tiny models, a few steps; prints the table, writes no results)::

    python benchmarks/e2e/bench_on_policy.py --device cpu --student tiny --teacher tiny \\
        --student-tokenizer mistral --teacher-tokenizer smollm2 --student-vocab 0 \\
        --teacher-vocab 0 --shape 2x64 --prompt-tokens 16 --new-tokens 16 --rollout-batch 4 \\
        --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    append_rows,
    commit,
    device_name,
    steady_rate,
)


def run_fraction(
    args, fraction: float, B: int, T: int, student_dir: str, teacher_dir: str, corpus: Path,
    projection: str, run_dir: Path, kv_cache: str = "dynamic",
) -> dict:  # fmt: skip
    """``xtoken run`` with ``fraction`` of each step on-policy; the figures of its records."""
    from services.common.metrics import read_jsonl
    from services.supervise.config import run_config_from_dict
    from services.supervise.driver import Driver

    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    n_steps = args.warmup + args.steps
    config = run_config_from_dict(
        {
            "run_dir": str(run_dir),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "ctx_student": T,
            "ctx_teacher": T,
            "rollouts": args.rollouts,
            "data": {
                "train": str(corpus),
                "heldout": str(corpus),
                "limit": B * args.grad_accum * (n_steps + 4),
                "on_policy_fraction": fraction,
            },
            "collator": {"workers": 2, "batch": max(1, B)},
            "teacher": {
                "model": teacher_dir,
                "device": args.device,
                "transport": "cuda_ipc" if args.device == "cuda" else "shm",
                "max_batch": B,
                "max_length": T,
            },
            "rollout": {
                "device": args.device,
                "prompt_tokens": args.prompt_tokens,
                "max_new_tokens": args.new_tokens,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "batch": args.rollout_batch,
                "kv_cache": kv_cache,
            },
            "trainer": {
                "student": {"model": student_dir},
                "compute": {"device": args.device},
                "feed": {"micro_batch": B, "grad_accum": args.grad_accum},
                "schedule": {
                    "max_steps": n_steps,
                    "checkpoint_every": 0,
                    "final_checkpoint": False,
                    "eval_every": 0,
                    "export": False,
                },
                "optim": {"warmup_steps": 0},
                "loss": {"mode": args.mode, "projection": projection},
                "on_policy": {"sync_every": args.sync_every, "max_staleness": args.max_staleness},
            },
        }
    )
    run = Driver(config, progress=False)
    t0 = time.perf_counter()
    code = run.run()
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": run.failure, "wall_s": wall}
    steps = [
        r for r in read_jsonl(run_dir / "metrics" / "trainer.rank0.jsonl") if r["event"] == "step"
    ]
    measured = [r for r in steps if r["step"] > args.warmup]
    rate, _, _ = steady_rate(steps, args.warmup)
    tokens = sum(r["tokens"] for r in measured)
    step_s = statistics.mean(r["step_s"] for r in measured)
    split = {k: statistics.mean(r["times"][k] for r in measured) for k in measured[0]["times"]}
    row = {
        "tokens_per_s": rate or tokens / sum(r["step_s"] for r in measured),
        "step_s": step_s,
        "split_s": split,
        "data_wait_fraction": split.get("data_wait", 0.0) / step_s if step_s else None,
        "wall_s": wall,
    }
    on_policy = [r["on_policy"] for r in measured if r.get("on_policy")]
    if on_policy:
        trained = sum(o["samples"] for o in on_policy)
        logprobs = [
            o["teacher_logprob_per_byte"] for o in on_policy if o["teacher_logprob_per_byte"]
        ]
        row.update(
            rollout_wait_fraction=statistics.mean(o["wait_s"] for o in on_policy) / step_s,
            on_policy_samples=trained,
            mean_staleness=(
                sum(o["samples"] * (o["mean_staleness"] or 0.0) for o in on_policy) / trained
                if trained else None
            ),
            dropped_stale=on_policy[-1]["dropped_stale"],
            teacher_logprob_per_byte=[logprobs[0], logprobs[-1]] if logprobs else None,
        )  # fmt: skip
        row.update(
            _generation(
                run_dir, args.rollouts, steps[args.warmup - 1]["time"] if args.warmup else 0.0
            )
        )
    return row


def _generation(run_dir: Path, rollouts: int, since: float) -> dict:
    """The rollout workers' batches put after ``since``: generated tokens/s over their wall time
    (waits included) and while sampling, samples/s."""
    from services.common.metrics import read_jsonl

    every = []
    for i in range(rollouts):
        path = run_dir / "metrics" / f"rollout{i}.jsonl"
        if path.exists():
            every += [r for r in read_jsonl(path) if r["event"] == "rollout"]
    batches = [r for r in every if r["time"] > since]

    def rate_while_sampling(rs: list[dict]) -> float | None:
        # every worker's tokens over one worker's mean busy time (one batch: that worker's rate)
        busy = sum(r["sample_s"] + r["collate_s"] for r in rs) / min(rollouts, len(rs))
        return sum(r["generated_tokens"] for r in rs) / busy if busy else None

    if not batches:  # the workers filled ahead during the warm-up and waited since
        return {
            "generated_tokens_per_s": None,
            "generated_tokens_per_s_sampling": rate_while_sampling(every) if every else None,
            "sampling_rate_over": "whole run" if every else None,
            "rollout_batches": 0,
        }
    sampling = rate_while_sampling(batches)
    if len(batches) < 2:  # no span between puts: only the rate while sampling
        return {
            "generated_tokens_per_s": None,
            "generated_tokens_per_s_sampling": sampling,
            "rollout_batches": 1,
        }
    times = sorted(r["time"] for r in batches)
    span = times[-1] - times[0]
    counted = [r for r in batches if r["time"] > times[0]]  # what was made within the span
    generated = sum(r["generated_tokens"] for r in counted)
    return {
        "generated_tokens_per_s": generated / span if span else None,
        "generated_tokens_per_s_sampling": sampling,
        "generated_samples_per_s": sum(r["samples"] for r in counted) / span if span else None,
        "rollout_batches": len(batches),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4x2048", help="trainer micro-batch BxT")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    p.add_argument("--mode", default="pkl", choices=["pkl", "gold", "xtoken"])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--rollouts", type=int, default=1, help="rollout worker processes")
    p.add_argument("--rollout-batch", type=int, default=16, help="prompts sampled together")
    p.add_argument(
        "--kv-cache",
        nargs="+",
        choices=["dynamic", "static"],
        default=["dynamic"],
        help="the rollouts' KV cache kinds, each a run per fraction",
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=384, help="tokens sampled per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--max-staleness", type=int, default=4)
    bp.add_model_args(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--results",
        default=None,
        help="rows appended here (default on a GPU: benchmarks/results/e2e_on_policy.jsonl; "
        "CPU runs write none unless given)",
    )
    args = p.parse_args()
    if args.results is None and args.device == "cuda":
        args.results = str(RESULTS_DIR / "e2e_on_policy.jsonl")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XTOKEN_CACHE", str(work / "cache"))
    student_dir, teacher_dir = bp.save_models(args, work)
    projection = bp.build_projection(args, work)
    B, T = (int(x) for x in args.shape.split("x"))
    corpus = bp.long_corpus(
        work / f"corpus_{T}.jsonl",
        chars=8 * T,
        count=B * args.grad_accum * (args.steps + args.warmup + 8),
    )
    dev = device_name() if args.device == "cuda" else "cpu"
    stamp = {
        "commit": commit(),
        "device": dev,
        "student": args.student,
        "teacher": args.teacher,
        "shape": args.shape,
        "mode": args.mode,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rollouts": args.rollouts,
        "rollout_batch": args.rollout_batch,
        "sync_every": args.sync_every,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"device {dev}; student {args.student} teacher {args.teacher}; {args.shape} {args.mode}")
    header = (
        f"{'kv':>7} {'lambda':>6} {'tok/s':>8} {'step s':>7} {'data wait':>9} {'rollout wait':>12} "
        f"{'gen tok/s':>9} {'gen tok/s busy':>14} {'staleness':>9} {'dropped':>7} "
        f"{'teacher lp/B first->last':>24}"
    )
    lines = []
    runs = [(kv, f) for kv in args.kv_cache for f in args.fractions]
    for kv, fraction in runs:
        row = run_fraction(
            args, fraction, B, T, student_dir, teacher_dir, corpus, projection,
            work / f"run_{args.shape}_{fraction:g}_{kv}", kv_cache=kv,
        )  # fmt: skip
        bp._free()
        if args.results:
            append_rows(
                args.results, [{**stamp, "kv_cache": kv, "on_policy_fraction": fraction, **row}]
            )
        if "error" in row:
            print(f"lambda {fraction:g} ({kv} KV cache): failed: {row['error']}")
            continue
        lp = row.get("teacher_logprob_per_byte")
        lines.append(
            f"{kv:>7} {fraction:>6g} {row['tokens_per_s']:>8.0f} {row['step_s']:>7.3f} "
            f"{_pct(row['data_wait_fraction']):>9} {_pct(row.get('rollout_wait_fraction')):>12} "
            f"{bp._f(row.get('generated_tokens_per_s'), 0):>9} "
            f"{bp._f(row.get('generated_tokens_per_s_sampling'), 0):>14} "
            f"{bp._f(row.get('mean_staleness'), 2):>9} {row.get('dropped_stale', '-')!s:>7} "
            f"{(f'{lp[0]:.3f} -> {lp[1]:.3f}' if lp else '-'):>24}"
        )
        print(f"lambda {fraction:g} ({kv} KV cache): {json.dumps(row)}")
    print(header)
    print("\n".join(lines))
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
