"""The distillation pipeline at the hardware's pace: the default step against the eager baseline,
and the pipeline against its own bare compute.

For each shape (B x T) and loss mode (pkl, gold, xtoken, ce), in one run on one machine:

* **eager** (``--baseline eager``): the pipeline with the eager step: fp32 parameters under bf16
  autocast, nothing compiled (``trainer.compute.param_dtype: float32``,
  ``trainer.compute.compile: false``, ``teacher.compile: false``);
* **default**: the same pipeline with the defaults: bf16 parameters with fp32 master weights,
  the decoder layers compiled (student and teacher);

* **bare**: one process, no queue, no IPC: teacher forward (bf16, no grad) + the student's
  optimizer step with the same loss (services.trainer.trainer.build_step, then StudentStep.run), on the
  same collated samples; tokens/s from CUDA-synchronized wall time.
* **pipeline**: ``xtoken run`` of the same models: queue, collator, teacher (``cuda_ipc`` or
  ``hidden``) and trainer as real processes on one GPU; tokens/s from the trainer's step records
  after the warm-up (wall time between their starts), the step-time split, the trainer's wait for data
  and teacher, and the bytes each transport moves per step.

Models are built from presets (random weights) and saved once as local HF folders, so every
process loads the same weights fast. MFU counts causal attention: the student step
``6 N + 6 L q T`` per token, the teacher forward ``2 N + 2 L q T`` (N parameters, L layers,
q = heads x head dim, T the sequence length), over the GPU's dense bf16 peak; ``mfu_e2e`` is both
over the pipeline's tokens/s, ``student_mfu`` the student step alone. A recompile check trains 50
steps of the default on demo-corpus texts of every length (no filled context) and counts the
graphs Dynamo compiles after the start-up step; it reports the padding waste of those batches.

``--pack`` measures packed rows instead (``pack``): the demo corpus's texts as they are
(not joined into long texts), whole documents packed into rows of T tokens per side within puts
of ``--pack-window`` texts, with document-boundary attention in the student and the teacher
(FlexAttention on CUDA, ``trainer.compute.packed_attention``); the bare step and the recompile
check train packed micro-batches too. Tokens/s count real tokens; MFU's attention term counts the
whole row of T (an upper bound: each document attends within itself).

Usage (GPU)::

    python benchmarks/e2e/bench_pipeline.py --shapes 1x4096 4x2048 --modes pkl gold xtoken ce

CPU smoke test (and with ``--pack``)::

    python benchmarks/e2e/bench_pipeline.py --device cpu --student tiny --teacher tiny \
        --shapes 1x64 --modes pkl --transports shm --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    RESULTS_DIR,
    append_rows,
    commit,
    device_name,
    steady_rate,
    timed_steps,
)

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
    from xtoken_core.models.loading import student_vocab_size
    from xtoken_core.tokenizers import load_tokenizer

    dirs = []
    for who, preset, tok, vocab in (
        ("student", args.student, args.student_tokenizer, args.student_vocab),
        ("teacher", args.teacher, args.teacher_tokenizer, args.teacher_vocab),
    ):
        d = out / f"{who}_{preset}"
        if not (d / "config.json").is_file():
            if not vocab:  # the width the trainer gives the preset (a student's padded to 128)
                vocab = load_tokenizer(tok).vocab_size
                vocab = student_vocab_size(preset, vocab) if who == "student" else vocab
            t0 = time.perf_counter()
            # drawn on the run's device (seconds on a GPU: xtoken_core.models.device_draw)
            model = load_model(preset, vocab_size=vocab, dtype=torch.float32, seed=1,
                               device=getattr(args, "device", "cpu"))  # fmt: skip
            export_hf(model, d, tokenizer=tok)
            del model
            print(f"  built {who} {preset} (vocab {vocab}) in {time.perf_counter() - t0:.0f}s")
        dirs.append(str(d))
    return dirs[0], dirs[1]


def build_projection(args, work: Path) -> str:
    """The top-8 projection file for ``args``' student and teacher tokenizers, built (or found in
    the cache) the way ``xtoken run`` builds one when a run config names none."""
    from services.supervise.config import run_config_from_dict
    from services.supervise.preflight import build_cached_projection
    from xtoken_core.tokenizers import load_tokenizer

    config = run_config_from_dict(
        {
            "run_dir": str(work / "prep"),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "projection_top_k": 8,
        }
    )
    return str(
        build_cached_projection(
            config, load_tokenizer(args.student_tokenizer), load_tokenizer(args.teacher_tokenizer)
        )
    )


def collated(args, B: int, T: int, corpus: Path, n: int) -> list[dict]:
    """``n`` padded micro-batches of B samples collated at ctx T (both sides); with ``args.pack``
    B packed rows each, packed within windows of ``args.pack_window`` texts (as a packing
    collator's puts), in put order."""
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.data.corpus import iter_texts
    from xtoken_core.data.sample import pad_samples
    from xtoken_core.tokenizers import load_tokenizer

    pack = getattr(args, "pack", False)
    collator = CrossTokenizerCollator(
        student_tokenizer=load_tokenizer(args.student_tokenizer),
        teacher_tokenizer=load_tokenizer(args.teacher_tokenizer),
        aligner=TokenAligner(),
        ctx_length_student=T,
        ctx_length_teacher=T,
        pack=pack,
    )
    texts = [t for _, t in iter_texts(str(corpus))]
    if pack:
        rows: list[dict] = []
        start, window = 0, args.pack_window
        while len(rows) < n * B:
            rows += collator.collate_samples(
                [texts[(start + j) % len(texts)] for j in range(window)]
            )
            start += window
        return [pad_samples(rows[i * B : (i + 1) * B], **collator.pad_kwargs()) for i in range(n)]
    out = []
    for i in range(n):
        chunk = [texts[(i * B + j) % len(texts)] for j in range(B)]
        out.append(collator(chunk))
    return out


# the trainer and teacher keys of the eager baseline (the defaults need none)
EAGER_TRAINER = {"compute": {"param_dtype": "float32", "compile": False}}
EAGER_TEACHER = {"compile": False}


def with_sections(settings: dict, extra: dict) -> dict:
    """``settings`` with ``extra`` over it, a section (a mapping in both) merged key by key."""
    out = dict(settings)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = {**out[key], **value} if both else value
    return out


def _teacher_has_compile() -> bool:
    import dataclasses

    from services.teacher.config import TeacherConfig

    return any(f.name == "compile" for f in dataclasses.fields(TeacherConfig))


@dataclasses.dataclass
class BareStep:
    """The trainer's student step of a bare run, its start-up step done.

    Attributes:
        step: the ``StudentStep`` (services/trainer/step.py).
        compile_s: seconds of the start-up step (the compile), None when it was skipped.
    """

    step: Any
    compile_s: float | None

    @property
    def device(self) -> torch.device:
        """The student's device."""
        return self.step.student.device

    def run(self, micro_batches: list) -> Any:
        """One optimizer step over ``micro_batches`` (the ``StepResult``)."""
        return self.step.run(micro_batches)

    def recompiles(self) -> int | None:
        """Graphs compiled since the start-up step (None: the student is not compiled)."""
        return self.step.student.recompiles()


def _bare_student(
    args, mode: str, B: int, T: int, student_dir: str, projection: str, eager: bool
) -> BareStep:
    """The trainer's student step of a bare run (its start-up step done): the eager baseline's
    keys, or ``args.trainer_extra`` (``--trainer-extra``) over the defaults."""
    from services.common.config import from_dict
    from services.trainer.config import TrainerConfig
    from services.trainer.startup import warm_up
    from services.trainer.trainer import build_step

    extra = EAGER_TRAINER if eager else getattr(args, "trainer_extra", None) or {}
    settings = {
        "student_tokenizer": args.student_tokenizer,
        "teacher_tokenizer": args.teacher_tokenizer,
        "pack": getattr(args, "pack", False),
        "student": {"model": student_dir, "max_length": T},
        "compute": {"device": args.device},
        "feed": {"micro_batch": B},
        "schedule": {"max_steps": 10**6},
        "optim": {"warmup_steps": 0},
        "loss": {"mode": mode, "projection": projection if mode != "ce" else None},
    }
    cfg = from_dict(TrainerConfig, with_sections(settings, extra))
    step = build_step(cfg, device=torch.device(args.device))
    compile_s = warm_up(step.student, micro_batch=B, max_length=T, head=step.head)
    return BareStep(step, compile_s)


def _bare_teacher(args, teacher_dir: str, eager: bool):
    """The teacher model of a bare run: bf16 on CUDA, its decoder layers compiled unless eager."""
    from services.trainer.compile import compile_student
    from xtoken_core.models import load_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = load_model(teacher_dir, dtype=dtype, device=device).eval().requires_grad_(False)
    if getattr(args, "pack", False):  # the attention the teacher service runs for packed rows
        from xtoken_core.models.documents import packed_attention, use_packed_attention

        use_packed_attention(teacher, packed_attention("auto", device))
    if not eager and device.type == "cuda":
        compile_student(teacher)  # each decoder layer, as the teacher service compiles
    return teacher


def _bare_step(worker: BareStep, teacher, batch: dict, mode: str) -> None:
    from services.trainer.step import MicroBatch

    device = worker.device
    logits = None
    if mode != "ce":
        with torch.inference_mode():
            ids = batch["teacher_input_ids"].to(device, non_blocking=True)
            kwargs = {}
            if "teacher_position_ids" in batch:  # packed rows: attention within each document
                from xtoken_core.models.documents import document_attention_mask

                positions = batch["teacher_position_ids"].to(device).long()
                kwargs = {
                    "position_ids": positions,
                    "attention_mask": document_attention_mask(
                        teacher.config, positions, teacher.dtype
                    ),
                }
            logits = teacher(input_ids=ids, use_cache=False, **kwargs).logits
        logits = logits.clone()  # an inference tensor cannot be saved for the backward
    mb = MicroBatch(
        keys=[], batch=batch, teacher_logits=None if logits is None else (lambda: logits)
    )
    worker.run([mb])


def bare(
    args,
    mode: str,
    B: int,
    T: int,
    student_dir: str,
    teacher_dir: str,
    corpus: Path,
    projection: str,
    eager: bool = False,
) -> dict:
    """Teacher forward + student step in one process; tokens/s."""
    device = torch.device(args.device)
    worker = _bare_student(args, mode, B, T, student_dir, projection, eager)
    teacher = _bare_teacher(args, teacher_dir, eager) if mode != "ce" else None
    batches = collated(args, B, T, corpus, 4)

    def step(batch: dict) -> None:
        _bare_step(worker, teacher, batch, mode)

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
        "compile_s": worker.compile_s,
        "recompiles": worker.recompiles(),
    }
    return out


def model_flops(model_dir: str) -> dict:
    """Parameters, layers and attention width (heads x head dim) of a saved model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    from safetensors import safe_open

    params = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                params += _numel(st.get_slice(k).get_shape())
    return {"params": params, "layers": cfg["num_hidden_layers"], "q_dim": heads * head_dim}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def recompile_check(
    args, B: int, T: int, student_dir: str, teacher_dir: str, projection: str, steps: int = 50
) -> dict:
    """The default step over ``steps`` demo-corpus batches of every length: graphs compiled after
    the start-up (the student's and the compiled teacher's), and the padding's share of the
    batches' tokens."""
    from xtoken_core.data.corpus import build_demo_corpus

    demo = build_demo_corpus()
    batches = collated(args, B, T, Path(demo.train_path), steps)
    # Dynamo counts graphs per process: the teacher's layers compile at its first forward, so that
    # forward runs before the student's start-up step; a later graph of either is a recompile
    teacher = _bare_teacher(args, teacher_dir, eager=False)
    with torch.inference_mode():
        teacher(input_ids=batches[0]["teacher_input_ids"].to(args.device), use_cache=False)
    worker = _bare_student(args, "pkl", B, T, student_dir, projection, eager=False)
    real = padded = 0
    lengths = set()
    for batch in batches:
        _bare_step(worker, teacher, batch, "pkl")
        real += int(batch["input_lengths"].sum())
        padded += batch["input_ids"].numel()
        lengths.add(batch["input_ids"].shape[1])
    out = {
        "steps": steps,
        "distinct_lengths": len(lengths),
        "recompiles": worker.recompiles(),
        "compile_s": worker.compile_s,
        "padding_waste": 1 - real / padded,
    }
    del worker, teacher
    return out


def pipeline_limit(args, B: int, T: int, trainers: int = 1, grad_accum: int = 1) -> int:
    """The texts :func:`pipeline` reads: its steps' samples and four steps more (packed: a row
    holds several demo-corpus texts of ~300 tokens each)."""
    texts_per_sample = max(1, T // 128) if getattr(args, "pack", False) else 1
    n_steps = args.warmup + args.steps
    return trainers * B * grad_accum * (n_steps + 4) * texts_per_sample


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
    teachers: int | None = None,
    teacher_device: str | None = None,
    grad_accum: int = 1,
    trainer_extra: dict | None = None,
    teacher_extra: dict | None = None,
    ordered: bool = False,
    data_extra: dict | None = None,
    run_extra: dict | None = None,
) -> dict:
    """``xtoken run`` of the same models; tokens/s (all ranks) from rank 0's step records
    (``teachers``: teacher groups, default one per rank; ``trainer_extra`` / ``teacher_extra`` /
    ``data_extra``: more keys of the run config's sections; ``run_extra``: more top-level keys,
    e.g. ``extra_teachers``; ``ordered``: ``data.ordered`` with one collator worker, every rank
    count training the same steps)."""
    import shutil

    from services.common.metrics import read_jsonl
    from services.supervise.config import run_config_from_dict
    from services.supervise.driver import Driver

    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    n_steps = args.warmup + args.steps
    pack = getattr(args, "pack", False)
    config = run_config_from_dict(
        {
            "run_dir": str(run_dir),
            "student_tokenizer": args.student_tokenizer,
            "teacher_tokenizer": args.teacher_tokenizer,
            "ctx_student": T,
            "ctx_teacher": T,
            "trainers": trainers,
            "teachers": teachers or trainers,
            "mps": bool(getattr(args, "mps", False)),
            "pack": pack,
            "data": {
                "train": str(corpus),
                "limit": pipeline_limit(args, B, T, trainers, grad_accum),
                "ordered": ordered,
                **(data_extra or {}),
            },
            "collator": {
                "workers": 1 if ordered else 2,
                "batch": args.pack_window if pack else max(1, B),
            },
            "teacher": {
                "model": teacher_dir,
                "device": teacher_device or args.device,
                "transport": transport,
                "max_batch": B,
                "max_length": T,
                "slots": 2,
                **(teacher_extra or {}),
            },
            "trainer": with_sections(
                {
                    "student": {"model": student_dir},
                    "compute": {"device": args.device},
                    "feed": {"micro_batch": B, "grad_accum": grad_accum},
                    # no held-out eval of the student before and after the steps, none of the
                    # teacher at its start: nothing here reads them, and each runs the models
                    # at the eval's lengths (compiled layers compile again for them)
                    "eval": {"texts": 0},
                    "schedule": {
                        "max_steps": n_steps,
                        "checkpoint_every": 0,
                        "final_checkpoint": False,
                        "eval_every": 0,
                        "export": False,
                    },
                    "optim": {"warmup_steps": 0},
                    "loss": {"mode": mode, "projection": projection},
                },
                trainer_extra or {},
            ),  # fmt: skip
            **(run_extra or {}),
        }
    )
    run = Driver(config, progress=False)
    t0 = time.perf_counter()
    code = run.run()
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": run.failure, "wall_s": wall}
    records = read_jsonl(run_dir / "metrics" / "trainer.rank0.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    compiled = [r for r in records if r["event"] == "compile" and r.get("state") == "done"]
    teacher_mem = (
        [
            r["memory_mb"]
            for r in read_jsonl(run_dir / "metrics" / "teacher.group0.jsonl")
            if r.get("memory_mb")
        ]
        if (run_dir / "metrics" / "teacher.group0.jsonl").exists()
        else []
    )
    # profiled steps (and the trace's export at the last one's end) are no steady step
    observe = (trainer_extra or {}).get("observe", {})
    first = observe.get("profile_start", 1)
    profiled = set(range(first, first + observe.get("profile_steps", 0)))
    measured = [r for r in steps if r["step"] > args.warmup and r["step"] not in profiled]
    timed = timed_steps(steps, args.warmup, exclude=profiled)
    rate, span, counted = steady_rate(steps, args.warmup, exclude=profiled)
    split = {k: statistics.mean(r["times"][k] for r in measured) for k in measured[0]["times"]}
    split_by_rank = {}  # each rank's own step split (rank 0's is ``split``)
    stalls_by_rank = {}  # each rank's steps over 3x its median, and its garbage collections
    for rank in range(trainers):
        rows = [
            r
            for r in read_jsonl(run_dir / "metrics" / f"trainer.rank{rank}.jsonl")
            if r["event"] == "step" and r["step"] > args.warmup
        ]
        if rows:
            split_by_rank[rank] = {
                k: statistics.mean(r["times"][k] for r in rows) for k in rows[0]["times"]
            }
            stalls_by_rank[rank] = step_stalls(rows)
    step_s = statistics.mean(r["step_s"] for r in measured)
    waits = split.get("data_wait", 0) + split.get("teacher_wait", 0)
    hidden_bytes = None
    if transport == "hidden":
        hidden = json.loads((Path(teacher_dir) / "config.json").read_text())["hidden_size"]
        hidden_bytes = B * T * hidden * 2
    # wall time between rank 0's steps that no phase of them accounts for
    phases_s = sum(r["step_s"] for r, _ in timed)
    between = (span - phases_s) / counted if counted else None
    return {
        "tokens_per_s": rate
        or sum(r["tokens"] for r in measured) / sum(r["step_s"] for r in measured),
        "step_s": step_s,
        # the steps the rate was counted over (rank 0's, from one start to the next)
        "timed_steps": counted,
        # steps claimed and asked ahead (trainer.feed.ahead_steps, as the trainer section has it)
        "ahead_steps": json.loads((run_dir / "config" / "trainer.json").read_text())["feed"].get(
            "ahead_steps"
        ),
        "between_steps_ms": None if between is None else 1000 * between,
        "compile_s": compiled[-1]["seconds"] if compiled else None,
        "recompiles": measured[-1].get("recompiles"),
        "teacher_peak_mem_gib": max(teacher_mem) / 1024 if teacher_mem else None,
        "split_s": split,
        "split_s_by_rank": split_by_rank,
        "stalls_by_rank": stalls_by_rank,
        "wait_fraction": waits / step_s if step_s else None,
        "teacher_wait_ms": 1000 * split.get("teacher_wait", 0.0),
        "bytes_per_step": hidden_bytes if transport == "hidden" else 0,
        "peak_mem_mb": measured[-1].get("memory_mb"),
        "wall_s": wall,
        "feed": measured[-1].get("feed"),
        "losses": [r.get("loss") for r in steps],
    }


SERIES = ("steps", "step_ms", "gc_ms")  # step_stalls' per-step lists (stored, not printed)


def step_stalls(rows: list[dict], factor: float = 3.0) -> dict:
    """A rank's measured steps longer than ``factor`` x its median step (``slow_steps``, their
    step numbers), the median and slowest step in ms, and the seconds and full collections of
    Python's garbage collector over the steps and within the slow ones (``gc_s``, ``gc_full``:
    what each step record carries), and the series behind them (``steps``, ``step_ms``,
    ``gc_ms``: one entry per measured step)."""
    median = statistics.median(r["step_s"] for r in rows)
    slow = [r for r in rows if r["step_s"] > factor * median]
    return {
        "median_ms": round(1000 * median, 1),
        "slowest_ms": round(1000 * max(r["step_s"] for r in rows), 1),
        "slow_steps": [r["step"] for r in slow],
        "gc_s": round(sum(r.get("gc_s", 0.0) for r in rows), 4),
        "gc_full": sum(r.get("gc_full", 0) for r in rows),
        "gc_full_in_slow_steps": sum(r.get("gc_full", 0) for r in slow),
        "steps": [r["step"] for r in rows],
        "step_ms": [round(1000 * r["step_s"], 1) for r in rows],
        "gc_ms": [round(1000 * r.get("gc_s", 0.0), 1) for r in rows],
    }


def p2p_handoff(args, B: int, T: int, teacher_device: str) -> dict:
    """What a teacher on another GPU adds to the hand-off: the one peer copy of a micro-batch's
    ``[B, T, W]`` bf16 logits to the trainer's GPU that the trainer's teacher client makes
    (services/trainer/teacher_client.py), timed alone with CUDA events (median of 20)."""
    src = torch.empty(B, T, args.teacher_vocab, dtype=torch.bfloat16, device=teacher_device)
    src.normal_()
    dst = torch.device(args.device)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = src.to(dst, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    nbytes = src.numel() * src.element_size()
    del src, out
    return {"handoff_ms": ms, "handoff_bytes": nbytes, "handoff_gb_per_s": nbytes / ms / 1e6}


def flops_per_token(student: dict, teacher: dict | None, T: int) -> tuple[float, float]:
    """``(student step, student step + teacher forward)`` FLOPs per student token, causal
    attention counted (half the square): 6N + 6 L q T for the step, 2N + 2 L q T for a forward.
    The teacher's count is per student token (its sequences are about as long)."""
    s = 6 * student["params"] + 6 * student["layers"] * student["q_dim"] * T
    t = (
        0.0
        if teacher is None
        else 2 * teacher["params"] + 2 * teacher["layers"] * teacher["q_dim"] * T
    )
    return s, s + t


def mfu(flops: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: ``flops`` per token at ``tokens_per_s`` over the peak."""
    return flops * tokens_per_s / peak if peak else None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The models, tokenizers, device and work folder (shared with profile_step.py)."""
    p.add_argument("--student", default="qwen3-0.6b")
    p.add_argument("--teacher", default="teacher-1.5b")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument(
        "--student-vocab",
        type=int,
        default=None,
        help="the student's output-layer rows (default: the trainer's, its tokenizer's ids "
        "rounded up to a multiple of 128: 151,680 for qwen3)",
    )
    p.add_argument("--teacher-vocab", type=int, default=32768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="/tmp/xtoken_bench_e2e")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x4096", "4x2048"])
    p.add_argument("--modes", nargs="+", default=["pkl", "gold", "xtoken", "ce"])
    p.add_argument(
        "--baseline",
        choices=["eager", "none"],
        default="eager",
        help="eager: each row's pipeline also runs with the eager step (fp32 parameters, "
        "autocast, nothing compiled), side by side; none: the default only",
    )
    p.add_argument(
        "--recompile-steps",
        type=int,
        default=50,
        help="steps of the recompile check per shape (demo-corpus texts of every length; 0: off)",
    )
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
        default=["same"],
        help="teacher device per variant (same: the trainer's GPU; cuda:1: the teacher on its "
        "own GPU, with one trainer rank only); also times the peer copy of the logits",
    )
    p.add_argument(
        "--ordered",
        action="store_true",
        help="data.ordered (one collator worker): every rank count trains the same samples in "
        "each step, so with --same-global-batch the per-step losses compare",
    )
    p.add_argument(
        "--no-bare", action="store_true", help="skip the one-process bare compute of each row"
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
    p.add_argument(
        "--pack",
        action="store_true",
        help="collator.pack: the demo corpus's texts packed into rows of T tokens per side "
        "(document-boundary attention), instead of long texts that fill the context",
    )
    p.add_argument(
        "--demo-texts",
        action="store_true",
        help="the demo corpus's texts one per row, as they are (what --pack packs), instead of "
        "long texts that fill the context",
    )
    p.add_argument(
        "--pack-window",
        type=int,
        default=256,
        help="with --pack: texts per put, packed together (collator.batch)",
    )
    p.add_argument("--tag", default="", help="label of these rows (e.g. mps)")
    p.add_argument(
        "--mps",
        action="store_true",
        help="the pipeline runs with mps: true (an MPS daemon of each run's own): the trainer "
        "and its colocated teacher then share each GPU kernel by kernel instead of by time slices",
    )
    p.add_argument(
        "--trainer-extra",
        type=json.loads,
        default={},
        help="trainer keys of the default runs, as JSON, a section merged key by key (e.g. "
        '\'{"compute": {"cuda_graphs": true}}\')',
    )
    p.add_argument(
        "--teacher-extra",
        type=json.loads,
        default={},
        help='teacher keys of the default runs, as JSON (e.g. \'{"packed_attention": "sdpa"}\')',
    )
    add_model_args(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--results", default=str(RESULTS_DIR / "e2e_pipeline.jsonl"), help="rows appended here"
    )
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return run_all(args, work)


def run_all(args, work: Path) -> int:
    """Every row of ``args`` (the shapes, modes, rank counts and teacher devices)."""
    os.environ.setdefault("XTOKEN_CACHE", str(work / "cache"))
    student_dir, teacher_dir = save_models(args, work)
    projection = build_projection(args, work)
    dev = device_name() if args.device == "cuda" else "cpu"
    peak = _peak(dev)
    student_f, teacher_f = model_flops(student_dir), model_flops(teacher_dir)
    eager_teacher = EAGER_TEACHER if _teacher_has_compile() else {}
    stamp = {
        "commit": commit(),
        "device": dev,
        "student": args.student,
        "teacher": args.teacher,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **({"pack": True, "pack_window": args.pack_window} if args.pack else {}),
        **({"texts": "demo"} if args.demo_texts else {}),
        **({"mps": True} if args.mps else {}),
    }

    def keep(row: dict) -> None:  # appended at once: a run stopped early keeps its rows
        append_rows(args.results, [{**stamp, **row}])

    print(f"device {dev}; student {args.student} teacher {args.teacher}")
    header = (
        f"{'shape':>7} {'mode':>6} {'eager tok/s':>11} {'tok/s':>7} {'x eager':>7} "
        f"{'bare tok/s':>10} {'/bare':>5} {'MFU e2e':>7} {'MFU st':>6} {'GiB tr':>6} "
        f"{'GiB te':>6} {'compile s':>9} {'recomp':>6} {'gap ms':>6}"
    )
    lines = []
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        per_step = B * args.grad_accum * max(args.trainers)  # the most samples a step takes
        if args.pack or args.demo_texts:  # texts of every length (packed into rows)
            from xtoken_core.data.corpus import build_demo_corpus

            corpus = Path(build_demo_corpus().train_path)
        else:
            corpus = long_corpus(
                work / f"corpus_{T}_{per_step}.jsonl",
                chars=8 * T,
                count=per_step * (args.steps + args.warmup + 8),
            )
        if args.recompile_steps:
            rc = recompile_check(
                args, B, T, student_dir, teacher_dir, projection, args.recompile_steps
            )
            print(f"{shape}: recompile check {json.dumps(rc)}")
            keep({"shape": shape, "kind": "recompile_check", **rc})
            _free()
        handoff = {
            d: p2p_handoff(args, B, T, d) for d in args.teacher_devices if d not in ("same", None)
        }
        for d, h in handoff.items():
            print(f"{shape}: logits to the trainer's GPU from {d}: {json.dumps(h)}")
            keep({"shape": shape, "kind": "p2p_handoff", "teacher_device": d, **h})
        for mode in args.modes:
            b = None
            if not args.no_bare:
                b = bare(args, mode, B, T, student_dir, teacher_dir, corpus, projection)
            _free()
            for transport in args.transports:
                run = functools.partial(
                    pipeline,
                    args,
                    mode,
                    B,
                    T,
                    student_dir,
                    teacher_dir,
                    corpus,
                    projection,
                    transport,
                )
                eager = None
                if args.baseline == "eager":
                    eager = run(
                        work / f"run_{shape}_{mode}_{transport}_eager",
                        trainer_extra=EAGER_TRAINER,
                        teacher_extra=eager_teacher,
                    )
                    if "error" in eager:
                        print(f"{shape} {mode} eager FAILED: {eager['error'][:400]}")
                base = None
                for n, tdev in ((n, d) for d in args.teacher_devices for n in args.trainers):
                    tdev = None if tdev == "same" else tdev
                    if tdev and n > 1:  # every rank's teacher would share that GPU with a rank
                        continue
                    accum = args.grad_accum
                    if args.same_global_batch:
                        accum = args.grad_accum * max(args.trainers) // n
                    run_dir = work / f"run_{shape}_{mode}_{transport}_r{n}_{tdev or 'same'}"
                    pl = run(
                        run_dir,
                        trainers=n,
                        teacher_device=tdev,
                        grad_accum=accum,
                        trainer_extra=args.trainer_extra or None,
                        teacher_extra=args.teacher_extra or None,
                        ordered=args.ordered,
                    )
                    row = {
                        "shape": shape,
                        "mode": mode,
                        "transport": transport,
                        "trainers": n,
                        "teacher_device": tdev or "same GPU",
                        "grad_accum": accum,
                        "ordered": args.ordered,
                        "tag": args.tag,
                        **({"handoff": handoff[tdev]} if tdev in handoff else {}),
                    }
                    if "error" in pl:
                        print(f"{shape} {mode} {transport} x{n} FAILED: {pl['error'][:400]}")
                        keep({**row, **pl})
                        continue
                    base = base or pl["tokens_per_s"]
                    per_rank = pl["tokens_per_s"] / n
                    f_student, f_all = flops_per_token(
                        student_f, teacher_f if mode != "ce" else None, T
                    )
                    eager_tps = eager["tokens_per_s"] if eager and "error" not in eager else None
                    speedup = pl["tokens_per_s"] / eager_tps if eager_tps else None
                    # the student step alone: its share of the pipeline's wall time
                    step_share = (
                        pl["step_s"]
                        - pl["split_s"].get("teacher_wait", 0.0)
                        - pl["split_s"].get("data_wait", 0.0)
                    )
                    tokens_step = per_rank * pl["step_s"]
                    out = {
                        **row,
                        "bare": b,
                        "pipeline": pl,
                        "eager": eager,
                        "ratio": pl["tokens_per_s"] / b["tokens_per_s"] if b else None,
                        "speedup_vs_eager": speedup,
                        "mfu_e2e": mfu(f_all, per_rank, peak),
                        "student_mfu": mfu(f_student, tokens_step / step_share, peak)
                        if step_share > 0
                        else None,
                        "peak_mem_gib": (pl["peak_mem_mb"] or 0) / 1024,
                        "teacher_peak_mem_gib": pl["teacher_peak_mem_gib"],
                        "compile_s": pl["compile_s"],
                        "recompiles": pl["recompiles"],
                        "scaling": pl["tokens_per_s"] / base,
                    }
                    keep(out)
                    line = (
                        f"{shape:>7} {mode:>6} {_f(eager_tps, 0):>11} "
                        f"{pl['tokens_per_s']:>7.0f} {_f(speedup, 2):>7} "
                        f"{_f(b and b['tokens_per_s'], 0):>10} {_f(out['ratio'], 2):>5} "
                        f"{_f(out['mfu_e2e'], 3):>7} {_f(out['student_mfu'], 3):>6} "
                        f"{out['peak_mem_gib']:>6.1f} {_f(out['teacher_peak_mem_gib'], 1):>6} "
                        f"{_f(pl['compile_s'], 1):>9} {_f(pl['recompiles'], 0):>6} "
                        f"{_f(pl['between_steps_ms'], 1):>6}"
                    )
                    if n > 1 or tdev:
                        line += f" x{n} t={tdev or 'same'} scaling {out['scaling']:.3f}"
                    lines.append(line)
                    print(line)
                    for rank, times in pl["split_s_by_rank"].items():
                        split = {k: round(v * 1000, 1) for k, v in times.items()}
                        print(f"        rank {rank} split (ms/step): {json.dumps(split)}")
                        stalls = pl.get("stalls_by_rank", {}).get(rank)
                        if stalls:
                            brief = {k: v for k, v in stalls.items() if k not in SERIES}
                            print(f"        rank {rank} stalls: {json.dumps(brief)}")
                    if eager_tps:
                        split = {k: round(v * 1000, 1) for k, v in eager["split_s"].items()}
                        print(f"        eager split (ms/step): {json.dumps(split)}")
                _free()
    print(header)
    print("\n".join(lines))
    return 0


def _f(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _free() -> None:
    """Give the memory of a finished bare run back (the next processes need it)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
