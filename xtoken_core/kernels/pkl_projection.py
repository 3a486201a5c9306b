"""Fused P-KL projection: ``q = softmax(z / T) @ M[:, idx]`` from the logits, forward and backward
kernels (the autograd Function is :class:`~xtoken_core.kernels.pkl_chunk_kl.ProjectedChunkKL`).

The projection ``M[S, W]`` is held twice (:class:`ProjectionTables`, built once per matrix): as
a CSC list for the forward gathers and as an ELL table for the backward gathers, so that no
``[B, T, V]`` probability tensor is ever materialized. Block sizes come from
:data:`xtoken_core.kernels.logit_rows.KERNEL_CONFIG`.

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, W teacher vocabulary
    (columns of M), S student vocabulary (rows of M), K selected teacher columns, E entries of
    M, P entries per row of M (ELL width).

* forward: ``q[r, j] = sum_{e in col j} p[r, s_e] * w_e`` (CSC of ``M[:, idx]``), done
  as ``p_tile [rows, entries] @ onehot_w [entries, columns]`` per tile (fp32, "ieee").
* backward: ``dz[r, s] = (1/T) p[r, s] (dp[r, s] - dot_r)`` with
  ``dp[r, s] = sum_k dq[r, j_ks] w_ks`` (slot-major ELL of ``M[:, idx]``) and ``dot_r = sum_j dq q``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ._utils import LOG2E, MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, next_power_of_2, tl
from .logit_rows import KERNEL_CONFIG, block_for

logger = logging.getLogger(__name__)

__all__ = [
    "ProjectionTables",
    "project_rows_backward",
    "project_rows_forward",
    "build_projection_tables",
    "restrict_tables",
]


if tl is not None:

    @lazy_jit(
        do_not_specialize=("R", "T"),
        do_not_specialize_on_alignment=(
            "lse_R_ptr",
            "ptr_K1_ptr",
            "rows_E_ptr",
            "cols_E_ptr",
            "w_E_ptr",
        ),
    )
    def _proj_fwd_kernel(
        z_ptr,
        lse_R_ptr,
        ptr_K1_ptr,
        rows_E_ptr,
        cols_E_ptr,
        w_E_ptr,
        q_ptr,
        R,
        T,
        K,
        num_jb,
        stride_b,
        stride_t,
        q_stride,
        scale2,
        BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        # Program (row block, column block); column blocks vary fastest so that the programs in
        # flight share one row block (kept in L2). Entries of columns [j0, j0 + BLOCK_J) are
        # contiguous in the CSC list; each tile of BLOCK_E entries does
        #   acc[n, j] += sum_e p[n, s_e] * (w_e if col_e == j else 0)      (fp32 dot, "ieee")
        pid = tl.program_id(0)
        nb = pid // num_jb
        jb = pid % num_jb
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < R
        n64 = n.to(tl.int64)
        rows = z_ptr + (n64 // T) * stride_b + (n64 % T) * stride_t
        lse2 = tl.load(lse_R_ptr + n, mask=nm, other=float("inf")) * 1.4426950408889634
        j0 = jb * BLOCK_J
        jj = tl.arange(0, BLOCK_J)
        e_start = tl.load(ptr_K1_ptr + j0)
        e_end = tl.load(ptr_K1_ptr + tl.minimum(j0 + BLOCK_J, K))
        offs_e = tl.arange(0, BLOCK_E)
        acc = tl.full((BLOCK_N, BLOCK_J), 0.0, tl.float32)
        for e0 in range(e_start, e_end, BLOCK_E):
            e = e0 + offs_e
            em = e < e_end
            s = tl.load(rows_E_ptr + e, mask=em, other=0).to(tl.int64)
            w = tl.load(w_E_ptr + e, mask=em, other=0.0)
            c = tl.load(cols_E_ptr + e, mask=em, other=-1) - j0
            mask = nm[:, None] & em[None, :]
            z = tl.load(rows[:, None] + s[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.where(mask, tl.exp2(z * scale2 - lse2[:, None]), 0.0)
            onehot = tl.where(c[:, None] == jj[None, :], w[:, None], 0.0)
            acc += tl.dot(p, onehot, input_precision="ieee")
        j = j0 + jj
        tl.store(
            q_ptr + n64[:, None] * q_stride + j[None, :],
            acc,
            mask=nm[:, None] & (j[None, :] < K),
        )

    @lazy_jit
    def _restrict_ell_kernel(
        idx_K_ptr,
        col_count_W_ptr,
        ell_t_SP_ptr,
        ell_w_SP_ptr,
        ptr_K1_ptr,
        ell_j_PS_ptr,
        ell_w_PS_ptr,
        ell_n_S_ptr,
        K,
        S,
        P: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program 0: CSC pointers of the selected columns, ptr[0] = 0,
        # ptr[j + 1] = sum_{i <= j} count[idx[i]] (running scan).
        # Programs 1..: a block of rows s of M each. An entry with teacher id t is kept when t
        # is selected; its column j is found by binary search in the ascending idx (no [W]
        # position map to fill). Kept entries go slot-major to the low slots in their original
        # order; the other slots get j = -1, w = 0; each row's count of kept entries goes to
        # ell_n (the backward kernel visits a vocab block's slots up to its largest count).
        pid = tl.program_id(0)
        if pid == 0:
            offs_k = tl.arange(0, BLOCK_K)
            tl.store(ptr_K1_ptr, tl.full([], 0, tl.int64))
            run = tl.full([], 0, tl.int64)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                km = k < K
                t = tl.load(idx_K_ptr + k, mask=km, other=0)
                cnt = tl.load(col_count_W_ptr + t, mask=km, other=0).to(tl.int64)
                tl.store(
                    ptr_K1_ptr + 1 + k, run + tl.associative_scan(cnt, 0, SUM_COMBINE), mask=km
                )
                run += tl.reduce(cnt, 0, SUM_COMBINE)
        else:
            s = (pid - 1) * BLOCK_S + tl.arange(0, BLOCK_S)
            sm = s < S
            s64 = s.to(tl.int64)
            cnt = tl.full((BLOCK_S,), 0, tl.int64)
            for k in range(0, P):
                t = tl.load(ell_t_SP_ptr + s64 * P + k, mask=sm, other=-1).to(tl.int64)
                w = tl.load(ell_w_SP_ptr + s64 * P + k, mask=sm, other=0.0)
                lo = tl.full((BLOCK_S,), 0, tl.int64)  # first i with idx[i] >= t
                hi = tl.full((BLOCK_S,), 0, tl.int64) + K
                for _ in tl.static_range(SEARCH_STEPS):
                    open_ = lo < hi
                    mid = (lo + hi) // 2
                    v = tl.load(idx_K_ptr + mid, mask=open_, other=0)
                    right = open_ & (v < t)
                    lo = tl.where(right, mid + 1, lo)
                    hi = tl.where(open_ & ~right, mid, hi)
                hit = tl.load(idx_K_ptr + lo, mask=sm & (t >= 0) & (lo < K), other=-1)
                keep = sm & (t >= 0) & (hit == t)
                tl.store(ell_j_PS_ptr + cnt * S + s64, lo.to(tl.int32), mask=keep)
                tl.store(ell_w_PS_ptr + cnt * S + s64, w, mask=keep)
                cnt += keep.to(tl.int64)
            tl.store(ell_n_S_ptr + s64, cnt.to(tl.int32), mask=sm)
            for k in range(0, P):
                fill = sm & (cnt <= k)
                tl.store(ell_j_PS_ptr + k * S + s64, tl.full((BLOCK_S,), -1, tl.int32), mask=fill)
                tl.store(
                    ell_w_PS_ptr + k * S + s64, tl.full((BLOCK_S,), 0.0, tl.float32), mask=fill
                )

    @lazy_jit
    def _restrict_csc_kernel(
        idx_K_ptr,
        col_ptr_W1_ptr,
        ptr_K1_ptr,
        src_rows_ptr,
        src_w_ptr,
        rows_E_ptr,
        cols_E_ptr,
        w_E_ptr,
        BLOCK: tl.constexpr,
    ):
        # One program per selected column j (teacher id t = idx[j]): copy the CSC entries of
        # column t of M to ptr[j]:ptr[j + 1] of the restricted lists.
        j = tl.program_id(0)
        t = tl.load(idx_K_ptr + j)
        s0 = tl.load(col_ptr_W1_ptr + t)
        cnt = tl.load(col_ptr_W1_ptr + t + 1) - s0
        d0 = tl.load(ptr_K1_ptr + j)
        offs = tl.arange(0, BLOCK)
        for e0 in range(0, cnt, BLOCK):
            e = e0 + offs
            em = e < cnt
            rows = tl.load(src_rows_ptr + s0 + e, mask=em, other=0)
            w = tl.load(src_w_ptr + s0 + e, mask=em, other=0.0)
            tl.store(rows_E_ptr + d0 + e, rows, mask=em)
            tl.store(w_E_ptr + d0 + e, w, mask=em)
            tl.store(cols_E_ptr + d0 + e, tl.full((BLOCK,), 0, tl.int32) + j, mask=em)

    @lazy_jit(
        do_not_specialize=("R", "T", "dq_stride_j"),  # dq is [K, R] memory: stride R
        do_not_specialize_on_alignment=(
            "lse_R_ptr",
            "dot_R_ptr",
            "ce_lse_R_ptr",
            "ce_target_R_ptr",
            "ce_g_ptr",
        ),
    )
    def _proj_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        dq_ptr,
        dot_R_ptr,
        ell_j_PS_ptr,
        ell_w_PS_ptr,
        ell_n_S_ptr,
        ce_lse_R_ptr,
        ce_target_R_ptr,
        ce_g_ptr,
        dz_ptr,
        R,
        T,
        V,
        S,
        num_vb,
        stride_b,
        stride_t,
        dq_stride_n,
        dq_stride_j,
        scale2,
        inv_temp,
        HAS_CE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Program (row block, vocab block), vocab blocks fastest (the row block's dq rows stay
        # in L2); with dq stored column-major one gather of column j reads the block's rows from
        # one or two sectors instead of BLOCK_N. ELL slots are packed to the front of each row
        # of M, so the block's largest kept count (one load with the logits, one reduction)
        # bounds the slots it visits: no load, reduction and branch per empty slot, whose
        # latencies, one after the other, were most of this kernel's time.
        #   dp[n, s] = sum_k dq[n, j_ks] w_ks;   dz[n, s] = p[n, s] (dp[n, s] - dot_n) / T
        # With HAS_CE the student CE's gradient of the same logits is added in the same pass
        # (one read of z and one write of dz, where the two kernels and the sum of their
        # gradients read or write an [R, V] tensor seven times):
        #   dz[n, v] += g_ce (exp(z[n, v] - lse1_n) - [v == y_n])   on counted rows (y_n >= 0)
        pid = tl.program_id(0)
        nb = pid // num_vb
        vb = pid % num_vb
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < R
        n64 = n.to(tl.int64)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = v < V
        sm = v < S
        mask = nm[:, None] & vm[None, :]
        rows = z_ptr + (n64 // T) * stride_b + (n64 % T) * stride_t
        z = tl.load(rows[:, None] + v[None, :], mask=mask, other=0.0).to(tl.float32)
        slots = tl.reduce(tl.load(ell_n_S_ptr + v, mask=sm, other=0), 0, MAX_COMBINE)
        lse2 = tl.load(lse_R_ptr + n, mask=nm, other=float("inf")) * 1.4426950408889634
        p = tl.exp2(z * scale2 - lse2[:, None])
        dq_rows = dq_ptr + n64 * dq_stride_n
        dp = tl.full((BLOCK_N, BLOCK_V), 0.0, tl.float32)
        for k in range(0, slots):
            j = tl.load(ell_j_PS_ptr + k * S + v, mask=sm, other=-1)
            w = tl.load(ell_w_PS_ptr + k * S + v, mask=sm, other=0.0)
            g = tl.load(
                dq_rows[:, None] + j.to(tl.int64)[None, :] * dq_stride_j,
                mask=nm[:, None] & (j >= 0)[None, :],
                other=0.0,
            )
            dp += g * w[None, :]
        dot = tl.load(dot_R_ptr + n, mask=nm, other=0.0)
        dz = p * (dp - dot[:, None]) * inv_temp
        if HAS_CE:
            y = tl.load(ce_target_R_ptr + n, mask=nm, other=-1)
            lse1 = tl.load(ce_lse_R_ptr + n, mask=nm & (y >= 0), other=float("inf"))
            g_ce = tl.load(ce_g_ptr).to(tl.float32)
            p1 = tl.exp2(z * 1.4426950408889634 - (lse1 * 1.4426950408889634)[:, None])
            hit = tl.where(v[None, :] == y[:, None], 1.0, 0.0)
            dz += tl.where((y >= 0)[:, None], g_ce * (p1 - hit), 0.0)
        tl.store(dz_ptr + n64[:, None] * V + v[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- host wrappers


def project_rows_forward(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    ptr_K1: torch.Tensor,
    rows_E: torch.Tensor,
    cols_E: torch.Tensor,
    w_E: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``q = softmax(z / T) @ M[:, idx]`` straight from the logits (no probability tensor).

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous.
        lse_R: [B*T] fp32 row logsumexp (``+inf`` rows give q = 0).
        ptr_K1: [K + 1] int64, entries of selected column j are ``ptr[j]:ptr[j + 1]``.
        rows_E: [E] int32 student rows of the entries (< V).
        cols_E: [E] int32 selected-column index j of each entry (non-decreasing).
        w_E: [E] fp32 weights.
        temperature: softmax temperature.

    Returns:
        q_RK fp32 [B*T, K].
    """
    B, T, V = z_BTV.shape
    R, K = B * T, ptr_K1.numel() - 1
    q_RK = torch.empty((R, K), device=z_BTV.device, dtype=torch.float32)
    if R == 0 or K == 0:
        return q_RK
    bn, bj = KERNEL_CONFIG["proj_block_n"], KERNEL_CONFIG["proj_block_j"]
    num_jb = cdiv(K, bj)
    _proj_fwd_kernel[(cdiv(R, bn) * num_jb,)](
        z_BTV,
        lse_R,
        ptr_K1,
        rows_E,
        cols_E,
        w_E,
        q_RK,
        R,
        T,
        K,
        num_jb,
        z_BTV.stride(0),
        z_BTV.stride(1),
        q_RK.stride(0),
        LOG2E / temperature,
        BLOCK_N=bn,
        BLOCK_E=KERNEL_CONFIG["proj_block_e"],
        BLOCK_J=bj,
        num_warps=KERNEL_CONFIG["proj_warps"],
    )
    return q_RK


def project_rows_backward(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    dq_RK: torch.Tensor,
    dot_R: torch.Tensor,
    ell_j_PS: torch.Tensor,
    ell_w_PS: torch.Tensor,
    ell_n_S: torch.Tensor,
    temperature: float,
    ce: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gradient of :func:`project_rows_forward` w.r.t. the logits, in the logits dtype; with
    ``ce``, plus the student CE's gradient of the same logits, in the same pass.

    Args:
        z_BTV: [B, T, V] logits.
        lse_R: [B*T] fp32 row logsumexp.
        dq_RK: [B*T, K] fp32 gradient of q, any strides (column-major gathers best).
        dot_R: [B*T] fp32 ``sum_j dq[r, j] q[r, j]``.
        ell_j_PS: [P, S] int32 (slot-major ELL) selected-column index of each row entry of M,
            -1 = none, entries packed to the low slots of each row (S <= V).
        ell_w_PS: [P, S] fp32 weights.
        ell_n_S: [S] int32 entries of each row (its slots ``0 .. n - 1`` hold them).
        temperature: softmax temperature.
        ce: ``(lse_R, target_R, g_1)`` of :func:`xtoken_core.kernels.row_ce.row_ce_backward`
            (fp32 row logsumexps at temperature 1, int32 targets with -1 on rows that do not
            count, the nll sum's fp32 [1] gradient, read on the device), or None.

    Returns:
        dz_BTV, contiguous, every element written.
    """
    B, T, V = z_BTV.shape
    R = B * T
    S = ell_j_PS.shape[1]
    dz_BTV = torch.empty((B, T, V), device=z_BTV.device, dtype=z_BTV.dtype)
    if R == 0 or V == 0:
        return dz_BTV
    bn = block_for("pbwd_block_n", R, 16)
    bv = block_for("pbwd_block_v", V, 16)
    num_vb = cdiv(V, bv)
    _proj_bwd_kernel[(cdiv(R, bn) * num_vb,)](
        z_BTV,
        lse_R,
        dq_RK,
        dot_R,
        ell_j_PS,
        ell_w_PS,
        ell_n_S,
        *(ce if ce is not None else (lse_R, ell_n_S, lse_R)),  # unread without HAS_CE
        dz_BTV,
        R,
        T,
        V,
        S,
        num_vb,
        z_BTV.stride(0),
        z_BTV.stride(1),
        dq_RK.stride(0),
        dq_RK.stride(1),
        LOG2E / temperature,
        1.0 / temperature,
        HAS_CE=ce is not None,
        BLOCK_N=bn,
        BLOCK_V=bv,
        num_warps=KERNEL_CONFIG["pbwd_warps"],
    )
    return dz_BTV


# --------------------------------------------------------------------------- tables + autograd


@dataclass(frozen=True)
class ProjectionTables:
    """M[S, W] as a CSC list (forward gathers) and an ELL table (backward gathers).

    Attributes:
        col_ptr_W1: int64 [W + 1], entries of teacher column t are ``col_ptr[t]:col_ptr[t + 1]``.
        col_rows_E: int32 [E] student rows, sorted by (t, s).
        col_w_E: fp32 [E] weights.
        ell_t_SP: int32 [S, P] teacher id of each row entry, -1 = none.
        ell_w_SP: fp32 [S, P] weights (0 where none).
        col_count_W: int64 [W] entries per teacher column.
        max_col_count: the largest entry count of a column (host int).
    """

    col_ptr_W1: torch.Tensor
    col_rows_E: torch.Tensor
    col_w_E: torch.Tensor
    ell_t_SP: torch.Tensor
    ell_w_SP: torch.Tensor
    col_count_W: torch.Tensor
    max_col_count: int


def build_projection_tables(projection_VW: torch.Tensor) -> ProjectionTables:
    """CSC + ELL tables of a sparse projection (build once per matrix: a
    :class:`xtoken_core.data.projection.Projection` keeps them).

    Args:
        projection_VW: sparse COO ``M[V, W]``.

    Returns:
        :class:`ProjectionTables` on the matrix's device.
    """
    M = projection_VW if projection_VW.is_coalesced() else projection_VW.coalesce()
    S, W = M.shape
    ind_2E, w_E = M.indices(), M.values().to(torch.float32)
    keep_E = w_E != 0
    s_E, t_E, w_E = ind_2E[0][keep_E], ind_2E[1][keep_E], w_E[keep_E]
    device = w_E.device
    counts_S = torch.bincount(s_E, minlength=S)
    P = max(int(counts_S.max()) if s_E.numel() else 0, 1)
    slot_E = torch.arange(s_E.numel(), device=device) - (torch.cumsum(counts_S, 0) - counts_S)[s_E]
    ell_t_SP = torch.full((S, P), -1, dtype=torch.int32, device=device)
    ell_w_SP = torch.zeros((S, P), dtype=torch.float32, device=device)
    ell_t_SP[s_E, slot_E] = t_E.to(torch.int32)
    ell_w_SP[s_E, slot_E] = w_E
    order_E = torch.argsort(t_E * S + s_E)
    col_t_E = t_E[order_E]
    col_ptr_W1 = torch.searchsorted(col_t_E, torch.arange(W + 1, device=device)).contiguous()
    col_count_W = (col_ptr_W1[1:] - col_ptr_W1[:-1]).contiguous()
    tables = ProjectionTables(
        col_ptr_W1=col_ptr_W1,
        col_rows_E=s_E[order_E].to(torch.int32).contiguous(),
        col_w_E=w_E[order_E].contiguous(),
        ell_t_SP=ell_t_SP,
        ell_w_SP=ell_w_SP,
        col_count_W=col_count_W,
        max_col_count=int(col_count_W.max()) if W else 0,
    )
    return tables


def restrict_tables(
    tables: ProjectionTables, idx_K: torch.Tensor
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """CSC lists and ELL column positions of ``M[:, idx]``, computed on the device (no host sync).

    The entry lists are sized for all E_M entries of M (the restricted count E is only known
    on the device); entries past ``ptr_K1[-1]`` are never read by the forward kernel.

    Args:
        tables: :class:`ProjectionTables` of ``M[S, W]`` on ``idx_K``'s device.
        idx_K: [K] int64 selected teacher columns, distinct and ascending.

    Returns:
        ``(ptr_K1, rows_E, cols_E, w_E, ell_j_PS, ell_w_PS, ell_n_S)``, the projection arguments of
        :class:`~xtoken_core.kernels.pkl_chunk_kl.ProjectedChunkKL` (the CSC lists go to
        :func:`project_rows_forward`, the ELL table to :func:`project_rows_backward`): CSC
        pointers [K + 1], student rows, selected-column index and weight of each entry ([E_M],
        valid up to ``ptr_K1[-1]``), and the slot-major ELL table [P, S] of selected-column
        positions (-1 = none, packed to the low slots) with its weights (0 where none) and the
        count of each row's entries (int32 [S]).
    """
    device = idx_K.device
    K = idx_K.numel()
    E_M = tables.col_rows_E.numel()
    S, P = tables.ell_t_SP.shape
    ptr_K1 = torch.empty(K + 1, dtype=torch.int64, device=device)
    rows_E = torch.empty(E_M, dtype=torch.int32, device=device)
    cols_E = torch.empty(E_M, dtype=torch.int32, device=device)
    w_E = torch.empty(E_M, dtype=torch.float32, device=device)
    ell_j_PS = torch.empty((P, S), dtype=torch.int32, device=device)
    ell_w_PS = torch.empty((P, S), dtype=torch.float32, device=device)
    ell_n_S = torch.empty(S, dtype=torch.int32, device=device)
    block_s = 256
    _restrict_ell_kernel[(1 + cdiv(S, block_s),)](
        idx_K,
        tables.col_count_W,
        tables.ell_t_SP,
        tables.ell_w_SP,
        ptr_K1,
        ell_j_PS,
        ell_w_PS,
        ell_n_S,
        K,
        S,
        P=P,
        SEARCH_STEPS=max(K.bit_length(), 1),
        BLOCK_S=block_s,
        BLOCK_K=1024,
    )
    if K > 0:
        _restrict_csc_kernel[(K,)](
            idx_K,
            tables.col_ptr_W1,
            ptr_K1,
            tables.col_rows_E,
            tables.col_w_E,
            rows_E,
            cols_E,
            w_E,
            BLOCK=max(min(next_power_of_2(tables.max_col_count), 128), 16),
        )
    return ptr_K1, rows_E, cols_E, w_E, ell_j_PS, ell_w_PS, ell_n_S
