"""Teacher layouts end to end: a big teacher and its student over a machine's GPUs, every layout
that fits, as ``xtoken run`` runs them (queue, collator, teacher groups and trainer ranks as real
processes; benchmarks/e2e/bench_pipeline.py's ``pipeline``).

A layout names how the GPUs are shared (``N`` = ``--gpus``):

* ``coloc``: N trainer ranks, N one-GPU teachers, rank r and teacher r on GPU r;
* ``coloc-tpK``: N trainer ranks, N/K teacher groups of K ranks over all N GPUs (every GPU holds
  a trainer rank and a teacher shard);
* ``dedicated``: N/2 trainer ranks on the first half, N/2 one-GPU teachers on the other;
* ``dedicated-tpK``: N-K trainer ranks on the first GPUs, one teacher group of K ranks on the
  last K GPUs, serving them all.

Each row: tokens/s of all ranks (from rank 0's step records, after the warm-up), per GPU, the
end-to-end MFU over all N GPUs' dense bf16 peak (the student step's ``6 N + 6 L q T`` and the
teacher forward's ``2 N + 2 L q T`` FLOPs per token, causal attention), the bytes per teacher
token of the transport, and the peak memory of a trainer rank and of teacher rank 0.

Usage (4 GPUs)::

    python benchmarks/teachers/bench_teachers.py --gpus 4 --teacher qwen2.5-32b \\
        --student qwen3-1.7b --layouts coloc-tp2 coloc-tp4 dedicated-tp2 --shape 1x4096

CPU smoke test (gloo tensor parallelism, tiny models)::

    python benchmarks/teachers/bench_teachers.py --device cpu --gpus 2 --teacher tiny \\
        --student tiny --layouts coloc coloc-tp2 --shape 1x64 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))

from benchmarks._common import append_rows, commit, device_name  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def layout_of(name: str, gpus: int) -> dict:
    """The run-config keys of a layout (see the module docstring) on ``gpus`` GPUs.

    Raises:
        ValueError: an unknown layout, or one the GPU count cannot hold.
    """
    kind, _, tp = name.partition("-tp")
    k = int(tp) if tp else 1
    if kind == "coloc":
        if gpus % k:
            raise ValueError(f"layout {name}: {gpus} GPUs do not divide into groups of {k}")
        trainer, teachers = list(range(gpus)), gpus // k
        teacher = list(range(gpus))
    elif kind == "dedicated" and k == 1:
        half = max(1, gpus // 2)
        trainer, teachers, teacher = list(range(half)), half, list(range(half, 2 * half))
    elif kind == "dedicated":
        if gpus <= k:
            raise ValueError(f"layout {name}: needs more than {k} GPUs")
        trainer, teachers, teacher = list(range(gpus - k)), 1, list(range(gpus - k, gpus))
    else:
        raise ValueError(f"unknown layout {name!r}: use coloc, coloc-tpK, dedicated, dedicated-tpK")
    return {"trainers": len(trainer), "trainer_gpus": trainer, "teachers": teachers,
            "tp": k, "teacher_gpus": teacher}  # fmt: skip


def shape_of(spec: str, vocab: int) -> dict:
    """Parameters, layers and attention width of a model spec (a preset or a local folder),
    counted on the meta device."""
    from services.supervise.layout import model_config, parameter_count

    cfg = model_config(spec, vocab)
    if cfg is None:
        raise ValueError(f"model {spec!r}: no config to count (use a preset or a local folder)")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {
        "params": parameter_count(cfg),
        "layers": text.num_hidden_layers,
        "q_dim": heads * head_dim,
        "hidden": text.hidden_size,
        "vocab": vocab,
    }


def bytes_per_teacher_token(transport: str, teacher: dict, top_k: int) -> int:
    """What one teacher token costs the transport: bf16 logits (rings), bf16 hidden states, or
    the top-K payload."""
    if transport == "hidden":
        return 2 * teacher["hidden"]
    if transport == "topk":
        from xtoken_core.wire.topk import topk_bytes_per_token

        return topk_bytes_per_token(top_k)
    return 2 * teacher["vocab"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="qwen2.5-32b")
    p.add_argument("--student", default="qwen3-1.7b")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--layouts", nargs="+", default=["coloc-tp2", "coloc-tp4", "dedicated-tp2"])
    p.add_argument("--shape", default="1x4096")
    p.add_argument("--mode", default="pkl")
    p.add_argument("--transport", default="cuda_ipc")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--work", default="/tmp/xtoken_bench_teachers")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "teachers.jsonl"))
    p.add_argument("--tag", default="")
    p.add_argument(
        "--mps",
        action="store_true",
        help="run with mps: true (the teacher's and the trainers' kernels on one GPU side by "
        "side instead of in turns; needs nvidia-cuda-mps-control)",
    )
    p.add_argument(
        "--forward-rows", type=int, default=None, help="teacher.forward_rows (default: its own)"
    )
    p.add_argument(
        "--ahead-steps",
        type=int,
        default=None,
        help="trainer.feed.ahead_steps (default: its own, 1)",
    )
    args = p.parse_args()
    args.pack = False
    args.pack_window = 1

    from bench_pipeline import build_projection, long_corpus, pipeline

    from xtoken_core.tokenizers import load_tokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    B, T = (int(x) for x in args.shape.split("x"))
    s_vocab = load_tokenizer(args.student_tokenizer).vocab_size
    t_vocab = load_tokenizer(args.teacher_tokenizer).vocab_size
    student, teacher = shape_of(args.student, s_vocab), shape_of(args.teacher, t_vocab)
    s_flops = 6 * student["params"] + 6 * student["layers"] * student["q_dim"] * T
    t_flops = 2 * teacher["params"] + 2 * teacher["layers"] * teacher["q_dim"] * T
    corpus = long_corpus(work / f"corpus_{T}.jsonl", chars=6 * T, count=400)
    projection = build_projection(args, work) if args.mode != "ce" else None
    device = device_name() if args.device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    rows = []
    for name in args.layouts:
        lay = layout_of(name, args.gpus)
        on_gpu = args.device == "cuda"
        teacher_extra = {"tensor_parallel": lay["tp"], "top_k": args.top_k}
        if args.forward_rows is not None:
            teacher_extra["forward_rows"] = args.forward_rows
        trainer_extra = {"student": {"model": args.student}}
        if args.ahead_steps is not None:
            trainer_extra["feed"] = {"ahead_steps": args.ahead_steps}
        if on_gpu:
            teacher_extra["gpus"] = lay["teacher_gpus"]
            trainer_extra["gpus"] = lay["trainer_gpus"]
        t0 = time.perf_counter()
        got = pipeline(
            args, args.mode, B, T, args.student, args.teacher, corpus, projection,
            args.transport, work / f"run_{name}", trainers=lay["trainers"],
            teachers=lay["teachers"], teacher_extra=teacher_extra, trainer_extra=trainer_extra,
            grad_accum=args.grad_accum,
        )  # fmt: skip
        tps = got.get("tokens_per_s")
        row = {
            "bench": "teachers",
            "commit": commit(),
            "device": device,
            "gpus": args.gpus,
            "layout": name,
            "teacher": args.teacher,
            "teacher_tp": lay["tp"],
            "teacher_gpus": lay["teacher_gpus"] if on_gpu else [],
            "trainer_gpus": lay["trainer_gpus"] if on_gpu else [],
            "teachers": lay["teachers"],
            "trainers": lay["trainers"],
            "student": args.student,
            "shape": args.shape,
            "grad_accum": args.grad_accum,
            "mps": args.mps,
            "forward_rows": args.forward_rows,
            "ahead_steps": got.get("ahead_steps"),
            "mode": args.mode,
            "transport": args.transport,
            "top_k": args.top_k if args.transport == "topk" else None,
            "bytes_per_teacher_token": bytes_per_teacher_token(args.transport, teacher, args.top_k),
            "tokens_per_s": tps,
            # tokens over the spans from a step's start to the next's (benchmarks/_common.py)
            "rate": "step_starts",
            "timed_steps": got.get("timed_steps"),
            "tokens_per_s_per_gpu": tps / args.gpus if tps else None,
            "mfu_e2e": (s_flops + t_flops) * tps / (args.gpus * peak) if tps and peak else None,
            "student_params": student["params"],
            "teacher_params": teacher["params"],
            "peak_mem_gib": (got.get("peak_mem_mb") or 0) / 1024 or None,
            "teacher_peak_mem_gib": got.get("teacher_peak_mem_gib"),
            "step_s": got.get("step_s"),
            "teacher_wait_ms": got.get("teacher_wait_ms"),
            # rank 0's step phases, and the wall time between its steps that none accounts for
            "split_ms": {k: round(1000 * v, 2) for k, v in (got.get("split_s") or {}).items()},
            "between_steps_ms": got.get("between_steps_ms"),
            "error": got.get("error"),
            "wall_s": time.perf_counter() - t0,
            "tag": args.tag,
        }
        rows.append(row)
        append_rows(Path(args.out), [row])
        print(json.dumps({k: row[k] for k in ("layout", "tokens_per_s", "mfu_e2e", "error")}))
    print(f"\n{'layout':16} {'tok/s':>9} {'tok/s/GPU':>9} {'MFU':>6} {'peak GiB':>8}")
    for r in rows:
        tps = r["tokens_per_s"]
        print(
            f"{r['layout']:16} {tps or 0:9.0f} {r['tokens_per_s_per_gpu'] or 0:9.0f} "
            f"{r['mfu_e2e'] or 0:6.3f} {r['peak_mem_gib'] or 0:8.1f}"
            + (f"  error: {r['error']}" if r["error"] else "")
        )
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
