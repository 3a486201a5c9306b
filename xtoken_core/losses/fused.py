"""The shared plumbing of the kernel path: where the kernels run (:func:`fused_path_available`),
the chunk plan (:func:`plan_chunks`), the kernel-ready inputs of a mode's kernel path
(:func:`kernel_inputs`) and the kernel-backed student CE (:func:`student_ce`). Each mode's kernel
path is in its module of :mod:`xtoken_core.losses.modes`.

The Triton kernels read the logits directly (fp32/bf16/fp16; CUDA, or ``TRITON_INTERPRET=1``)
and keep one fp32 scalar per row; only valid chunks are computed (compact ``[N, ...]``), and
only the columns the loss uses. The chunk bookkeeping (shifted ids, validity, N, both sides' row
groups) is one :func:`plan_chunks` (:mod:`xtoken_core.kernels.chunk_plan`). The student's CE
(:func:`student_ce`, :mod:`xtoken_core.kernels.row_ce`): each row's logsumexp, target logit and
argmax on the logits in their own dtype, reusing gold's row logsumexps at temperature 1.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, N valid chunks, R rows (B*T or B*U).
"""

from __future__ import annotations

import torch

from xtoken_core.kernels import chunk_plan, logit_rows, row_ce
from xtoken_core.losses import cpu, reference
from xtoken_core.losses.utils import (
    ChunkRows,
    chunk_rows,
    valid_chunk_numbering,
)

__all__ = [
    "fused_path_available",
    "kernel_inputs",
    "last_dim_contiguous",
    "plan_chunks",
    "student_ce",
]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_path_available(
    student_logits_BTV: torch.Tensor, teacher_logits_BUW: torch.Tensor
) -> bool:
    """Whether the modes' kernel paths (``kernel_kd_loss`` of :mod:`xtoken_core.losses.modes`)
    run on these logits.

    Args:
        student_logits_BTV: student logits.
        teacher_logits_BUW: teacher logits.

    Returns:
        True when Triton runs on them (CUDA or ``TRITON_INTERPRET=1``) and both are fp32/bf16/fp16.
    """
    return (
        logit_rows.use_triton(student_logits_BTV)
        and student_logits_BTV.dtype in _FUSED_DTYPES
        and teacher_logits_BUW.dtype in _FUSED_DTYPES
    )


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (what the kernels need), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def plan_chunks(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
    device: torch.device | None = None,
):
    """Shifted ids, validity, N and both sides' valid-chunk rows of one teacher, on the device.

    The fused path's replacement for :func:`~xtoken_core.losses.utils.shift_chunk_ids`,
    :func:`~xtoken_core.losses.reference.chunk_validity` and
    :func:`~xtoken_core.losses.utils.chunk_rows` (see
    :func:`xtoken_core.kernels.chunk_plan.plan_chunks`); pass the result as ``plan`` to a mode's
    kernel path. Needs Triton (:func:`fused_path_available`).

    Args:
        student_chunk_id_BT: [B, T] raw (unshifted) student chunk ids.
        teacher_chunk_id_BU: [B, U] raw teacher chunk ids.
        pair_valid_BC: [B, C] bool.
        sample_mask_B: [B] or None.
        pair_is_correct_BC: [B, C] bool or None.
        exact_token_match_only: keep only the chunks with ``pair_is_correct``.
        device: where the plan is made (the inputs are moved there); None: the student ids'.

    Returns:
        A :class:`xtoken_core.kernels.chunk_plan.ChunkPlan`.

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    # the kernel wrapper moves every other input to the student ids' device
    return chunk_plan.plan_chunks(
        student_chunk_id_BT if device is None else student_chunk_id_BT.to(device),
        teacher_chunk_id_BU,
        pair_valid_BC,
        sample_mask_B=sample_mask_B,
        pair_is_correct_BC=pair_is_correct_BC,
        exact_token_match_only=exact_token_match_only,
    )


def kernel_inputs(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    num_valid: int | None,
    plan=None,
    device_n: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None, ChunkRows, ChunkRows]:
    """Kernel-ready logits, ``valid_BC`` on their device, N, rows per side: what a mode's kernel
    path starts from.

    With a ``plan`` (:func:`plan_chunks`) the rows are its; else they are grouped here, with
    one valid-chunk numbering shared by both sides. N is ``num_valid`` when the caller read it
    already, else read here (one host sync); with ``device_n`` and a plan it stays on the device
    (N is None, the rows cover every chunk slot, ``plan.stats_5[4]`` holds N).

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits.
        teacher_logits_BUW: ``[B, U, W]`` teacher logits.
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool.
        num_valid: N when the caller read it already, else None.
        plan: :func:`plan_chunks` of this batch, or None.
        device_n: keep N on the device (with a plan).

    Returns:
        ``(zs_BTV, zt_BUW, valid_BC, N, student_rows, teacher_rows)``.
    """
    zs_BTV = last_dim_contiguous(student_logits_BTV)
    zt_BUW = last_dim_contiguous(teacher_logits_BUW.detach())
    if plan is not None:
        if device_n:
            s_rows, t_rows = ChunkRows(*plan.rows(0, None)), ChunkRows(*plan.rows(1, None))
            return zs_BTV, zt_BUW, plan.valid_BC, None, s_rows, t_rows
        N = int(plan.stats_5[4]) if num_valid is None else int(num_valid)
        s_rows, t_rows = ChunkRows(*plan.rows(0, N)), ChunkRows(*plan.rows(1, N))
        return zs_BTV, zt_BUW, plan.valid_BC, N, s_rows, t_rows
    valid_BC = valid_BC.to(zs_BTV.device)
    N = int(valid_BC.sum()) if num_valid is None else int(num_valid)
    segmap_S = valid_chunk_numbering(valid_BC)
    t_rows = chunk_rows(teacher_chunk_id_BU, valid_BC, N, segmap_S)
    s_rows = chunk_rows(student_chunk_id_BT, valid_BC, N, segmap_S)
    return zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows


def student_ce(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
    *,
    lse_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token CE, summed, kernel-backed. See :func:`reference.student_ce_loss`.

    The kernels of :mod:`xtoken_core.kernels.row_ce` (each row's logsumexp, target logit and
    argmax on the logits in their own dtype; no fp32 copy, no log-softmax) when Triton runs on
    the logits (CUDA, or ``TRITON_INTERPRET=1``) and they are fp32/bf16/fp16; else CPU logits
    take the CPU path (:func:`xtoken_core.losses.cpu.student_ce`: the same sums with one read
    of the exponentials per pass, no fp32 copy); else :func:`reference.student_ce_loss` (fp64
    logits stay fp64).

    Args:
        student_logits_BTV: ``[B, T, V]`` logits (gradient flows here).
        input_ids_BT: ``[B, T]`` student token ids; the logits at p predict ``input_ids[:, p + 1]``.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).
        lse_R: ``[B*T]`` fp32 row logsumexps of the logits at temperature 1 when the caller made
            them (the gold KD pass at temperature 1); ignored on the reference path.

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    if logit_rows.use_triton(student_logits_BTV) and student_logits_BTV.dtype in _FUSED_DTYPES:
        return row_ce.row_cross_entropy(
            student_logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R=lse_R
        )
    if cpu.cpu_path_available(student_logits_BTV):
        return cpu.student_ce(student_logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B)
    return reference.student_ce_loss(student_logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B)
