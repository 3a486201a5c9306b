"""Training from a teacher cache against the online teacher: one teacher pass over a corpus
(``xtoken cache build``'s builder), then ``xtoken run`` of the same student, shape and steps
twice on the same GPU: with the teacher live (``--transport``, default the ``cuda_ipc`` ring) and
from the cache (``data.teacher_cache``: no teacher process, the collators attach the targets).

Each row: the build's teacher tokens/s (its loop after the batches that compile the teacher;
the rate with them beside it) and the share of the loop the teacher forward and the top-K encode
take, the cache's bytes per teacher token, and the two
runs' tokens/s (all ranks, after the warm-up) with their ratio ``speedup_vs_online``. The student
step alone is ``benchmarks/e2e/bench_student_step.py`` on the same GPU (its row beside these).

Usage (GPU)::

    python benchmarks/cache/bench_cache_train.py --teacher qwen2.5-7b --student qwen3-1.7b \\
        --teacher-tokenizer deepseek --shape 1x4096 --k 32 --steps 6 --warmup 2

CPU smoke test (tiny models)::

    python benchmarks/cache/bench_cache_train.py --device cpu --teacher tiny --student tiny \\
        --teacher-tokenizer smollm2 --shape 1x64 --k 8 --steps 2 --warmup 1 --transport shm
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="qwen2.5-7b")
    p.add_argument("--student", default="qwen3-1.7b")
    p.add_argument("--teacher-tokenizer", default="deepseek")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="1x4096")
    p.add_argument("--mode", default="pkl")
    p.add_argument("--k", type=int, default=32, help="top-K ids kept per teacher position")
    p.add_argument("--transport", default="cuda_ipc", help="the online run's transport")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--build-texts",
        type=int,
        default=0,
        help="texts the build reads (default: the runs' own; more give a steadier build rate)",
    )
    p.add_argument("--work", default="/tmp/xtoken_bench_cache")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "teacher_cache.jsonl"))
    p.add_argument(
        "--arms",
        nargs="+",
        default=["online", "cached"],
        choices=["online", "cached"],
        help="the runs to make (online alone: no build; each arm on its own GPU, in parallel)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="trace this many steps after the warm-up with torch.profiler in each run "
        "(trainer.observe.profile_steps: RUN_DIR/profile/)",
    )
    p.add_argument(
        "--vocab-topk",
        default="default",
        help="P-KL's kept teacher columns in both arms: default (the loss's), all (every column, "
        "the setting top-K targets call for), or a number",
    )
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    args.pack = False
    args.pack_window = 1
    args.mps = False
    return args


def build_cache(args, B: int, T: int, corpus: Path, limit: int, out: Path):
    """One teacher pass over the first ``limit`` texts of ``corpus`` into ``out`` (the
    :class:`~services.cache.build.BuildSummary`)."""
    import shutil

    from services.cache.build import BuildOptions, CacheBuilder
    from services.supervise.config import run_config_from_dict

    shutil.rmtree(out, ignore_errors=True)
    config = run_config_from_dict(
        {
            "run_dir": str(out.parent / "build_run"),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "ctx_student": T,
            "ctx_teacher": T,
            "data": {"train": str(corpus), "limit": limit},
            "teacher": {
                "model": args.teacher,
                "device": args.device,
                "max_batch": B,
                "max_length": T,
                "top_k": args.k,
            },
            "trainer": {"feed": {"micro_batch": B}, "loss": {"mode": args.mode}},
        }
    )
    return CacheBuilder(config, BuildOptions(out=str(out), k=args.k, progress=False)).run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_pipeline import build_projection, long_corpus, pipeline, pipeline_limit

    from xtoken_core.cache.manifest import read_manifest
    from xtoken_core.models.loading import student_vocab_size
    from xtoken_core.tokenizers import load_tokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    B, T = (int(x) for x in args.shape.split("x"))
    corpus = long_corpus(work / f"corpus_{T}.jsonl", chars=6 * T, count=max(400, args.build_texts))
    projection = build_projection(args, work)
    limit = pipeline_limit(args, B, T, grad_accum=args.grad_accum)
    cache = work / f"cache_{args.teacher}_k{args.k}"
    built, manifest = None, {}
    if "cached" in args.arms:
        built = build_cache(args, B, T, corpus, max(limit, args.build_texts), cache)
        manifest = read_manifest(cache)
    runs = {"online": {}, "cached": {}}
    trainer_extra: dict = {}
    if args.profile_steps:
        trainer_extra["observe"] = {
            "profile_steps": args.profile_steps,
            "profile_start": args.warmup + 1,
        }
    if args.vocab_topk != "default":  # both arms alike: P-KL's kept teacher columns
        vocab_topk = None if args.vocab_topk == "all" else int(args.vocab_topk)
        trainer_extra["loss"] = {"vocab_topk": vocab_topk}
    for arm, extra in (
        ("online", {}),
        ("cached", {"teacher_cache": str(cache)}),
    ):
        if arm not in args.arms:
            continue
        runs[arm] = pipeline(
            args, args.mode, B, T, args.student, args.teacher, corpus, projection,
            args.transport, work / f"run_{arm}", grad_accum=args.grad_accum,
            teacher_extra={"top_k": args.k}, data_extra=extra, trainer_extra=trainer_extra or None,
        )  # fmt: skip
    online, cached = runs["online"].get("tokens_per_s"), runs["cached"].get("tokens_per_s")
    row = {
        "bench": "teacher_cache_train",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name() if args.device == "cuda" else "cpu",
        "teacher": args.teacher,
        "student": args.student,
        # the trainer's output-layer rows: a preset's tokenizer ids rounded up to 128
        "student_vocab": student_vocab_size(
            args.student, load_tokenizer(args.student_tokenizer).vocab_size
        ),
        "shape": args.shape,
        "mode": args.mode,
        "k": args.k,
        "vocab_topk": args.vocab_topk,
        "bytes_per_teacher_token": manifest.get("bytes_per_teacher_token"),
        "build_tokens_per_s": built and (built.steady_tokens_per_s or built.tokens_per_s),
        "build_tokens_per_s_with_warmup": built and built.tokens_per_s,
        "build_teacher_tokens": built and built.teacher_tokens,
        "build_forward_share": built.forward_s / built.seconds if built and built.seconds else None,
        "tokens_per_s_online": online,
        "tokens_per_s_cached": cached,
        "speedup_vs_online": cached / online if online and cached else None,
        "peak_mem_gib_online": (runs["online"].get("peak_mem_mb") or 0) / 1024 or None,
        "peak_mem_gib_cached": (runs["cached"].get("peak_mem_mb") or 0) / 1024 or None,
        "transport_online": args.transport if "online" in args.arms else None,
        # mean ms per step of each phase (rank 0's measured steps) and between the steps
        **{
            f"split_ms_{arm}": {k: round(1000 * v, 2) for k, v in runs[arm]["split_s"].items()}
            for arm in ("online", "cached")
            if runs[arm].get("split_s")
        },
        **{
            f"between_steps_ms_{arm}": runs[arm].get("between_steps_ms")
            for arm in ("online", "cached")
            if runs[arm].get("split_s")
        },
        "error": runs["online"].get("error") or runs["cached"].get("error"),
        "tag": args.tag,
    }
    append_rows(Path(args.out), [row])
    print(json.dumps(row, indent=1))
    return 0 if not row["error"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
