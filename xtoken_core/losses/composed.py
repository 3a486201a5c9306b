"""Composed KD path: the chunk log-softmax and gather-projection kernels joined by PyTorch ops.

The fallback of :mod:`xtoken_core.losses.fused` for float64 logits or where Triton does not run
(each kernel then falls back to its own reference). Same signatures and conventions as
:func:`xtoken_core.losses.reference.pkl_kd_loss` and
:func:`~xtoken_core.losses.reference.gold_kd_loss`; the last step (KL, L1, metrics) is the
reference's own (:func:`~xtoken_core.losses.reference.pkl_terms_from_chunks`,
:func:`~xtoken_core.losses.reference.gold_terms_from_chunks`).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns, N rows (B*T).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable

import torch

from xtoken_core.losses import reference
from xtoken_core.losses.reference import KDTerms
from xtoken_core.losses.utils import chunk_sizes

logger = logging.getLogger(__name__)

_CHUNK_AVG_NAME = "chunk_avg_log_softmax"
_KERNEL_MODULES = ("xtoken_core.kernels", "xtoken_core.kernels.chunk_log_softmax")


@functools.cache
def load_chunk_avg_log_softmax() -> Callable | None:
    """The fused ``chunk_avg_log_softmax(logits_BTV, chunk_id_BT, num_chunks, temperature)``.

    It returns ``(avg_BCV fp32, sizes_BC)``.

    Returns:
        The function, or None when the kernels (or Triton) cannot be imported.
    """
    for name in _KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            logger.debug("[losses] %s not importable: %s", name, exc)
            continue
        fn = getattr(module, _CHUNK_AVG_NAME, None)
        if callable(fn):
            return fn
    return None


@functools.cache
def load_project_by_gather() -> Callable | None:
    """The gather projection ``project_by_gather(p_NS, (indices, likelihoods, idx), out_dtype)``.

    Returns:
        The function, or None when it cannot be imported.
    """
    try:
        module = importlib.import_module("xtoken_core.kernels.projection_gather")
    except ImportError as exc:
        logger.debug("[losses] projection_gather not importable: %s", exc)
        return None
    fn = getattr(module, "project_by_gather", None)
    return fn if callable(fn) else None


def kernels_available() -> bool:
    """Whether the fused kernels can run: importable and Triton installed (CUDA: caller's check)."""
    return (
        importlib.util.find_spec("triton") is not None and load_chunk_avg_log_softmax() is not None
    )


def _require_kernel() -> Callable:
    fn = load_chunk_avg_log_softmax()
    if fn is None:
        raise RuntimeError(
            f"backend='kernel' but {_CHUNK_AVG_NAME} is not importable from {_KERNEL_MODULES} "
            "(Triton missing?); use backend='auto' or 'reference'"
        )
    return fn


def chunk_mean_scatter(
    x_BTK: torch.Tensor, chunk_id_BT: torch.Tensor, num_chunks: int
) -> torch.Tensor:
    """Per-chunk mean by ``index_add`` (O(T*K)), equal to the one-hot reference.

    Args:
        x_BTK: ``[B, T, K]`` values.
        chunk_id_BT: ``[B, T]`` ids in ``[-1, C)``.
        num_chunks: C.

    Returns:
        ``[B, C, K]`` means (0 for empty chunks).
    """
    B, T, K = x_BTK.shape
    # Slot 0 of every sample collects the -1 positions and is dropped.
    rows_BT = (
        chunk_id_BT + 1 + torch.arange(B, device=chunk_id_BT.device).view(-1, 1) * (num_chunks + 1)
    )
    sums = x_BTK.new_zeros(B * (num_chunks + 1), K).index_add(
        0, rows_BT.reshape(-1), x_BTK.reshape(B * T, K)
    )
    sums_BCK = sums.view(B, num_chunks + 1, K)[:, 1:]
    sizes_BC = chunk_sizes(chunk_id_BT, num_chunks).to(x_BTK.dtype)
    return sums_BCK / sizes_BC.clamp_min(1).unsqueeze(-1)


def pkl_kd_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    projection_VW: torch.Tensor,
    *,
    temperature: float,
    vocab_topk: int | None,
    reverse_kl: bool,
    projection_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    topk_columns: str = "valid",
) -> KDTerms:
    """P-KL from composed kernels (fp64, or no Triton): chunk log-softmax kernel + projection.

    Arguments as :func:`xtoken_core.losses.fused.pkl_kd_loss`. With ``projection_topk`` (the
    dense ``(indices [V_rows, K], likelihoods)`` form of M, on the logits' device) the
    projection runs as gathers (``project_by_gather``), else through
    :class:`~xtoken_core.losses.utils.Fp32SparseMM` on ``projection_VW``.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    chunk_avg = _require_kernel()
    C = valid_BC.shape[1]
    dtype = reference.compute_dtype(student_logits_BTV)
    teacher_logits_BUW = teacher_logits_BUW.detach()
    idx_K = reference.select_teacher_columns(
        teacher_logits_BUW, teacher_chunk_id_BU, vocab_topk, topk_columns
    )
    with torch.no_grad():
        teacher_lp_BCK, _ = chunk_avg(
            teacher_logits_BUW[..., idx_K].contiguous(),
            teacher_chunk_id_BU,
            C,
            temperature,
            out_dtype=dtype,
        )
    project = load_project_by_gather()
    if projection_topk is not None and project is not None:
        indices_VK, likelihoods_VK = projection_topk
        B, T, V = student_logits_BTV.shape
        rows = indices_VK.shape[0]  # student ids past the rows have no entries
        probs_NV = torch.softmax(student_logits_BTV.to(dtype) / temperature, -1).reshape(B * T, V)
        q_NK = project(probs_NV[:, :rows], (indices_VK, likelihoods_VK, idx_K), out_dtype=dtype)
        q_BTK = q_NK.reshape(B, T, -1)
    else:
        projection_VK = reference.restrict_columns(projection_VW, idx_K)
        q_BTK = reference.project_student_probs(student_logits_BTV, projection_VK, temperature)
    q_BCK = chunk_mean_scatter(q_BTK, student_chunk_id_BT, C)
    return reference.pkl_terms_from_chunks(
        teacher_lp_BCK[valid_BC],
        q_BCK[valid_BC].to(teacher_lp_BCK.dtype),
        valid_BC,
        temperature=temperature,
        reverse_kl=reverse_kl,
    )


def gold_kd_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    exact_map: dict[str, torch.Tensor],
    *,
    temperature: float,
    uncommon_topk: int,
    reverse_kl: bool,
) -> KDTerms:
    """Gold from composed kernels (fp64, or no Triton): full [B, C, V] chunk log-softmax.

    Arguments as :func:`xtoken_core.losses.fused.gold_kd_loss`.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    chunk_avg = _require_kernel()
    C = valid_BC.shape[1]
    dtype = reference.compute_dtype(student_logits_BTV)
    student_lp_BCV, _ = chunk_avg(
        student_logits_BTV, student_chunk_id_BT, C, temperature, out_dtype=dtype
    )
    with torch.no_grad():
        teacher_lp_BCW, _ = chunk_avg(
            teacher_logits_BUW.detach(), teacher_chunk_id_BU, C, temperature, out_dtype=dtype
        )
    return reference.gold_terms_from_chunks(
        teacher_lp_BCW,
        student_lp_BCV,
        valid_BC,
        exact_map,
        temperature=temperature,
        uncommon_topk=uncommon_topk,
        reverse_kl=reverse_kl,
    )
