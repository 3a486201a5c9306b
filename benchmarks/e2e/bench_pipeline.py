"""Pipeline vs bare compute: does the data plane + teacher hand-off cost <= 10% of tokens/s?

For each shape (B x T) and loss mode, in one run on one machine:

* **bare**: one process, no queue, no IPC: teacher forward (bf16, no grad) + the student's
  optimizer step with the same loss (services.trainer.worker.TrainerWorker.train_step), on the
  same collated samples; tokens/s from CUDA-synchronized wall time.
* **pipeline**: ``xtoken run`` of the same models: queue, collator, teacher (``cuda_ipc`` or
  ``hidden``) and trainer as real processes on one GPU; tokens/s from the trainer's step records
  after the warm-up (wall time between records), the step-time split, the trainer's wait for data
  and teacher, and the bytes each transport moves per step.

Models are built from presets (random weights) and saved once as local HF folders, so every
process loads the same weights fast. The student's MFU counts 6 * params * tokens plus the
attention term, against the GPU's dense bf16 peak.

Usage (GPU)::

    python benchmarks/e2e/bench_pipeline.py --shapes 1x4096 4x2048 --modes pkl gold xtoken

CPU smoke test::

    python benchmarks/e2e/bench_pipeline.py --device cpu --student tiny --teacher tiny \
        --shapes 1x64 --modes pkl --transports shm --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS_DIR, append_rows, commit, device_name  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def _peak(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def long_corpus(path: Path, chars: int, count: int) -> Path:
    """A JSONL of ``count`` long texts (demo corpus texts joined) for T-token contexts."""
    from xtoken_core.data.corpus import build_demo_corpus, iter_texts

    demo = build_demo_corpus()
    texts, buf = [], []
    for _, text in iter_texts(str(demo.train_path)):
        buf.append(text)
        if sum(len(t) for t in buf) >= chars:
            texts.append("\n\n".join(buf))
            buf = []
            if len(texts) >= count:
                break
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def save_models(args, out: Path) -> tuple[str, str]:
    """Build the student and teacher presets once and save them as HF folders."""
    from xtoken_core.models import export_hf, load_model
    from xtoken_core.tokenizers import load_tokenizer

    dirs = []
    for who, preset, tok, vocab in (
        ("student", args.student, args.student_tokenizer, args.student_vocab),
        ("teacher", args.teacher, args.teacher_tokenizer, args.teacher_vocab),
    ):
        d = out / f"{who}_{preset}"
        if not (d / "config.json").is_file():
            vocab = vocab or load_tokenizer(tok).vocab_size
            t0 = time.perf_counter()
            model = load_model(preset, vocab_size=vocab, dtype=torch.float32, seed=1)
            export_hf(model, d, tokenizer=tok)
            del model
            print(f"  built {who} {preset} (vocab {vocab}) in {time.perf_counter() - t0:.0f}s")
        dirs.append(str(d))
    return dirs[0], dirs[1]


def build_projection(args, work: Path) -> str:
    """The top-8 projection file for ``args``' student and teacher tokenizers, built (or found in
    the cache) the way ``xtoken run`` builds one when a run config names none."""
    from services.run import Run, run_config_from_dict
    from xtoken_core.tokenizers import load_tokenizer

    prep = Run(
        run_config_from_dict(
            {
                "run_dir": str(work / "prep"),
                "student_tokenizer": args.student_tokenizer,
                "teacher_tokenizer": args.teacher_tokenizer,
                "projection_top_k": 8,
            }
        )
    )
    return str(
        prep._projection(
            load_tokenizer(args.student_tokenizer), load_tokenizer(args.teacher_tokenizer)
        )
    )


def collated(args, B: int, T: int, corpus: Path, n: int) -> list[dict]:
    """``n`` padded micro-batches of B samples collated at ctx T (both sides)."""
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.data.corpus import iter_texts
    from xtoken_core.tokenizers import load_tokenizer

    collator = CrossTokenizerCollator(
        student_tokenizer=load_tokenizer(args.student_tokenizer),
        teacher_tokenizer=load_tokenizer(args.teacher_tokenizer),
        aligner=TokenAligner(),
        ctx_length_student=T,
        ctx_length_teacher=T,
    )
    texts = [t for _, t in iter_texts(str(corpus))]
    out = []
    for i in range(n):
        chunk = [texts[(i * B + j) % len(texts)] for j in range(B)]
        out.append(collator(chunk))
    return out


def bare(
    args,
    mode: str,
    B: int,
    T: int,
    student_dir: str,
    teacher_dir: str,
    corpus: Path,
    projection: str,
) -> dict:
    """Teacher forward + student step in one process; tokens/s."""
    from services.trainer.config import LossConfig, OptimConfig, TrainerConfig
    from services.trainer.worker import MicroBatch, TrainerWorker
    from xtoken_core.models import load_model

    device = torch.device(args.device)
    cfg = TrainerConfig(
        student=student_dir,
        student_tokenizer=args.student_tokenizer,
        teacher_tokenizer=args.teacher_tokenizer,
        device=args.device,
        micro_batch=B,
        max_steps=args.warmup + args.steps,
        optim=OptimConfig(warmup_steps=0),
        loss=LossConfig(mode=mode, projection=projection),
    )
    worker = TrainerWorker(cfg, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = load_model(teacher_dir, dtype=dtype, device=device).eval().requires_grad_(False)
    batches = collated(args, B, T, corpus, 4)

    def step(batch: dict) -> None:
        with torch.no_grad():
            ids = batch["teacher_input_ids"].to(device, non_blocking=True)
            logits = teacher(
                input_ids=ids, attention_mask=batch["teacher_token_mask"].to(device).long()
            ).logits
        mb = MicroBatch(keys=[], batch=batch, teacher_logits=lambda: logits)
        worker.train_step([mb])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(batches[i % len(batches)])
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        sync()
        times.append(time.perf_counter() - t0)
    tokens = [int(b["input_lengths"].sum()) for b in batches]
    mean_tokens = statistics.mean(tokens)
    step_s = statistics.median(times)
    out = {
        "step_s": step_s,
        "tokens_per_s": mean_tokens / step_s,
        "tokens_per_step": mean_tokens,
        "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30)
        if device.type == "cuda"
        else None,
        "student_params": sum(p.numel() for p in worker.module.parameters()),
        "student_layers": worker.module.config.num_hidden_layers,
        "student_hidden": worker.module.config.hidden_size,
    }
    return out


def pipeline(
    args,
    mode: str,
    B: int,
    T: int,
    student_dir: str,
    teacher_dir: str,
    corpus: Path,
    projection: str,
    transport: str,
    run_dir: Path,
    trainers: int = 1,
    teacher_device: str | None = None,
    grad_accum: int = 1,
    trainer_extra: dict | None = None,
) -> dict:
    """``xtoken run`` of the same models; tokens/s (all ranks) from rank 0's step records
    (``trainer_extra``: more keys of the run config's trainer section)."""
    import shutil

    from services.common.metrics import read_jsonl
    from services.run import Run, run_config_from_dict

    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    n_steps = args.warmup + args.steps
    config = run_config_from_dict(
        {
            "run_dir": str(run_dir),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "ctx_student": T,
            "ctx_teacher": T,
            "trainers": trainers,
            "teachers": trainers,
            "data": {
                "train": str(corpus),
                "heldout": str(corpus),
                "limit": trainers * B * grad_accum * (n_steps + 4),
            },
            "collator": {"workers": 2, "batch": max(1, B)},
            "teacher": {
                "model": teacher_dir,
                "device": teacher_device or args.device,
                "transport": transport,
                "max_batch": B,
                "max_length": T,
                "slots": 2,
            },
            "trainer": {
                "student": student_dir,
                "device": args.device,
                "micro_batch": B,
                "grad_accum": grad_accum,
                "max_steps": n_steps,
                "checkpoint_every": 0,
                "eval_every": 0,
                "export": False,
                "heldout": None,
                "optim": {"warmup_steps": 0},
                "loss": {"mode": mode, "projection": projection},
                **(trainer_extra or {}),
            },
        }
    )
    config.trainer.heldout = None
    run = Run(config, progress=False)
    t0 = time.perf_counter()
    code = run.run()
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": run.failure, "wall_s": wall}
    steps = [
        r for r in read_jsonl(run_dir / "metrics" / "trainer.rank0.jsonl") if r["event"] == "step"
    ]
    measured = [r for r in steps if r["step"] > args.warmup]
    span = measured[-1]["time"] - steps[args.warmup - 1]["time"] if args.warmup else None
    tokens = sum(r["tokens"] for r in measured)
    split = {k: statistics.mean(r["times"][k] for r in measured) for k in measured[0]["times"]}
    step_s = statistics.mean(r["step_s"] for r in measured)
    waits = split.get("data_wait", 0) + split.get("teacher_wait", 0)
    hidden_bytes = None
    if transport == "hidden":
        hidden = json.loads((Path(teacher_dir) / "config.json").read_text())["hidden_size"]
        hidden_bytes = B * T * hidden * 2
    return {
        "tokens_per_s": tokens / span if span else tokens / sum(r["step_s"] for r in measured),
        "step_s": step_s,
        "split_s": split,
        "wait_fraction": waits / step_s if step_s else None,
        "teacher_wait_ms": 1000 * split.get("teacher_wait", 0.0),
        "bytes_per_step": hidden_bytes if transport == "hidden" else 0,
        "peak_mem_mb": measured[-1].get("memory_mb"),
        "wall_s": wall,
        "feed": measured[-1].get("feed"),
        "losses": [r.get("loss") for r in steps],
    }


def mfu(b: dict, tokens_per_s: float, T: int, peak: float | None) -> float | None:
    """Model FLOPs utilization of the student step (6N per token + attention)."""
    if not peak:
        return None
    flops_per_token = 6 * b["student_params"] + 12 * b["student_layers"] * b["student_hidden"] * T
    return flops_per_token * tokens_per_s / peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x4096", "4x2048"])
    p.add_argument("--modes", nargs="+", default=["pkl", "gold", "xtoken"])
    p.add_argument("--transports", nargs="+", default=["cuda_ipc"])
    p.add_argument(
        "--trainers",
        nargs="+",
        type=int,
        default=[1],
        help="trainer ranks (one colocated teacher each); several: scaling vs the first",
    )
    p.add_argument(
        "--teacher-devices",
        nargs="+",
        default=[None],
        help="teacher device per variant (e.g. cuda:1: the teacher on its own GPU); default: "
        "the trainer's GPU",
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step (pipeline runs)"
    )
    p.add_argument(
        "--same-global-batch",
        action="store_true",
        help="N trainer ranks accumulate max(--trainers)/N times --grad-accum micro-batches, so "
        "every rank count trains the same global batch (scaling runs with comparable curves)",
    )
    p.add_argument("--tag", default="", help="label of these rows (e.g. mps)")
    p.add_argument("--student", default="qwen3-0.6b")
    p.add_argument("--teacher", default="teacher-1.5b")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument("--student-vocab", type=int, default=151936)
    p.add_argument("--teacher-vocab", type=int, default=32768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--work", default="/tmp/xtoken_bench_e2e")
    p.add_argument(
        "--results", default=str(RESULTS_DIR / "e2e_pipeline.jsonl"), help="rows appended here"
    )
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XTOKEN_CACHE", str(work / "cache"))
    student_dir, teacher_dir = save_models(args, work)
    projection = build_projection(args, work)
    dev = device_name() if args.device == "cuda" else "cpu"
    peak = _peak(dev)
    rows = []
    print(f"device {dev}; student {args.student} teacher {args.teacher}")
    print(
        f"{'shape':>8} {'mode':>7} {'transport':>9} {'bare tok/s':>11} {'pipe tok/s':>11} "
        f"{'ratio':>6} {'wait%':>6} {'t_wait ms':>9} {'MFU':>6}"
    )
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        corpus = long_corpus(
            work / f"corpus_{T}.jsonl", chars=8 * T, count=B * (args.steps + args.warmup + 8)
        )
        for mode in args.modes:
            b = bare(args, mode, B, T, student_dir, teacher_dir, corpus, projection)
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the bare models are gone: give their memory back
            for transport in args.transports:
                base = None
                for n, tdev in ((n, d) for d in args.teacher_devices for n in args.trainers):
                    accum = args.grad_accum
                    if args.same_global_batch:
                        accum = args.grad_accum * max(args.trainers) // n
                    run_dir = work / f"run_{shape}_{mode}_{transport}_r{n}_{tdev or 'same'}"
                    pl = pipeline(
                        args,
                        mode,
                        B,
                        T,
                        student_dir,
                        teacher_dir,
                        corpus,
                        projection,
                        transport,
                        run_dir,
                        trainers=n,
                        teacher_device=tdev,
                        grad_accum=accum,
                    )
                    row = {
                        "shape": shape,
                        "mode": mode,
                        "transport": transport,
                        "trainers": n,
                        "teacher_device": tdev or "same GPU",
                        "grad_accum": accum,
                        "tag": args.tag,
                    }
                    if "error" in pl:
                        print(
                            f"{shape:>8} {mode:>7} {transport:>9} x{n} FAILED: {pl['error'][:400]}"
                        )
                        rows.append({**row, **pl})
                        continue
                    base = base or pl["tokens_per_s"]
                    ratio = pl["tokens_per_s"] / b["tokens_per_s"]
                    m = mfu(b, pl["tokens_per_s"] / n, T, peak)
                    print(
                        f"{shape:>8} {mode:>7} {transport:>9} x{n} t={tdev or 'same'} {args.tag} "
                        f"{b['tokens_per_s']:>11.0f} "
                        f"{pl['tokens_per_s']:>11.0f} {ratio:>6.3f} {100 * pl['wait_fraction']:>6.2f} "
                        f"{pl['teacher_wait_ms']:>9.2f} {'-' if m is None else f'{m:.3f}':>6} "
                        f"scaling {pl['tokens_per_s'] / base:.3f}"
                    )
                    split = {k: round(v, 4) for k, v in pl["split_s"].items()}
                    print(
                        f"           split (s/step): {json.dumps(split)}  bytes/step "
                        f"{pl['bytes_per_step']}  feed {pl['feed']}"
                    )
                    rows.append(
                        {
                            **row,
                            "bare": b,
                            "pipeline": pl,
                            "ratio": ratio,
                            "student_mfu": m,
                            "scaling": pl["tokens_per_s"] / base,
                        }
                    )
    stamp = {
        "commit": commit(),
        "device": dev,
        "student": args.student,
        "teacher": args.teacher,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    append_rows(args.results, [{**stamp, **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
