"""P-KL chunk terms: chunk mean of the projected rows, renormalization, KL, argmax agreement.

:class:`ProjectedChunkKL` is the whole student side of the fused P-KL loss as one autograd
Function: row logsumexp and projection (:mod:`xtoken_core.kernels.pkl_projection`), then every
chunk term over the valid chunks by one kernel; the backward is the chunk-term gradient, then
the projection backward.

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, K selected teacher
    columns, N valid chunks, E entries of ``M[:, idx]``, P ELL slots, S rows of M.

Per valid chunk n with rows ``r in n`` (``|n|`` of them), ``L = L_n`` the chunk-averaged teacher
log-probabilities and ``eps`` the probability floor (``xtoken_core.losses.modes.pkl.PROB_EPS``):

* ``q_n = sum_r q_r / |n|``, ``tot = sum_k q_n[k]``, ``c = max(tot, eps)``, ``u = q_n / c``,
  ``p = max(u, eps)``;
* forward KL ``kl_n = sum_k e^L (L - log p)``; reverse ``kl_n = sum_k u (log p - L)``;
* ``correct_n = [argmax_k q_n == argmax_k L]`` (first index of the max, like ``torch.argmax``).

Backward of ``kd = T^2 sum_n kl_n`` with ``g_k = d kl_n / d u_k`` (forward KL:
``-e^L / p`` where ``u >= eps``, else 0; reverse: ``log p - L + [u >= eps]``) and
``gu = sum_k g_k u_k``: ``d kl_n / d q_n[k] = (g_k - [tot >= eps] gu) / c``, and every row of the
chunk gets ``d kd / d q_r = T^2 (d kl_n / d q_n) / |n|``. The backward kernel also returns
``dot_r = sum_k dq_r[k] q_r[k]``, the softmax correction of the projection backward.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ._utils import MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, tl
from .logit_rows import KERNEL_CONFIG, block_for, row_logsumexp
from .pkl_projection import project_rows_backward, project_rows_forward

logger = logging.getLogger(__name__)

__all__ = [
    "ChunkKLSaved",
    "ProjectedChunkKL",
    "chunk_kl_backward",
    "chunk_kl_forward",
    "projected_chunk_kl_backward",
    "projected_chunk_kl_forward",
]

if tl is not None:

    @lazy_jit(
        do_not_specialize_on_alignment=(
            "order_R_ptr",
            "offsets_N1_ptr",
            "num_valid_ptr",
            "out_N4_ptr",
            "stats_N2_ptr",
        ),
    )
    def _chunk_kl_fwd_kernel(
        q_RK_ptr,
        order_R_ptr,
        offsets_N1_ptr,
        lp_NK_ptr,
        num_valid_ptr,
        qc_NK_ptr,
        out_N4_ptr,
        stats_N2_ptr,
        K,
        q_stride,
        lp_stride,
        qc_stride,
        t2,
        eps,
        REVERSE: tl.constexpr,
        DEVICE_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # One program per valid chunk n. Pass 1: q_n = (sum of its rows) / |n| (fixed row order),
        # stored for pass 2 and the backward, with tot and both argmaxes. Pass 2: the KL and gu.
        # With DEVICE_N the grid covers every chunk slot; programs n >= N (N read on the
        # device) only write a zero output row.
        n = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_N1_ptr + n)
        end = tl.load(offsets_N1_ptr + n + 1)
        if DEVICE_N:
            live = n < tl.load(num_valid_ptr)
            end = tl.where(live, end, start)
            K_run = tl.where(live, K, 0)
        else:
            live = n >= 0
            K_run = K
        size = tl.maximum(end - start, 1).to(tl.float32)
        offs = tl.arange(0, BLOCK_K)
        tot_lane = tl.full((BLOCK_K,), 0.0, tl.float32)
        best_q = tl.full([], float("-inf"), tl.float32)
        best_l = tl.full([], float("-inf"), tl.float32)
        arg_q = tl.full([], 0, tl.int64)
        arg_l = tl.full([], 0, tl.int64)
        for k0 in range(0, K_run, BLOCK_K):
            k = k0 + offs
            km = k < K
            acc = tl.full((BLOCK_K,), 0.0, tl.float32)
            for i in range(start, end):
                r = tl.load(order_R_ptr + i)
                acc += tl.load(q_RK_ptr + r * q_stride + k, mask=km, other=0.0)
            qc = acc / size
            tl.store(qc_NK_ptr + n * qc_stride + k, qc, mask=km)
            tot_lane += tl.where(km, qc, 0.0)
            lp = tl.load(lp_NK_ptr + n * lp_stride + k, mask=km, other=float("-inf"))
            # first index of the block max (as -max(-k) over the lanes equal to the max); a
            # block replaces the running argmax only when strictly larger: the first overall
            qm = tl.where(km, qc, float("-inf"))
            bq = tl.reduce(qm, 0, MAX_COMBINE)
            iq = -tl.reduce(tl.where(qm == bq, -k.to(tl.int64), -K), 0, MAX_COMBINE)
            arg_q = tl.where(bq > best_q, iq, arg_q)
            best_q = tl.maximum(best_q, bq)
            bl = tl.reduce(lp, 0, MAX_COMBINE)
            il = -tl.reduce(tl.where(lp == bl, -k.to(tl.int64), -K), 0, MAX_COMBINE)
            arg_l = tl.where(bl > best_l, il, arg_l)
            best_l = tl.maximum(best_l, bl)
        tl.debug_barrier()  # pass 2 reads q_n back (written by this program)
        tot = tl.reduce(tot_lane, 0, SUM_COMBINE)
        c = tl.maximum(tot, eps)
        kl_lane = tl.full((BLOCK_K,), 0.0, tl.float32)
        gu_lane = tl.full((BLOCK_K,), 0.0, tl.float32)
        for k0 in range(0, K_run, BLOCK_K):
            k = k0 + offs
            km = k < K
            qc = tl.load(qc_NK_ptr + n * qc_stride + k, mask=km, other=0.0)
            lp = tl.load(lp_NK_ptr + n * lp_stride + k, mask=km, other=0.0)
            u = qc / c
            p = tl.maximum(u, eps)
            logp = tl.log(p)
            if REVERSE:
                kl = u * (logp - lp)
                g = logp - lp + tl.where(u >= eps, 1.0, 0.0)
            else:
                a = tl.exp(lp)
                kl = a * (lp - logp)
                g = tl.where(u >= eps, -a / p, 0.0)
            kl_lane += tl.where(km, kl, 0.0)
            gu_lane += tl.where(km, g * u, 0.0)
        kl_n = tl.reduce(kl_lane, 0, SUM_COMBINE)
        one = live.to(tl.float32)
        tl.store(out_N4_ptr + n * 4, kl_n * t2)
        tl.store(out_N4_ptr + n * 4 + 1, 0.0)
        tl.store(out_N4_ptr + n * 4 + 2, (arg_q == arg_l).to(tl.float32) * one)
        tl.store(out_N4_ptr + n * 4 + 3, one)
        tl.store(stats_N2_ptr + n * 2, tot)
        tl.store(stats_N2_ptr + n * 2 + 1, tl.reduce(gu_lane, 0, SUM_COMBINE))

    @lazy_jit(
        do_not_specialize=("R", "dq_stride_k"),  # dq is [K, R] memory: stride R
        do_not_specialize_on_alignment=(
            "nidx_R_ptr",
            "offsets_N1_ptr",
            "stats_N2_ptr",
            "grad_ptr",
            "dot_R_ptr",
        ),
    )
    def _chunk_kl_bwd_kernel(
        q_RK_ptr,
        nidx_R_ptr,
        offsets_N1_ptr,
        lp_NK_ptr,
        qc_NK_ptr,
        stats_N2_ptr,
        grad_ptr,
        dq_ptr,
        dot_R_ptr,
        R,
        K,
        q_stride,
        lp_stride,
        qc_stride,
        dq_stride_r,
        dq_stride_k,
        t2,
        eps,
        REVERSE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program per block of rows, all K columns (so dot_r is complete here). Rows of no valid
        # chunk get dq = 0, dot = 0. dq may be stored transposed (strides are free): the
        # projection backward gathers dq[n, j] for a block of rows at once.
        #   dq_r[k] = grad * T^2 / |n| * (g_k - [tot >= eps] gu) / c
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < R
        r64 = r.to(tl.int64)
        n = tl.load(nidx_R_ptr + r, mask=rm, other=-1).to(tl.int64)
        used = n >= 0
        nn = tl.maximum(n, 0)
        size = tl.load(offsets_N1_ptr + nn + 1, mask=used, other=1) - tl.load(
            offsets_N1_ptr + nn, mask=used, other=0
        )
        grad = tl.load(grad_ptr)
        coef = tl.where(used, grad * t2 / tl.maximum(size, 1).to(tl.float32), 0.0)
        tot = tl.load(stats_N2_ptr + nn * 2, mask=used, other=1.0)
        gu = tl.load(stats_N2_ptr + nn * 2 + 1, mask=used, other=0.0)
        c = tl.maximum(tot, eps)
        gu = tl.where(tot >= eps, gu, 0.0)
        dot = tl.full((BLOCK_R,), 0.0, tl.float32)
        offs = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            km = k < K
            m2 = used[:, None] & km[None, :]
            qc = tl.load(qc_NK_ptr + nn[:, None] * qc_stride + k[None, :], mask=m2, other=0.0)
            lp = tl.load(lp_NK_ptr + nn[:, None] * lp_stride + k[None, :], mask=m2, other=0.0)
            u = qc / c[:, None]
            p = tl.maximum(u, eps)
            if REVERSE:
                g = tl.log(p) - lp + tl.where(u >= eps, 1.0, 0.0)
            else:
                g = tl.where(u >= eps, -tl.exp(lp) / p, 0.0)
            d = tl.where(m2, (g - gu[:, None]) / c[:, None] * coef[:, None], 0.0)
            q = tl.load(q_RK_ptr + r64[:, None] * q_stride + k[None, :], mask=m2, other=0.0)
            dot += tl.reduce(d * q, 1, SUM_COMBINE)
            tl.store(
                dq_ptr + r64[:, None] * dq_stride_r + k[None, :] * dq_stride_k,
                d,
                mask=rm[:, None] & km[None, :],
            )
        tl.store(dot_R_ptr + r, dot, mask=rm)


# --------------------------------------------------------------------------- host wrappers


def chunk_kl_forward(
    q_RK: torch.Tensor,
    order_R: torch.Tensor,
    offsets_N1: torch.Tensor,
    lp_NK: torch.Tensor,
    temperature: float,
    reverse_kl: bool,
    eps: float,
    num_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every P-KL chunk term of each valid chunk (module docstring has the math).

    Args:
        q_RK: [R, K] fp32 projected probabilities of every row (last dim contiguous).
        order_R: [R] int64 rows sorted by valid chunk.
        offsets_N1: [N + 1] int64, rows of chunk n are ``order[offsets[n]:offsets[n + 1]]``.
        lp_NK: [N, K] fp32 chunk-averaged teacher log-probabilities (last dim contiguous).
        temperature: T (the KL is scaled by T**2).
        reverse_kl: reverse KL.
        eps: probability floor before a log.
        num_valid: int64 device tensor holding N when ``offsets_N1`` covers more slots than
            there are valid chunks (their output rows are 0); None: N = ``lp_NK.shape[0]``.

    Returns:
        ``(out_N4, qc_NK, stats_N2)``: per chunk ``(T^2 kl_n, 0, correct_n, 1)`` (sum over
        chunks: kd, l1, correct, num_valid), the chunk means ``q_n`` and ``(tot_n, gu_n)`` for
        :func:`chunk_kl_backward`.
    """
    N, K = lp_NK.shape
    device = q_RK.device
    out_N4 = torch.empty((N, 4), device=device, dtype=torch.float32)
    qc_NK = torch.empty((N, K), device=device, dtype=torch.float32)
    stats_N2 = torch.empty((N, 2), device=device, dtype=torch.float32)
    if N == 0:
        return out_N4, qc_NK, stats_N2
    _chunk_kl_fwd_kernel[(N,)](
        q_RK,
        order_R,
        offsets_N1,
        lp_NK,
        num_valid if num_valid is not None else offsets_N1,
        qc_NK,
        out_N4,
        stats_N2,
        K,
        q_RK.stride(0),
        lp_NK.stride(0),
        qc_NK.stride(0),
        float(temperature) ** 2,
        float(eps),
        REVERSE=bool(reverse_kl),
        DEVICE_N=num_valid is not None,
        BLOCK_K=block_for("klf_block_k", K, 16),
        num_warps=KERNEL_CONFIG["klf_warps"],
    )
    return out_N4, qc_NK, stats_N2


def chunk_kl_backward(
    grad: torch.Tensor,
    q_RK: torch.Tensor,
    nidx_R: torch.Tensor,
    offsets_N1: torch.Tensor,
    lp_NK: torch.Tensor,
    qc_NK: torch.Tensor,
    stats_N2: torch.Tensor,
    temperature: float,
    reverse_kl: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of ``kd`` w.r.t. every row's q, and ``dot_r = sum_k dq_r q_r``.

    Args:
        grad: fp32 tensor whose first element is ``d loss / d kd`` (read on the device).
        q_RK: [R, K] fp32 rows of the forward.
        nidx_R: [R] int64 valid-chunk index of each row, -1 = none.
        offsets_N1: [N + 1] int64 chunk row offsets (sizes ``offsets[n + 1] - offsets[n]``).
        lp_NK: [N, K] fp32 teacher chunk log-probabilities.
        qc_NK: [N, K] fp32 chunk means from :func:`chunk_kl_forward`.
        stats_N2: [N, 2] fp32 ``(tot, gu)`` from :func:`chunk_kl_forward`.
        temperature: T.
        reverse_kl: reverse KL.
        eps: probability floor.

    Returns:
        ``(dq_RK, dot_R)`` fp32; ``dq_RK`` is stored column-major (``[K, R]`` memory, an
        ``[R, K]`` view): the projection backward gathers its columns.
    """
    R, K = q_RK.shape
    device = q_RK.device
    dq_RK = torch.empty((K, R), device=device, dtype=torch.float32).t()
    dot_R = torch.empty(R, device=device, dtype=torch.float32)
    if R == 0:
        return dq_RK, dot_R
    block_r = block_for("klb_block_r", R, 1)
    _chunk_kl_bwd_kernel[(cdiv(R, block_r),)](
        q_RK,
        nidx_R,
        offsets_N1,
        lp_NK,
        qc_NK,
        stats_N2,
        grad,
        dq_RK,
        dot_R,
        R,
        K,
        q_RK.stride(0),
        lp_NK.stride(0),
        qc_NK.stride(0),
        dq_RK.stride(0),
        dq_RK.stride(1),
        float(temperature) ** 2,
        float(eps),
        REVERSE=bool(reverse_kl),
        BLOCK_R=block_r,
        BLOCK_K=block_for("klb_block_k", K, 16),
        num_warps=KERNEL_CONFIG["klb_warps"],
    )
    return dq_RK, dot_R


# --------------------------------------------------------------------------- autograd


class ChunkKLSaved(NamedTuple):
    """What the backward of :func:`projected_chunk_kl_forward` reads (all on the logits' device)."""

    nidx_R: torch.Tensor
    offsets_N1: torch.Tensor
    lp_NK: torch.Tensor
    lse_R: torch.Tensor
    q_RK: torch.Tensor
    qc_NK: torch.Tensor
    stats_N2: torch.Tensor
    ell_j_PS: torch.Tensor
    ell_w_PS: torch.Tensor
    ell_n_S: torch.Tensor


def projected_chunk_kl_forward(
    z_BTV,
    nidx_R,
    order_R,
    offsets_N1,
    lp_NK,
    ptr_K1,
    rows_E,
    cols_E,
    w_E,
    ell_j_PS,
    ell_w_PS,
    ell_n_S,
    temperature,
    reverse_kl,
    eps,
    num_valid=None,
) -> tuple[torch.Tensor, ChunkKLSaved]:
    """The forward of :class:`ProjectedChunkKL` without autograd (no host sync).

    Args: as :class:`ProjectedChunkKL` (``z_BTV`` last dim contiguous).

    Returns:
        ``(sums_4, saved)``: the fp32 sums ``(kd, l1 = 0, correct, num_valid)`` over the chunks
        and the tensors :func:`projected_chunk_kl_backward` needs.
    """
    lse_R = row_logsumexp(z_BTV, nidx_R, temperature)
    q_RK = project_rows_forward(z_BTV, lse_R, ptr_K1, rows_E, cols_E, w_E, temperature)
    out_N4, qc_NK, stats_N2 = chunk_kl_forward(
        q_RK, order_R, offsets_N1, lp_NK, temperature, reverse_kl, eps, num_valid
    )
    saved = ChunkKLSaved(
        nidx_R, offsets_N1, lp_NK, lse_R, q_RK, qc_NK, stats_N2, ell_j_PS, ell_w_PS, ell_n_S
    )
    return out_N4.sum(0), saved


def projected_chunk_kl_backward(
    grad: torch.Tensor,
    z_BTV: torch.Tensor,
    saved: ChunkKLSaved,
    temperature: float,
    reverse_kl: bool,
    eps: float,
) -> torch.Tensor:
    """``d loss / d z`` of the KD sum of :func:`projected_chunk_kl_forward`.

    Args:
        grad: fp32 tensor whose first element is ``d loss / d kd`` (read on the device).
        z_BTV: the forward's logits.
        saved: the forward's :class:`ChunkKLSaved`.
        temperature: T.
        reverse_kl: reverse KL.
        eps: probability floor.

    Returns:
        dz_BTV in the logits dtype, contiguous.
    """
    dq_RK, dot_R = chunk_kl_backward(
        grad,
        saved.q_RK,
        saved.nidx_R,
        saved.offsets_N1,
        saved.lp_NK,
        saved.qc_NK,
        saved.stats_N2,
        temperature,
        reverse_kl,
        eps,
    )
    return project_rows_backward(
        z_BTV,
        saved.lse_R,
        dq_RK,
        dot_R,
        saved.ell_j_PS,
        saved.ell_w_PS,
        saved.ell_n_S,
        temperature,
    )


class ProjectedChunkKL(torch.autograd.Function):
    """Sums of the P-KL chunk terms from the student logits, differentiable w.r.t. them.

    ``apply(z_BTV, nidx_R, order_R, offsets_N1, lp_NK, ptr_K1, rows_E, cols_E, w_E, ell_j_PS,
    ell_w_PS, ell_n_S, temperature, reverse_kl, eps, num_valid=None)`` returns
    ``(kd, metrics_3)``: the scalar KD sum over the valid chunks (its gradient flows to
    ``z_BTV``) and the [3] fp32 sums ``(l1 = 0, correct, num_valid)`` (no gradient).
    The projection tables are those of
    :func:`xtoken_core.kernels.pkl_projection.restrict_tables`; the rows are the student side's
    valid-chunk rows (index, order, offsets); ``num_valid`` is a device N when the offsets cover
    more slots than valid chunks (:func:`chunk_kl_forward`).
    """

    @staticmethod
    def forward(ctx, z_BTV, *args):
        sums_4, saved = projected_chunk_kl_forward(z_BTV, *args)
        ctx.save_for_backward(z_BTV, *saved)
        temperature, reverse_kl, eps = args[11:14]
        ctx.opts = (float(temperature), bool(reverse_kl), float(eps))
        ctx.num_args = 1 + len(args)
        ctx.set_materialize_grads(False)  # the metrics get no gradient: no zeros for it
        metrics_3 = sums_4[1:]
        ctx.mark_non_differentiable(metrics_3)
        return sums_4[0], metrics_3

    @staticmethod
    def backward(ctx, grad_kd, grad_metrics):
        z_BTV, *saved = ctx.saved_tensors
        if grad_kd is None:
            return (None,) * ctx.num_args
        grad = grad_kd.to(torch.float32).reshape(1)
        dz_BTV = projected_chunk_kl_backward(grad, z_BTV, ChunkKLSaved(*saved), *ctx.opts)
        return (dz_BTV,) + (None,) * (ctx.num_args - 1)
