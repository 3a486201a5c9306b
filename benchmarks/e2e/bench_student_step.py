"""The student step and the teacher forward, variant against variant, each in a process of its own.

Student variants (the trainer's ``StudentStep.run`` on the same collated batches and the same
teacher logits, computed once):

* ``eager``: fp32 parameters under bf16 autocast, nothing compiled (the baseline);
* ``compiled``: bf16 parameters with fp32 masters, each decoder layer compiled, torch's fused
  AdamW and a copy to the bf16 parameters (so are ``graphs``, ``fused`` and ``fused_graphs``);
* ``graphs``: ``compiled`` with each layer replayed as CUDA graphs
  (``trainer.compute.cuda_graphs``);
* ``fused``: ``compiled`` with the fused output layer + loss head (``trainer.compute.fused_head``);
* ``fused_graphs``: both, with blocks of 1,024 rows; ``fused_graphs_2048``, ``_4096`` (the
  default of ``trainer.compute.fused_head_rows``) and ``_8192``: with blocks of 2,048, 4,096 and
  8,192 rows;
* ``fused_update``: ``graphs`` with AdamW's update and the bf16 copy in one launch
  (``trainer.compute.fused_update``): the default on a cuda device;
* ``deterministic``: ``graphs`` with ``trainer.compute.deterministic`` (bitwise-reproducible
  steps: deterministic algorithms, ordered attention backwards and index adds), its cost;
* ``checkpointed``, ``fused_checkpointed``: ``fused_update`` (and the fused head) with each
  decoder layer's activations recomputed in the backward
  (``trainer.compute.activation_checkpointing``, which turns CUDA graphs off): its cost, and the
  micro-batch it lets fit;
* ``liger``: ``fused_update`` with the student's RMSNorms, SwiGLU MLPs and rotary embedding
  replaced by Liger-Kernel's Triton kernels (``apply_liger_kernel_to_<model type>``) before its
  layers are compiled: Inductor's own fusions of those ops against Liger's (needs
  ``liger-kernel``; with liger-kernel 0.8.5 the layers then failed to compile and ran eagerly,
  which the row's ``compiled: false`` and the trainer's line show).

Teacher variants (the forward under ``inference_mode``): ``t_eager``, ``t_compiled`` (each layer,
symbolic lengths, as the teacher service compiles), ``t_graphs`` (``t_compiled`` replayed as
CUDA graphs).

Each row: median step ms over ``--steps`` after ``--warmup`` (CUDA-synchronized wall time), the
step's phases (forward / loss / backward / optimizer, CUDA events), its MFU (causal count, over
the GPU's dense bf16 peak), peak memory allocated and reserved (a CUDA graph's private pool is
reserved, not allocated, between its replays), start-up (compile) seconds. ``--batches`` distinct
micro-batches are cycled, the teacher logits of all of them held on the device (the default 4);
``--batches 1`` holds one micro-batch's, what a trainer holds, for the largest micro-batch that
fits. ``--warm-process`` runs the first variant once, unmeasured, before the others: on a freshly
started machine the first process of the fused head read 8-18% slow whichever code it ran, so
variants compared in one call should not meet that process.

Usage (GPU)::

    python benchmarks/e2e/bench_student_step.py --shapes 1x4096 4x2048 --mode pkl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402

from benchmarks._common import RESULTS_DIR, append_rows, commit, device_name  # noqa: E402

# each variant's trainer.compute keys
STUDENT = {
    "eager": {"compute": {"param_dtype": "float32", "compile": False}},
    "compiled": {"compute": {"cuda_graphs": False, "fused_update": False}},
    "graphs": {"compute": {"fused_update": False}},
    "fused": {"compute": {"fused_head": True, "cuda_graphs": False, "fused_update": False}},
    "fused_graphs": {
        "compute": {"fused_head": True, "fused_update": False, "fused_head_rows": 1024}
    },
    **{
        f"fused_graphs_{rows}": {
            "compute": {"fused_head": True, "fused_update": False, "fused_head_rows": rows}
        }
        for rows in (2048, 4096, 8192)
    },
    "fused_update": {},  # the default on a cuda device
    # each layer's activations recomputed in the backward (no CUDA graphs then)
    "checkpointed": {"compute": {"activation_checkpointing": True}},
    "fused_checkpointed": {"compute": {"activation_checkpointing": True, "fused_head": True}},
    "liger": {},  # the default step, the model's norms, MLPs and rotary by Liger (_use_liger)
    "deterministic": {"compute": {"deterministic": True}, "feed": {"ordered": True}},
}
TEACHER = {"t_eager": None, "t_compiled": "default", "t_graphs": "reduce-overhead"}


def _dev(args) -> str:
    return device_name() if args.device == "cuda" else "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(args, B: int, T: int) -> list[dict]:
    work = Path(args.work)
    corpus = bp.long_corpus(work / f"corpus_{T}.jsonl", chars=8 * T, count=B * 8)
    return bp.collated(args, B, T, corpus, args.batches)


def _teacher(args, teacher_dir: str, mode: str | None):
    from xtoken_core.models import load_model
    from xtoken_core.models.layers import decoder_layers

    device = torch.device(args.device)
    teacher = load_model(teacher_dir, dtype=torch.bfloat16, device=device)
    teacher = teacher.eval().requires_grad_(False)
    if mode is not None:
        for layer in decoder_layers(teacher):
            layer.compile(dynamic=True, fullgraph=True, mode=None if mode == "default" else mode)
    return teacher


def _teacher_logits(teacher, batch: dict, device) -> torch.Tensor:
    with torch.inference_mode():
        ids = batch["teacher_input_ids"].to(device, non_blocking=True)
        return teacher(input_ids=ids, use_cache=False).logits


def _use_liger() -> None:
    """Have the trainer's student hand its compute model to Liger-Kernel before compiling it:
    RMSNorm, SwiGLU and the rotary embedding by Liger's kernels (its CE and fused linear CE
    stay off: the loss is xtoken's)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise SystemExit(
            f"the liger variant needs liger-kernel: pip install liger-kernel ({e})"
        ) from e
    from services.trainer import student

    compile_first = student.compile_student

    def compile_student(module, **kw):
        patch = getattr(liger, f"apply_liger_kernel_to_{module.config.model_type}")
        patch(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,
            model=module,
        )
        return compile_first(module, **kw)

    student.compile_student = compile_student


def one_student(args, variant: str, B: int, T: int) -> dict:
    from services.trainer.step import MicroBatch

    device = torch.device(args.device)
    if variant == "liger":
        _use_liger()
    if STUDENT[variant].get("compute", {}).get("deterministic"):
        from services.trainer import determinism

        determinism.configure(True, seed=0)  # before the first CUDA call, as the trainer's shell
    student_dir, teacher_dir = bp.save_models(args, Path(args.work))
    projection = bp.build_projection(args, Path(args.work)) if args.mode != "ce" else None
    batches = _batches(args, B, T)
    logits = [None] * len(batches)
    if args.mode != "ce":
        teacher = _teacher(args, teacher_dir, None)
        logits = [_teacher_logits(teacher, b, device).clone() for b in batches]
        del teacher
        bp._free()
    args.trainer_extra = STUDENT[variant]  # the default run's keys of bench_pipeline's worker
    worker = bp._bare_student(args, args.mode, B, T, student_dir, projection, eager=False)
    start_s = worker.compile_s

    def step(i: int):
        k = i % len(batches)
        t = logits[k]
        mb = MicroBatch(
            keys=[], batch=batches[k], teacher_logits=None if t is None else (lambda: t)
        )
        return worker.run([mb])

    for i in range(args.warmup):
        step(i)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, phases = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        res = step(i)
        _sync(device)
        times.append(time.perf_counter() - t0)
        phases.append(res.times)
    if args.profile:
        _profile(step, device, args.profile)
    tokens = statistics.mean(int(b["input_lengths"].sum()) for b in batches)
    step_s = statistics.median(times)
    split = {k: statistics.median(p.get(k, 0.0) for p in phases) * 1e3 for k in phases[-1]}
    f_student, _ = bp.flops_per_token(bp.model_flops(student_dir), None, T)
    return {
        "kind": "student_step",
        "variant": variant,
        "batches": len(batches),
        "student_vocab": worker.step.student.vocab,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "split_ms": {k: round(v, 2) for k, v in split.items()},
        "student_mfu": bp.mfu(f_student, tokens / step_s, bp._peak(_dev(args))),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else None,
        # with CUDA graphs, what the graphs' private pools hold is reserved, not allocated
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30
        if device.type == "cuda"
        else None,
        "start_s": start_s,
        "recompiles": worker.recompiles(),
        "compiled": worker.step.student.compiled,  # False: the compile failed, the step ran eagerly
        "final_loss": res.metrics.get("loss"),
    }


#: host calls that wait for the GPU or for the driver, counted by the profile (an idle GPU between
#: kernels is often one of them)
HOST_WAITS = ("Synchronize", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaHostAlloc")


def _profile(step, device: torch.device, top: int) -> None:
    """Two steps under the profiler: the kernels by total time, the GPU's busy share, and the
    host's calls that wait (synchronizations, allocations, copies) with their count and time."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step(i)
        _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"profile: 2 steps, wall {wall_ms:.1f} ms, kernels {busy_ms:.1f} ms")
    print(events.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90))
    waits = [e for e in events if any(w in e.key for w in HOST_WAITS)]
    print(
        "host waits: "
        + (
            ", ".join(f"{e.key} x{e.count} {e.cpu_time_total / 1e3:.2f} ms" for e in waits)
            or "none"
        )
    )


def one_teacher(args, variant: str, B: int, T: int) -> dict:
    device = torch.device(args.device)
    _, teacher_dir = bp.save_models(args, Path(args.work))
    batches = _batches(args, B, T)
    teacher = _teacher(args, teacher_dir, TEACHER[variant])
    t0 = time.perf_counter()
    for _ in range(2 if variant == "t_graphs" else 1):  # graph trees record at the second call
        _teacher_logits(teacher, batches[0], device)
    _sync(device)
    start_s = time.perf_counter() - t0
    for i in range(args.warmup):
        _teacher_logits(teacher, batches[i % len(batches)], device)
    times = []
    for i in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        _teacher_logits(teacher, batches[i % len(batches)], device)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    tokens = statistics.mean(int(b["teacher_input_lengths"].sum()) for b in batches)
    ms = statistics.median(times)
    tf = bp.model_flops(teacher_dir)
    flops = 2 * tf["params"] + 2 * tf["layers"] * tf["q_dim"] * T
    return {
        "kind": "teacher_forward",
        "variant": variant,
        "step_ms": ms,
        "tokens_per_s": tokens / ms * 1e3,
        "mfu": bp.mfu(flops, tokens / ms * 1e3, bp._peak(_dev(args))),
        "start_s": start_s,
    }


def _child_argv(args, variant: str, shape: str) -> list[str]:
    """The command line of the child process that measures ``variant`` at ``shape``."""
    argv = [sys.executable, __file__, "--one", f"{variant}:{shape}"]
    for k in (
        *("mode", "steps", "warmup", "work", "device", "student", "teacher", "profile"),
        "batches",
        *("student_tokenizer", "teacher_tokenizer", "student_vocab", "teacher_vocab"),
    ):
        if getattr(args, k) is not None:  # None: the child's own default
            argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return argv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x4096", "4x2048"])
    p.add_argument("--mode", default="pkl")
    p.add_argument("--variants", nargs="+", default=[*STUDENT, *TEACHER])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    p.add_argument("--profile", type=int, default=0, help="profile each student variant: top N")
    p.add_argument(
        "--batches",
        type=int,
        default=4,
        help="distinct micro-batches, their teacher logits all held (1: what a trainer holds)",
    )
    p.add_argument(
        "--warm-process",
        action="store_true",
        help="run the first variant once, unmeasured, before the measured processes",
    )
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: variant:shape
    p.add_argument("--results", default=str(RESULTS_DIR / "e2e_student_step.jsonl"))
    bp.add_model_args(p)
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XTOKEN_CACHE", str(Path(args.work) / "cache"))
    if args.one:
        variant, shape = args.one.split(":")
        B, T = (int(x) for x in shape.split("x"))
        fn = one_teacher if variant in TEACHER else one_student
        print("ROW " + json.dumps(fn(args, variant, B, T)))
        return 0
    bp.save_models(args, Path(args.work))  # once, before the children
    if args.mode != "ce":
        bp.build_projection(args, Path(args.work))
    bp._free()  # the presets were drawn on the GPU: the children get its memory
    stamp = {
        "commit": commit(),
        "device": _dev(args),
        "student": args.student,
        "mode": args.mode,
    }
    print(f"device {stamp['device']}; mode {args.mode}")
    lines = []
    if args.warm_process:
        t0 = time.perf_counter()
        argv = _child_argv(args, args.variants[0], args.shapes[0])
        argv += ["--steps", "2", "--warmup", "1", "--profile", "0"]  # the last flag wins
        try:
            subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
        print(f"warm-up process (not measured): {time.perf_counter() - t0:.0f}s", flush=True)
    for shape in args.shapes:
        base = None
        for variant in args.variants:
            argv = _child_argv(args, variant, shape)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
                out = proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                out = f"timed out after {args.timeout:.0f}s " + str(e.stdout or "")[-300:]
            rows = [json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW ")]
            if args.profile:
                print("\n".join(x for x in out.splitlines() if not x.startswith("ROW ")))
            else:  # the trainer's one line when the student's compile fails
                for line in out.splitlines():
                    if "torch.compile failed" in line:
                        print(f"{shape} {variant}: {line.strip()}")
            wall = time.perf_counter() - t0
            if not rows:
                tail = out.strip().splitlines()[-6:]
                print(f"{shape} {variant}: FAILED ({wall:.0f}s)\n    " + "\n    ".join(tail))
                append_rows(
                    args.results,
                    [
                        {
                            **stamp,
                            "shape": shape,
                            "variant": variant,
                            "error": "\n".join(tail)[-2000:],
                        }
                    ],
                )
                continue
            row = {**stamp, "shape": shape, **rows[0], "process_s": wall}
            if row["kind"] == "student_step":
                base = (
                    base if base is not None else (row["step_ms"] if variant == "eager" else None)
                )
                row["speedup_vs_eager"] = base / row["step_ms"] if base else None
            append_rows(args.results, [row])
            line = (
                f"{shape:>7} {variant:>13} {row['step_ms']:>8.1f} ms {row['tokens_per_s']:>8.0f} tok/s"
                f" mfu {bp._f(row.get('student_mfu', row.get('mfu')), 3):>5}"
                f" x{bp._f(row.get('speedup_vs_eager'), 2):>5}"
                f" mem {bp._f(row.get('peak_mem_gib'), 1):>5} GiB start {bp._f(row['start_s'], 1):>5}s"
                f" recomp {row.get('recompiles', '-')} {json.dumps(row.get('split_ms', {}))}"
            )
            lines.append(line)
            print(line, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
