"""Which GPUs each process of a run takes, and whether the models fit them.

A run config names its layout with three keys:

* ``trainer.gpus``: trainer rank r runs on GPU ``trainer.gpus[r]`` (default: GPU r);
* ``teacher.tensor_parallel`` (k): each teacher group is k processes, the model's layers split
  over k GPUs (services/teacher/tensor_parallel.py);
* ``teacher.gpus``: group g runs on ``teacher.gpus[g*k:(g+1)*k]`` (default: GPUs g*k .. g*k+k-1,
  modulo the GPUs there, so one teacher on one GPU shares GPU 0 with trainer rank 0 as before).

Each further teacher (an entry of ``extra_teachers``) places its groups by its own
``tensor_parallel`` and ``gpus`` alike (taken from the teacher section unless the entry sets them).
A GPU may hold a trainer rank and teachers' shards (colocated) or either alone (dedicated); the
memory check adds up everything placed on one GPU.
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
        teacher_gpus: per group of teacher 0, the GPUs of its ranks in rank order (empty when
            the teacher runs on the CPU or the loss uses none).
        extra_teacher_gpus: per further teacher (teacher 1, 2, ...), the GPUs of each of its
            groups alike (empty for one on the CPU).
    """

    trainer_gpus: tuple[int, ...] = ()
    teacher_gpus: tuple[tuple[int, ...], ...] = ()
    extra_teacher_gpus: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def teacher(self, index: int) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each group of teacher ``index`` (0: ``teacher_gpus``)."""
        if index == 0:
            return self.teacher_gpus
        extra = self.extra_teacher_gpus
        return extra[index - 1] if index - 1 < len(extra) else ()

    def groups(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(teacher, group, GPUs)`` of every teacher group on GPUs."""
        teachers = (self.teacher_gpus, *self.extra_teacher_gpus)
        return [(j, g, gpus) for j, groups in enumerate(teachers) for g, gpus in enumerate(groups)]

    def describe(self) -> str:
        """One line for the run's log: ``trainer ranks on GPU 0,1; teacher group 0 (tensor
        parallel 2) on GPU 2,3; teacher 1 group 0 on GPU 0``."""
        parts = []
        if self.trainer_gpus:
            parts.append(f"trainer ranks on GPU {_gpus(self.trainer_gpus)}")
        for j, g, gpus in self.groups():
            tp = f" (tensor parallel {len(gpus)})" if len(gpus) > 1 else ""
            parts.append(f"{_group_name(j, g)}{tp} on GPU {_gpus(gpus)}")
        return "; ".join(parts) or "every process on the CPU"


def _group_name(teacher: int, group: int) -> str:
    """``teacher group 0`` (teacher 0's), ``teacher 1 group 0``."""
    return f"teacher group {group}" if teacher == 0 else f"teacher {teacher} group {group}"


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
    tr = config.trainer
    count = max(1, gpu_count)
    trainer: tuple[int, ...] = ()
    if _cuda(str(tr.compute.device)):
        trainer = tuple(tr.gpus) if tr.gpus is not None else tuple(range(config.trainers))
    teachers = [  # a teacher a cache serves runs no process: no GPU
        _teacher_gpus(view.section, view.groups, count)
        if tr.loss.uses_teacher and view.live
        else ()
        for view in config.teacher_list()
    ]
    return Layout(trainer, teachers[0], tuple(teachers[1:]))


def _teacher_gpus(t: Any, n: int, count: int) -> tuple[tuple[int, ...], ...]:
    """The GPUs of each of the ``n`` groups of one teacher's section ``t`` (none on the CPU)."""
    if not _cuda(str(t.device)):
        return ()
    k = t.tensor_parallel
    if t.gpus is not None:
        return tuple(tuple(t.gpus[g * k : (g + 1) * k]) for g in range(n))
    if k == 1 and _index(str(t.device)) is not None:
        return tuple((_index(str(t.device)),) for _ in range(n))
    return tuple(tuple((g * k + i) % count for i in range(k)) for g in range(n))


def run_transport(config: Any, teacher: Any = None) -> str:
    """A teacher's transport (``teacher``: its section, default the ``teacher`` section): as set,
    or for ``auto`` ``topk`` when its groups are placed apart from the trainer ranks
    (:meth:`~services.supervise.config.RunConfig.apart`), else a ring: ``cuda_ipc`` when the
    teacher and the trainers are on GPUs, ``shm`` otherwise."""
    teacher = config.teacher if teacher is None else teacher
    t = teacher.transport
    if t != "auto":
        return t
    if config.apart(teacher):
        return "topk"
    # a cuda_ipc ring only where the trainers read it on a GPU too
    on_gpu = config.trainer.compute.device.startswith("cuda")
    return ring_transport(teacher.device) if on_gpu else "shm"


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
    extra_teacher_params: Sequence[int | None] = (),
    extra_teacher_model_configs: Sequence[Any] = (),
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
        extra_teacher_params: per further teacher (``extra_teachers``), its parameter count or
            None.
        extra_teacher_model_configs: per further teacher, its transformers config or None.

    Raises:
        SettingsError: one line naming the key and what would fit.
    """
    tr = config.trainer
    views = config.teacher_list()
    params = [teacher_params, *extra_teacher_params]
    shapes = [teacher_model_config, *extra_teacher_model_configs]
    if tr.gpus is not None and len(tr.gpus) != config.trainers:
        raise SettingsError(
            f"trainer.gpus names {len(tr.gpus)} GPU(s) for trainers={config.trainers}; name one "
            "GPU per trainer rank"
        )
    for view in views:
        t, k, key = view.section, view.section.tensor_parallel, view.key
        groups = "teachers" if view.index == 0 else f"{key}.groups"
        if t.gpus is not None and tr.loss.uses_teacher and len(t.gpus) != view.groups * k:
            raise SettingsError(
                f"{key}.gpus names {len(t.gpus)} GPU(s) for {groups}={view.groups} x "
                f"{key}.tensor_parallel={k}; name {view.groups * k}"
            )
    if len(set(layout.trainer_gpus)) != len(layout.trainer_gpus):
        raise SettingsError(
            f"trainer.gpus={list(layout.trainer_gpus)} puts two trainer ranks on one GPU; name "
            "a distinct GPU per rank"
        )
    for j, g, gpus in layout.groups():
        if len(set(gpus)) != len(gpus):
            raise SettingsError(
                f"{views[j].key}.gpus puts two ranks of {_group_name(j, g)} on one GPU "
                f"({_gpus(gpus)}); name {len(gpus)} distinct GPUs per group"
            )
    named = [("trainer.gpus", g) for g in layout.trainer_gpus] + [
        (f"{views[j].key}.gpus", gpu) for j, _, gpus in layout.groups() for gpu in gpus
    ]
    for key, gpu in named:
        if not 0 <= gpu < gpu_count:
            there = f"0-{gpu_count - 1}" if gpu_count else "none"
            raise SettingsError(
                f"{key} names GPU {gpu}, but this machine shows {gpu_count} (GPUs {there}); "
                "name GPUs that are there"
            )
    for view, shape in zip(views, shapes, strict=False):
        k = view.section.tensor_parallel
        if shape is None or not tr.loss.uses_teacher or k == 1:
            continue
        text = shape.get_text_config() if hasattr(shape, "get_text_config") else shape
        try:
            check_tensor_parallel(k, text, view.section.model)
        except ValueError as e:
            message = str(e)
            if view.index:  # the entry's own key, not the teacher section's
                message = message.replace("teacher.tensor_parallel", f"{view.key}.tensor_parallel")
            raise SettingsError(message) from None
    if memory is None:
        return
    _check_memory(config, layout, memory, params, student_params)


def _check_memory(
    config: Any,
    layout: Layout,
    memory: Sequence[GpuMemory],
    teacher_params: Sequence[int | None],
    student_params: int | None,
) -> None:
    """Each GPU's share of every teacher's weights and the student's state against its free
    memory (a lower bound: activations come on top)."""
    from xtoken_core.models.dtypes import dtype_bytes

    views = config.teacher_list()
    held: dict[int, list[tuple[str, int, int | None]]] = {}  # GPU -> (what, bytes, teacher)
    for j, g, gpus in layout.groups():
        params = teacher_params[j] if j < len(teacher_params) else None
        if not params:
            continue
        t = views[j].section
        shard = params * dtype_bytes(t.dtype, t.device) // t.tensor_parallel
        for gpu in gpus:
            held.setdefault(gpu, []).append((f"{_group_name(j, g)}'s weights", shard, j))
    if student_params:
        state = student_params * STUDENT_BYTES_PER_PARAM
        for r, gpu in enumerate(layout.trainer_gpus):
            held.setdefault(gpu, []).append((f"trainer rank {r}'s student state", state, None))
    for gpu, parts in sorted(held.items()):
        need = sum(b for _, b, _ in parts) + PROCESS_OVERHEAD_BYTES * len(parts)
        free = memory[gpu].free
        if need <= free:
            continue
        what = " + ".join(f"{b / GIB:.1f} GiB of {name}" for name, b, _ in parts)
        # the hint is for the teacher with the largest share of this GPU
        shares = [(b, j) for _, b, j in parts if j is not None]
        j = max(shares)[1] if shares else 0
        params = teacher_params[j] if j < len(teacher_params) else None
        hint = _memory_hint(views[j], params, memory[gpu].total)
        raise SettingsError(
            f"GPU {gpu} would hold at least {need / GIB:.1f} GiB ({what}) but has "
            f"{free / GIB:.1f} GiB free; {hint}"
        )


def _memory_hint(view: Any, teacher_params: int | None, total: int) -> str:
    """What would fit: the smallest tensor-parallel size whose shard of the teacher ``view``
    (:class:`~services.supervise.teachers.RunTeacher`) fits a GPU with its trainer, else
    dedicated teacher GPUs."""
    from xtoken_core.models.dtypes import dtype_bytes

    t, key = view.section, view.key
    if teacher_params:
        weights = teacher_params * dtype_bytes(t.dtype, t.device)
        for k in (1, 2, 4, 8):
            if k > t.tensor_parallel and weights / k + PROCESS_OVERHEAD_BYTES < 0.8 * total:
                return (
                    f"set {key}.tensor_parallel: {k} ({weights / k / GIB:.1f} GiB of teacher "
                    f"weights per GPU), or put the teacher on GPUs of its own ({key}.gpus)"
                )
    return f"put the teacher on GPUs of its own ({key}.gpus), or use a smaller model"
