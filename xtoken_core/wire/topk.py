"""Sparse teacher targets: the K largest log-probabilities per position, their ids, the log of the
remaining mass and the log-partition (encode on the teacher, decode into dense teacher logits on
the trainer).

This is what the ``topk`` teacher transport sends through the queue and what a store of teacher
outputs keeps: ``8 K + 8`` bytes per teacher token (int32 ids, fp32 log-probs, an fp32 rest, an
fp32 log-partition) instead of ``2 W`` for bf16 logits. Decoding spreads the rest mass uniformly
over the ``W - K`` ids outside the top K and adds the log-partition back, so that where K covers
the vocab the dense result is the teacher's logits themselves. A softmax would not need the
log-partition (``softmax(z - c) == softmax(z)``), but a loss that picks columns by the largest
logit over the positions (P-KL's ``vocab_topk``) does: log-probs shift each position by its own
constant and change which columns win.

Legend: N positions (any leading shape, e.g. ``[B, U]``), W teacher vocab, K ids kept per
position.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from xtoken_core.kernels._utils import use_triton
from xtoken_core.kernels.topk_rest import row_lse_rest

__all__ = [
    "LOG_FLOOR",
    "TopK",
    "check_top_k",
    "check_targets",
    "decode_dtype",
    "decode_topk",
    "encode_topk",
    "topk_bytes_per_token",
]

#: The least log-probability an id outside the top K gets, before decode adds the log-partition:
#: where the rest mass is 0 (the teacher masks those ids at ``-inf``) or below ``exp(LOG_FLOOR)``,
#: decode gives this finite value (plus the log-partition), so no loss meets ``-inf`` (``0 * -inf``
#: is NaN), yet ``exp`` of it relative to the row (or of that over any temperature up to 90) is
#: exactly 0 in fp32. The rest itself is computed in log space and never underflows.
LOG_FLOOR = -1.0e4

#: Elements of one fp32 working block of :func:`encode_topk` (256 MiB): bounds its memory on a
#: long batch of a large vocab.
_BLOCK_ELEMENTS = 1 << 26

#: Log-prob dtypes the targets may travel in.
LOGPROB_DTYPES = (torch.float32, torch.bfloat16)


class TopK(NamedTuple):
    """Sparse teacher targets of N positions.

    Attributes:
        ids_NK: ``[..., K]`` int32 teacher ids, by decreasing log-probability.
        logprobs_NK: ``[..., K]`` their log-probabilities (fp32, or bf16).
        rest_N: ``[...]`` fp32 log of the probability mass outside the K ids (``-inf`` when there
            is none).
        lse_N: ``[...]`` fp32 log-partition ``logsumexp(z)`` of the logits: log-prob + lse is the
            logit.
    """

    ids_NK: torch.Tensor
    logprobs_NK: torch.Tensor
    rest_N: torch.Tensor
    lse_N: torch.Tensor

    @property
    def k(self) -> int:
        """K, the ids kept per position."""
        return int(self.ids_NK.shape[-1])


def check_top_k(k: int, width: int, setting: str = "teacher.top_k") -> None:
    """Refuse a K the vocab cannot serve.

    Args:
        k: ids kept per position.
        width: the teacher vocab W (its logits' width).
        setting: the setting that chose ``k`` (named in the message).

    Raises:
        ValueError: ``k < 1`` or ``k > width``.
    """
    if type(k) is not int or not 1 <= k <= width:
        raise ValueError(
            f"{setting}={k!r} must be between 1 and the teacher's vocab of {width}; set "
            f"{setting} <= {width}"
        )


def encode_topk(
    logits_NW: torch.Tensor, k: int, *, logprobs_dtype: torch.dtype = torch.float32
) -> TopK:
    """The K largest log-probabilities per position (``log_softmax`` in fp32), their ids, the log
    of the remaining mass and the log-partition of the logits.

    The rest is the log-sum-exp of the logits outside the top K minus that of all of them, so it
    stays exact when the top K hold nearly all the mass (``log(1 - sum p)`` would cancel). On a
    GPU (or in Triton's interpreter) the top K is taken on the logits as they are and one kernel
    pass gives the log-partition and the rest (``xtoken_core.kernels.topk_rest``); elsewhere the
    positions are worked through in blocks of at most 256 MiB of fp32.

    Args:
        logits_NW: ``[..., W]`` logits, any float dtype, on any device.
        k: ids kept per position (``1 <= k <= W``).
        logprobs_dtype: dtype of the log-probs sent: fp32 (exact) or bf16 (half the bytes,
            rounded to 8 bits of mantissa).

    Returns:
        :class:`TopK` on the logits' device: ``ids_NK`` int32 ``[..., K]``, ``logprobs_NK``
        ``[..., K]``, ``rest_N`` and ``lse_N`` fp32 ``[...]``.

    Raises:
        ValueError: ``k`` outside ``[1, W]``, a logits tensor that is not float or has no vocab
            dim, or an unsupported ``logprobs_dtype``.
    """
    if logits_NW.dim() < 1 or not logits_NW.is_floating_point():
        raise ValueError(
            f"logits of shape {tuple(logits_NW.shape)} and dtype {logits_NW.dtype}: expected "
            "float logits [..., W]"
        )
    if logprobs_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprobs_dtype={logprobs_dtype}: use torch.float32 or torch.bfloat16")
    W = int(logits_NW.shape[-1])
    check_top_k(k, W, "k")
    lead = tuple(logits_NW.shape[:-1])
    flat_NW = logits_NW.reshape(-1, W)
    N = flat_NW.shape[0]
    device = logits_NW.device
    ids_NK = torch.empty((N, k), dtype=torch.int32, device=device)
    logprobs_NK = torch.empty((N, k), dtype=logprobs_dtype, device=device)
    rest_N = torch.empty((N,), dtype=torch.float32, device=device)
    lse_N = torch.empty((N,), dtype=torch.float32, device=device)
    step = max(1, _BLOCK_ELEMENTS // max(W, 1))
    fused = use_triton(flat_NW)
    for start in range(0, N, step):
        stop = min(N, start + step)
        if fused:  # one kernel pass over the logits as they are: no fp32 copy, no scatter
            z_nW = flat_NW[start:stop]
            top_nK, idx_nK = torch.topk(z_nW, k, dim=-1)
            lse_n, rest_n = row_lse_rest(z_nW, top_nK)
            rest_N[start:stop] = rest_n
            top_nK = top_nK.float()
        else:
            z_nW = flat_NW[start:stop].to(torch.float32, copy=True)  # masked in place below
            lse_n = torch.logsumexp(z_nW, dim=-1)
            top_nK, idx_nK = torch.topk(z_nW, k, dim=-1)
            z_nW.scatter_(-1, idx_nK, float("-inf"))
            rest_N[start:stop] = torch.logsumexp(z_nW, dim=-1) - lse_n
        logprobs_NK[start:stop] = top_nK - lse_n[:, None]
        ids_NK[start:stop] = idx_nK
        lse_N[start:stop] = lse_n
    return TopK(
        ids_NK.reshape(*lead, k),
        logprobs_NK.reshape(*lead, k),
        rest_N.reshape(lead),
        lse_N.reshape(lead),
    )


def check_targets(targets: TopK, width: int, *, ids: bool = True) -> None:
    """Refuse targets that :func:`decode_topk` cannot decode into ``width`` columns.

    ``ids``: also scan the ids' range (a pass over them; False where their producer checked
    them, as a teacher cache's reader does).

    Raises:
        ValueError: shapes that disagree, a log-partition that is not fp32, K outside ``[1, W]``,
            non-integer ids or ids outside ``[0, W)`` (ids on a GPU are read back: one sync).
    """
    ids_NK, logprobs_NK, rest_N, lse_N = targets
    lead = tuple(ids_NK.shape[:-1])
    if (
        ids_NK.shape != logprobs_NK.shape
        or tuple(rest_N.shape) != lead
        or tuple(lse_N.shape) != lead
    ):
        raise ValueError(
            f"top-k targets of shapes ids {tuple(ids_NK.shape)}, logprobs "
            f"{tuple(logprobs_NK.shape)}, rest {tuple(rest_N.shape)}, lse {tuple(lse_N.shape)}: "
            "expected [..., K], [..., K], [...], [...]"
        )
    if ids_NK.is_floating_point() or ids_NK.dtype == torch.bool:
        raise ValueError(f"top-k ids are {ids_NK.dtype}, not an integer tensor")
    if lse_N.dtype != torch.float32:
        raise ValueError(f"top-k log-partition is {lse_N.dtype}, not float32")
    K = int(ids_NK.shape[-1])
    check_top_k(K, width, "top-k targets' K")
    if ids and ids_NK.numel():
        lo, hi = torch.aminmax(ids_NK)  # one pass over the ids, not two
        if int(lo) < 0 or int(hi) >= width:
            raise ValueError(f"top-k ids outside [0, {width}): targets of another teacher vocab?")


def decode_topk(
    targets: TopK,
    width: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense teacher logits from sparse targets.

    The top-K ids get their log-prob plus the log-partition; every other id gets
    ``log(rest / (W - K))`` (the rest mass spread uniformly), at least :data:`LOG_FLOOR`, plus the
    log-partition, and at most the position's K-th logit. The floor applies before the
    log-partition is added, so a rest of 0 gives finite values whose ``exp`` relative to the row
    is still 0. When K covers the vocab the result
    is the teacher's logits (up to fp32 rounding); otherwise its softmax is the top-K
    probabilities with the rest spread evenly.

    Args:
        targets: :class:`TopK` of N positions (``[..., K]``, ``[..., K]``, ``[...]``, ``[...]``).
        width: the teacher vocab W.
        device: where the dense tensor goes (default: the targets' device).
        dtype: its dtype (fp32: the values as sent, summed in fp32).

    Returns:
        ``[..., W]`` logits.

    Raises:
        ValueError: shapes that disagree, a log-partition that is not fp32, K outside ``[1, W]``,
            non-integer ids or ids outside ``[0, W)``.
    """
    check_targets(targets, width)
    ids_NK, logprobs_NK, rest_N, lse_N = targets
    lead = tuple(ids_NK.shape[:-1])
    K = int(ids_NK.shape[-1])
    device = torch.device(device) if device is not None else ids_NK.device
    ids_NK = ids_NK.to(device, torch.int64, non_blocking=True)
    lse_N = lse_N.to(device, non_blocking=True)
    logits_NK = logprobs_NK.to(device, torch.float32, non_blocking=True) + lse_N[..., None]
    fill_N = torch.full(lead, LOG_FLOOR, dtype=torch.float32, device=device)
    if width > K:  # ids outside the top K exist: each gets an equal share of the rest
        rest_N = rest_N.to(device, torch.float32, non_blocking=True)
        fill_N = (rest_N - math.log(width - K)).clamp_min(LOG_FLOOR)
    fill_N = _at_most_the_kth(fill_N + lse_N, logits_NK)
    dense_NW = fill_N.to(dtype)[..., None].expand(*lead, width).contiguous()
    return dense_NW.scatter_(-1, ids_NK, logits_NK.to(dtype))


def _at_most_the_kth(fill_N: torch.Tensor, logits_NK: torch.Tensor) -> torch.Tensor:
    """The fill of each position kept at most its K-th logit: an id outside the top K is never
    above one in it. True of every encode (the rest's average probability is at most the K-th
    largest); quantised log-probs may land a hair below the average, and a loss that picks
    columns by their largest logit (P-KL's ``vocab_topk``) must not see a fill win there."""
    if logits_NK.shape[-1] == 0:
        return fill_N
    return torch.minimum(fill_N, logits_NK.amin(-1))


def decode_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a trainer decodes targets into on ``device``: bf16 on a GPU (the dtype of the
    logits a teacher on a GPU sends through the ring, so a run from targets holds the dense
    tensor at the size the ring's slot has, half an fp32 one: 1 GiB at 4096 positions of a
    129,280-id vocab), fp32 on the CPU (where the teacher's logits are fp32)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def topk_bytes_per_token(k: int, logprobs_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one teacher position's targets: K int32 ids, K log-probs, an fp32 rest and an
    fp32 log-partition."""
    return k * (4 + torch.empty((), dtype=logprobs_dtype).element_size()) + 8
