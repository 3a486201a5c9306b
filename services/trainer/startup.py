"""The student's start-up step: the compiled graphs built before training, a step shown to fit."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from services.trainer.compile import (
    compile_cache_counts,
    compile_phase_seconds,
    mark_step,
    warm_lengths,
)
from services.trainer.student import Student
from xtoken_core.data.sample import round_up

logger = logging.getLogger(__name__)

# Legend: B rows, T student tokens, D hidden size, V student vocab.

# memory other processes may hold on the trainer's GPU before the message names them (this
# process's own CUDA context counts as "other" too: ~0.5 GiB)
OTHERS_NAMED_BYTES = 2 * 2**30


class StartupOutOfMemory(RuntimeError):
    """The student's start-up step ran out of device memory (the message names the fix)."""


def warm_up(
    student: Student,
    *,
    micro_batch: int,
    max_length: int,
    head: Any = None,
    length_multiple: int = 1,
    shortest: int = 64,
    report: dict | None = None,
) -> float | None:
    """One forward and backward at ``micro_batch x max_length`` before training: compiles the
    student (once per run), and shows at start that a step's activations fit in memory.

    A student that ``torch.compile`` cannot handle runs eagerly, with one warning. CPU runs
    without compile skip it (the demo starts at once).

    Args:
        student: the student.
        micro_batch: samples per micro-batch.
        max_length: the longest micro-batch in tokens (0: 128).
        head: the step's fused output head, or None (the student's logits).
        length_multiple: micro-batch lengths are multiples of it (``compute.length_multiple``):
            so are the ladder's.
        shortest: the ladder's shortest rung (``compute.warm_shortest``).
        report: filled, when given, with where the seconds went: ``calls``, ``[length, seconds]``
            of each call in order (the first compiles; with CUDA graphs each length's second
            call records), and ``caches``, Inductor's cache lookups meanwhile
            (:func:`~services.trainer.compile.compile_cache_counts`), and ``phases``, the
            seconds of each compiler phase that took at least 0.05 s meanwhile
            (:func:`~services.trainer.compile.compile_phase_seconds`; nested, so they overlap).

    Returns:
        Seconds the step took (compile included), or None when skipped.

    Raises:
        StartupOutOfMemory: the step does not fit the device (names the settings to lower).
    """
    if not (student.compiled or student.device.type == "cuda"):
        return None
    length = max_length or 128
    # the longest first (the memory check), then the shorter ones that need graphs of their
    # own (services/trainer/compile.py); eager needs the longest only
    lengths = warm_lengths(length, shortest) if student.compiled else [length]
    lengths = list(dict.fromkeys(round_up(n, length_multiple) for n in lengths))
    # CUDA graph trees run a function's first call in a length as a warm-up and record it at
    # the second: two steps per length, so that a run's first steps replay
    repeats = 2 if student.cuda_graphs else 1
    calls: list[list] = []
    caches_before = compile_cache_counts() if report is not None else None
    phases_before = compile_phase_seconds() if report is not None else None
    t0 = time.perf_counter()
    try:
        for n in lengths:
            for _ in range(repeats):
                t_call = time.perf_counter()
                warm_step(student, student.pads(micro_batch, n), head)
                if report is not None:  # each call's own seconds: wait for its kernels
                    if student.device.type == "cuda":
                        torch.cuda.synchronize(student.device)
                    calls.append([n, round(time.perf_counter() - t_call, 3)])
    except torch.OutOfMemoryError as e:
        raise _out_of_memory(student.device, micro_batch, length, head) from e
    except Exception as e:  # Dynamo / Inductor failures have many types
        if is_allocation_failure(e):  # out of memory inside a library: not compile's fault
            raise _out_of_memory(student.device, micro_batch, length, head) from e
        if not student.compiled:
            raise
        logger.warning(
            "[trainer] torch.compile failed on the student (%s: %s); training eagerly. Set "
            "trainer.compute.compile: false to skip the attempt",
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        student.uncompile()
        student.zero_grads()
        try:
            warm_step(student, student.pads(micro_batch, length), head)
        except torch.OutOfMemoryError as oom:
            raise _out_of_memory(student.device, micro_batch, length, head) from oom
    if student.device.type == "cuda":
        torch.cuda.synchronize(student.device)
    seconds = time.perf_counter() - t0
    student.compiles.after_start_up()
    if report is not None:
        after = compile_cache_counts()
        report["calls"] = calls
        report["caches"] = {
            name: {k: after[name][k] - caches_before[name][k] for k in counts}
            for name, counts in after.items()
        }
        phases = compile_phase_seconds()
        spent = {k: v - phases_before.get(k, 0.0) for k, v in phases.items()}
        report["phases"] = {
            k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.05
        }
    return seconds


def start_up_brief(report: dict) -> str:
    """One clause of where a start-up step's seconds went (a ``warm_up`` report): its first call
    (the compile), the other calls (the other lengths' graphs, the recordings) and Inductor's
    cache lookups; "" for an empty report."""
    calls = report.get("calls") or []
    if not calls:
        return ""
    rest = calls[1:]
    lengths = len({n for n, _ in calls})
    text = f": the first call {calls[0][1]:.1f} s"
    if rest:
        text += (
            f", the {len(rest)} others {sum(t for _, t in rest):.1f} s ({lengths} "
            f"length{'s' if lengths > 1 else ''})"
        )
    caches = report.get("caches") or {}
    if caches:
        total = {k: sum(c[k] for c in caches.values()) for k in ("hit", "miss", "bypass")}
        text += (
            f"; Inductor's caches {total['hit']} hits, {total['miss']} misses, "
            f"{total['bypass']} bypassed"
        )
    return text


def warm_step(student: Student, ids_BT: torch.Tensor, head: Any = None) -> None:
    """A forward and backward of pads that trains nothing (no gradient is left)."""
    if student.cuda_graphs:
        mark_step()
    mask, position_ids = student.filler_attention(ids_BT)
    with student.gradient_sync(last=False):
        if head is not None:  # the head's blocks of logits, not the whole logits
            _warm_head(student, head, ids_BT, mask, position_ids)
        else:
            logits_BTV = student.forward(ids_BT, mask, position_ids)
            (logits_BTV.sum() * 0.0).backward()
            del logits_BTV
    student.zero_grads()


def _warm_head(
    student: Student, head: Any, ids_BT: torch.Tensor, mask: Any = None, position_ids: Any = None
) -> None:
    """A forward and backward through the fused head (its student CE: no teacher at
    start-up), with the blocks and their gradients a step holds."""
    from xtoken_core.losses import FusedHead

    hidden_BTD = student.hidden(ids_BT, mask, position_ids)
    ones_BT = torch.ones_like(ids_BT, dtype=torch.bool)
    batch = {"input_ids": ids_BT, "token_mask": ones_BT}
    ce_head = FusedHead(None, head.block_rows)
    with student.train_autocast():
        loss, _ = ce_head(hidden_BTD, student.lm_head.weight, None, batch)
    (loss * 0.0).backward()


def _out_of_memory(
    device: torch.device, micro_batch: int, length: int, head: Any
) -> StartupOutOfMemory:
    total = others = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        others = max(0, total - free - torch.cuda.memory_reserved(device))
    return StartupOutOfMemory(
        startup_oom_message(
            micro_batch, length, str(device), total, others, fused_head=head is not None
        )
    )


def startup_oom_message(
    micro_batch: int,
    length: int,
    device: str,
    total: int | None,
    others: int | None,
    *,
    fused_head: bool = True,
) -> str:
    """What a start-up step that did not fit says: the settings to lower and, when other
    processes hold much of the GPU (a colocated teacher, rollout workers, another run), that.

    Args:
        total: the device's bytes (None: unknown).
        others: bytes neither free nor held by this process's allocator (None: unknown).
        fused_head: whether the step already runs the fused output head (when not, the message
            names it: it never holds the whole logits).
    """
    size = f" ({total / 2**30:.0f} GiB)" if total else ""
    head = (
        ""
        if fused_head
        else "trainer.compute.fused_head: true (the output layer and the loss by row blocks, "
        "never the whole logits) or "
    )
    text = (
        f"a student step of micro_batch={micro_batch} x {length} tokens does not fit in "
        f"{device}'s memory{size}: lower trainer.feed.micro_batch, or set {head}"
        "trainer.compute.activation_checkpointing: true"
    )
    if others is not None and others >= OTHERS_NAMED_BYTES:
        text += (
            f"; other processes hold {others / 2**30:.1f} GiB of it (a teacher, rollout workers "
            "or another job on this GPU: nvidia-smi lists them), so giving them less or another "
            "GPU also helps"
        )
    return text


def is_allocation_failure(error: BaseException) -> bool:
    """An error that is the device running out of memory under another name (cuBLAS failing to
    create its handle, an allocator's message), anywhere in its chain of causes."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        text = str(error)
        if "CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text.lower():
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
