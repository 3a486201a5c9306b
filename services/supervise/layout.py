"""Which GPUs each process of a run takes, and whether the models fit them.

A run config names its layout with three keys:

* ``trainer.gpus``: trainer rank r runs on GPU ``trainer.gpus[r]`` (default: GPU r);
* ``teacher.tensor_parallel`` (k): each teacher group is k processes, the model's layers split
  over k GPUs (services/teacher/tensor_parallel.py);
* ``teacher.gpus``: group g runs on ``teacher.gpus[g*k:(g+1)*k]`` (default: GPUs g*k .. g*k+k-1,
  modulo the GPUs there, so one teacher on one GPU shares GPU 0 with trainer rank 0 as before).

A GPU may hold a trainer rank and a teacher's shard (colocated) or either alone (dedicated).
Pre-flight (:func:`check_layout`) refuses a layout that names a GPU the machine lacks, names
too few or too many GPUs, repeats a GPU inside one group or among the trainer ranks, or splits
a model over a parallel size that does not divide its attention heads, and estimates what each
GPU would hold (teacher weights, the student's weights, gradients and optimizer state) against
its memory: each refusal is one line naming the key and what would fit.

GPU indices are those the run's processes see (after ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from services.teacher.config import check_tensor_parallel, ring_transport
from xtoken_core.errors import SettingsError

__all__ = [
    "GpuMemory",
    "Layout",
    "check_layout",
    "gpu_memory",
    "model_config",
    "parameter_count",
    "plan_layout",
    "run_transport",
]

GIB = 1 << 30
# Bytes per student parameter a trainer keeps besides activations: bf16 weights, fp32 masters,
# fp32 gradients and AdamW's two fp32 moments (the default precision: param_dtype auto).
STUDENT_BYTES_PER_PARAM = 2 + 4 + 4 + 8
# Memory a process takes before any tensor (CUDA context, allocator, NCCL buffers).
PROCESS_OVERHEAD_BYTES = 1 * GIB


@dataclasses.dataclass(frozen=True)
class Layout:
    """The GPUs of a run's processes.

    Attributes:
        trainer_gpus: per trainer rank, its GPU (empty when the trainers run on the CPU).
        teacher_gpus: per teacher group, the GPUs of its ranks in rank order (empty when the
            teachers run on the CPU or the loss uses none).
    """

    trainer_gpus: tuple[int, ...] = ()
    teacher_gpus: tuple[tuple[int, ...], ...] = ()

    def describe(self) -> str:
        """One line for the run's log: ``trainer ranks on GPU 0,1; teacher 0 (tp 2) on GPU
        2,3``."""
        parts = []
        if self.trainer_gpus:
            parts.append(f"trainer ranks on GPU {_gpus(self.trainer_gpus)}")
        for g, gpus in enumerate(self.teacher_gpus):
            tp = f" (tensor parallel {len(gpus)})" if len(gpus) > 1 else ""
            parts.append(f"teacher group {g}{tp} on GPU {_gpus(gpus)}")
        return "; ".join(parts) or "every process on the CPU"


def _gpus(gpus: Sequence[int]) -> str:
    return ",".join(str(g) for g in gpus)


def _cuda(device: str) -> bool:
    return device.split(":", 1)[0] == "cuda"


def _index(device: str) -> int | None:
    index = device.partition(":")[2]
    return int(index) if index.isdigit() else None


def plan_layout(config: Any, gpu_count: int) -> Layout:
    """The GPUs of every trainer rank and teacher group of a run config.

    Args:
        config: a RunConfig.
        gpu_count: GPUs the processes see (the defaults wrap around them).

    Returns:
        The :class:`Layout` (not checked: :func:`check_layout`).
    """
    tr, t = config.trainer, config.teacher
    count = max(1, gpu_count)
    trainer: tuple[int, ...] = ()
    if _cuda(str(tr.compute.device)):
        trainer = tuple(tr.gpus) if tr.gpus is not None else tuple(range(config.trainers))
    teachers: tuple[tuple[int, ...], ...] = ()
    if tr.loss.uses_teacher and _cuda(str(t.device)):
        k, n = t.tensor_parallel, config.teachers
        if t.gpus is not None:
            teachers = tuple(tuple(t.gpus[g * k : (g + 1) * k]) for g in range(n))
        elif k == 1 and _index(str(t.device)) is not None:
            teachers = tuple((_index(str(t.device)),) for _ in range(n))
        else:
            teachers = tuple(tuple((g * k + i) % count for i in range(k)) for g in range(n))
    return Layout(trainer, teachers)


def run_transport(config: Any) -> str:
    """The teachers' transport: as set, or for ``auto`` ``topk`` when they are placed apart
    from the trainer ranks (:attr:`~services.supervise.config.RunConfig.teachers_apart`), else a ring: ``cuda_ipc`` when
    the teachers and the trainers are on GPUs, ``shm`` otherwise."""
    t = config.teacher.transport
    if t != "auto":
        return t
    if config.teachers_apart:
        return "topk"
    # a cuda_ipc ring only where the trainers read it on a GPU too
    on_gpu = config.trainer.compute.device.startswith("cuda")
    return ring_transport(config.teacher.device) if on_gpu else "shm"


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as the driver reports it (bytes)."""

    total: int
    free: int


def gpu_memory() -> list[GpuMemory] | None:
    """Each visible GPU's memory (``nvidia-smi``, which opens no CUDA context in this process),
    in the order the processes see them; None when it cannot tell (no ``nvidia-smi``)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = []
    for line in out.strip().splitlines():
        total, used = (int(x.strip()) << 20 for x in line.split(","))
        rows.append(GpuMemory(total, total - used))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        try:
            rows = [rows[int(i)] for i in visible.split(",")]
        except (ValueError, IndexError):  # UUIDs or MIG names: the order is not ours to map
            return None
    return rows


def model_config(spec: str, vocab_size: int) -> Any | None:
    """The transformers config of a model spec without loading weights (a preset built for
    ``vocab_size``, a local directory, ``smollm2``), or None where it cannot tell cheaply (GGUF
    files, layers dropped)."""
    from pathlib import Path

    from xtoken_core.models import PRESETS, check_model_dir
    from xtoken_core.models.layer_drop import split_spec

    base, drop = split_spec(spec)
    if drop:
        return None
    if base in PRESETS:
        return PRESETS[base].config(vocab_size)
    if base == "smollm2":
        from xtoken_core.models.smollm2 import smollm2_cached, smollm2_dir

        return check_model_dir(Path(smollm2_dir())) if smollm2_cached() else None
    if Path(base).is_dir():
        return check_model_dir(Path(base))
    return None


def parameter_count(config: Any) -> int:
    """Parameters of a causal LM built from ``config`` on the meta device (no memory; a tied
    output layer counted once)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_layout(
    config: Any,
    layout: Layout,
    gpu_count: int,
    memory: Sequence[GpuMemory] | None = None,
    *,
    teacher_params: int | None = None,
    teacher_model_config: Any = None,
    student_params: int | None = None,
) -> None:
    """Refuse a layout the machine cannot run, before any process starts.

    Args:
        config: the RunConfig.
        layout: its :func:`plan_layout`.
        gpu_count: GPUs the processes see.
        memory: each GPU's memory (:func:`gpu_memory`), or None: not checked.
        teacher_params: the teacher's parameter count, or None: not counted.
        teacher_model_config: the teacher's transformers config (its heads are checked
            against ``teacher.tensor_parallel``), or None.
        student_params: the student's parameter count, or None: not counted.

    Raises:
        SettingsError: one line naming the key and what would fit.
    """
    tr, t = config.trainer, config.teacher
    k = t.tensor_parallel
    if tr.gpus is not None and len(tr.gpus) != config.trainers:
        raise SettingsError(
            f"trainer.gpus names {len(tr.gpus)} GPU(s) for trainers={config.trainers}; name one "
            "GPU per trainer rank"
        )
    if t.gpus is not None and tr.loss.uses_teacher and len(t.gpus) != config.teachers * k:
        raise SettingsError(
            f"teacher.gpus names {len(t.gpus)} GPU(s) for teachers={config.teachers} x "
            f"teacher.tensor_parallel={k}; name {config.teachers * k}"
        )
    if len(set(layout.trainer_gpus)) != len(layout.trainer_gpus):
        raise SettingsError(
            f"trainer.gpus={list(layout.trainer_gpus)} puts two trainer ranks on one GPU; name "
            "a distinct GPU per rank"
        )
    for g, gpus in enumerate(layout.teacher_gpus):
        if len(set(gpus)) != len(gpus):
            raise SettingsError(
                f"teacher.gpus puts two ranks of teacher group {g} on one GPU ({_gpus(gpus)}); "
                f"name {k} distinct GPUs per group"
            )
    named = [("trainer.gpus", g) for g in layout.trainer_gpus] + [
        ("teacher.gpus", g) for gpus in layout.teacher_gpus for g in gpus
    ]
    for key, gpu in named:
        if not 0 <= gpu < gpu_count:
            there = f"0-{gpu_count - 1}" if gpu_count else "none"
            raise SettingsError(
                f"{key} names GPU {gpu}, but this machine shows {gpu_count} (GPUs {there}); "
                "name GPUs that are there"
            )
    if teacher_model_config is not None and tr.loss.uses_teacher and k > 1:
        text = teacher_model_config
        if hasattr(text, "get_text_config"):
            text = text.get_text_config()
        try:
            check_tensor_parallel(k, text, t.model)
        except ValueError as e:
            raise SettingsError(str(e)) from None
    if memory is None:
        return
    _check_memory(config, layout, memory, teacher_params, student_params)


def _check_memory(
    config: Any,
    layout: Layout,
    memory: Sequence[GpuMemory],
    teacher_params: int | None,
    student_params: int | None,
) -> None:
    """Each GPU's share of teacher weights and student state against its free memory (a lower
    bound: activations come on top)."""
    from xtoken_core.models.dtypes import dtype_bytes

    t = config.teacher
    k = t.tensor_parallel
    held: dict[int, list[tuple[str, int]]] = {}
    if teacher_params:
        shard = teacher_params * dtype_bytes(t.dtype, t.device) // k
        for g, gpus in enumerate(layout.teacher_gpus):
            for gpu in gpus:
                held.setdefault(gpu, []).append((f"teacher group {g}'s weights", shard))
    if student_params:
        state = student_params * STUDENT_BYTES_PER_PARAM
        for r, gpu in enumerate(layout.trainer_gpus):
            held.setdefault(gpu, []).append((f"trainer rank {r}'s student state", state))
    for gpu, parts in sorted(held.items()):
        need = sum(b for _, b in parts) + PROCESS_OVERHEAD_BYTES * len(parts)
        free = memory[gpu].free
        if need <= free:
            continue
        what = " + ".join(f"{b / GIB:.1f} GiB of {name}" for name, b in parts)
        hint = _memory_hint(config, teacher_params, memory[gpu].total)
        raise SettingsError(
            f"GPU {gpu} would hold at least {need / GIB:.1f} GiB ({what}) but has "
            f"{free / GIB:.1f} GiB free; {hint}"
        )


def _memory_hint(config: Any, teacher_params: int | None, total: int) -> str:
    """What would fit: the smallest tensor-parallel size whose shard fits a GPU with its
    trainer, else dedicated teacher GPUs."""
    from xtoken_core.models.dtypes import dtype_bytes

    t = config.teacher
    if teacher_params:
        weights = teacher_params * dtype_bytes(t.dtype, t.device)
        for k in (1, 2, 4, 8):
            if k > t.tensor_parallel and weights / k + PROCESS_OVERHEAD_BYTES < 0.8 * total:
                return (
                    f"set teacher.tensor_parallel: {k} ({weights / k / GIB:.1f} GiB of teacher "
                    "weights per GPU), or put the teacher on GPUs of its own (teacher.gpus)"
                )
    return "put the teacher on GPUs of its own (teacher.gpus), or use a smaller model"
