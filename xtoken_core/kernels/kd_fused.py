"""Fused KD-loss kernels: row logsumexp, gathered chunk averages, P-KL projection and gold backward.

These kernels let the whole cross-tokenizer loss run from the bf16 logits plus one fp32 scalar
per row, never an fp32 ``[B, T, V]`` copy (see :mod:`xtoken_core.losses.fused` for how they are
composed, and DESIGN "Losses" for the math they implement).

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, N valid chunks,
    X gathered columns, W teacher vocabulary (columns of M), S student vocabulary (rows of M),
    K selected teacher columns (P-KL), E entries of M, P entries per row of M (ELL width),
    M top-m entries (gold uncommon L1), Q row splits (column max).

Per row ``r`` with ``x = z / temperature`` and ``lse_r = logsumexp_v x[r, v]``
(``p = exp(x - lse)``):

* ``lse``: online softmax in base 2, one ``exp2`` per element. Rows outside every valid chunk
  get ``lse = +inf`` so that every later ``p`` of theirs is exactly 0.
* chunk average over gathered columns: ``out[n, i] = mean_{r in n} (x[r, cols[i]] - lse_r)``.
* P-KL projection: ``q[r, j] = sum_{e in col j} p[r, s_e] * w_e`` (CSC of ``M[:, idx]``), done
  as ``p_tile [rows, entries] @ onehot_w [entries, columns]`` per tile (fp32, "ieee").
* P-KL backward: ``dz[r, s] = (1/T) p[r, s] (dp[r, s] - dot_r)`` with
  ``dp[r, s] = sum_k dq[r, j_ks] w_ks`` (slot-major ELL of ``M[:, idx]``) and ``dot_r = sum_j dq q``.
* gold backward: ``dz[r, v] = (G[n, v] - p[r, v] gsum_n) / (T n_size)`` where ``G`` is the
  chunk gradient kept as two compact blocks (common columns, uncommon columns).
"""

from __future__ import annotations

import logging

import torch

from ._utils import MAX_COMBINE, SUM_COMBINE, lazy_jit, next_power_of_2, tl, use_triton

logger = logging.getLogger(__name__)

__all__ = [
    "KERNEL_CONFIG",
    "chunk_mean_columns",
    "column_max",
    "gold_backward",
    "project_rows_backward",
    "project_rows_forward",
    "row_logsumexp",
    "use_triton",
]

_LOG2E = 1.4426950408889634

#: Block sizes and warps per kernel (GPU); small problems shrink the blocks to fit.
KERNEL_CONFIG = {
    "lse_block_v": 4096,
    "lse_warps": 8,
    "cols_block_x": 1024,
    "cols_warps": 4,
    "colmax_block_w": 1024,
    "colmax_rows": 64,
    "colmax_warps": 4,
    "proj_block_n": 32,
    "proj_block_e": 32,
    "proj_block_j": 32,
    "proj_warps": 4,
    "pbwd_block_n": 32,
    "pbwd_block_v": 256,
    "pbwd_warps": 8,
    "gbwd_block_v": 2048,
    "gbwd_warps": 4,
}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block(key: str, n: int, floor: int = 1) -> int:
    block = KERNEL_CONFIG[key]
    return max(min(block, next_power_of_2(n)), floor)


if tl is not None:

    @lazy_jit
    def _row_lse_kernel(
        z_ptr,
        nidx_R_ptr,
        lse_R_ptr,
        T,
        V,
        stride_b,
        stride_t,
        scale2,  # log2(e) / temperature
        BLOCK_V: tl.constexpr,
    ):
        # One program per row. m' = max(m, max x2); s' = s 2^(m - m') + sum 2^(x2 - m');
        # lse = (m + log2 s) ln 2. Rows of no valid chunk store +inf (then p = 0 downstream).
        r = tl.program_id(0).to(tl.int64)
        n = tl.load(nidx_R_ptr + r)
        if n >= 0:
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            offs = tl.arange(0, BLOCK_V)
            m = tl.full([], -1.0e30, tl.float32)
            s = tl.full([], 0.0, tl.float32)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                x2 = tl.load(row_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32) * scale2
                m_new = tl.maximum(m, tl.reduce(x2, 0, MAX_COMBINE))
                s = s * tl.exp2(m - m_new) + tl.reduce(tl.exp2(x2 - m_new), 0, SUM_COMBINE)
                m = m_new
            tl.store(lse_R_ptr + r, (m + tl.log2(s)) * 0.6931471805599453)
        else:
            tl.store(lse_R_ptr + r, float("inf"))

    @lazy_jit
    def _chunk_cols_kernel(
        z_ptr,
        lse_R_ptr,
        order_ptr,
        offsets_N1_ptr,
        cols_X_ptr,
        out_ptr,
        T,
        X,
        stride_b,
        stride_t,
        out_stride,
        inv_temp,
        HAS_COLS: tl.constexpr,
        BLOCK_X: tl.constexpr,
    ):
        # Program (chunk n, column block): rows of n are order[offsets[n]:offsets[n + 1]].
        #   out[n, i] = sum_{r in n} (z[r, col_i] / T - lse_r) / max(|n|, 1)   (fixed order)
        n = tl.program_id(0).to(tl.int64)
        xb = tl.program_id(1)
        i = xb * BLOCK_X + tl.arange(0, BLOCK_X)
        im = i < X
        if HAS_COLS:
            col = tl.load(cols_X_ptr + i, mask=im, other=0).to(tl.int64)
        else:
            col = i.to(tl.int64)
        start = tl.load(offsets_N1_ptr + n)
        end = tl.load(offsets_N1_ptr + n + 1)
        acc = tl.full((BLOCK_X,), 0.0, tl.float32)
        for k in range(start, end):
            r = tl.load(order_ptr + k)
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            z = tl.load(row_ptr + col, mask=im, other=0.0).to(tl.float32)
            acc += z * inv_temp - tl.load(lse_R_ptr + r)
        out = acc / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(out_ptr + n * out_stride + i, out, mask=im)

    @lazy_jit
    def _col_max_kernel(
        z_ptr,
        nidx_R_ptr,
        part_QW_ptr,
        R,
        T,
        W,
        rows_per_prog,
        stride_b,
        stride_t,
        BLOCK_W: tl.constexpr,
    ):
        # Program (column block, row split q): part[q, w] = max over the split's used rows of
        # z[r, w] (-inf when none). Max is exact in fp32 for bf16/fp16/fp32 inputs.
        wb = tl.program_id(0)
        q = tl.program_id(1)
        w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
        wm = w < W
        acc = tl.full((BLOCK_W,), float("-inf"), tl.float32)
        r0 = q * rows_per_prog
        r1 = tl.minimum(r0 + rows_per_prog, R)
        zero64 = tl.full([], 0, tl.int64)
        for r in range(r0, r1):
            if tl.load(nidx_R_ptr + r) >= 0:
                r64 = zero64 + r  # int64 pointer math (a loop index may be a plain int)
                row_ptr = z_ptr + (r64 // T) * stride_b + (r64 % T) * stride_t
                z = tl.load(row_ptr + w, mask=wm, other=float("-inf")).to(tl.float32)
                acc = tl.maximum(acc, z)
        tl.store(part_QW_ptr + q.to(tl.int64) * W + w, acc, mask=wm)

    @lazy_jit
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
    def _proj_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        dq_ptr,
        dot_R_ptr,
        ell_j_PS_ptr,
        ell_w_PS_ptr,
        dz_ptr,
        R,
        T,
        V,
        S,
        num_vb,
        stride_b,
        stride_t,
        dq_stride,
        scale2,
        inv_temp,
        P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Program (row block, vocab block), vocab blocks fastest (the row block's dq rows stay
        # in L2). ELL slots are packed to the front of each row of M, so a slot with no entry in
        # this vocab block ends the useful work; it is skipped without loading dq.
        #   dp[n, s] = sum_k dq[n, j_ks] w_ks;   dz[n, s] = p[n, s] (dp[n, s] - dot_n) / T
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
        lse2 = tl.load(lse_R_ptr + n, mask=nm, other=float("inf")) * 1.4426950408889634
        p = tl.exp2(z * scale2 - lse2[:, None])
        dq_rows = dq_ptr + n64 * dq_stride
        dp = tl.full((BLOCK_N, BLOCK_V), 0.0, tl.float32)
        for k in range(0, P):
            j = tl.load(ell_j_PS_ptr + k * S + v, mask=sm, other=-1)
            if tl.reduce(j, 0, MAX_COMBINE) >= 0:
                w = tl.load(ell_w_PS_ptr + k * S + v, mask=sm, other=0.0)
                g = tl.load(
                    dq_rows[:, None] + j[None, :], mask=nm[:, None] & (j >= 0)[None, :], other=0.0
                )
                dp += g * w[None, :]
        dot = tl.load(dot_R_ptr + n, mask=nm, other=0.0)
        dz = p * (dp - dot[:, None]) * inv_temp
        tl.store(dz_ptr + n64[:, None] * V + v[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)

    @lazy_jit
    def _gold_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        nidx_R_ptr,
        gc_ptr,
        gu_ptr,
        cpos_V_ptr,
        gsum_N_ptr,
        coef_N_ptr,
        gscale_ptr,
        dz_ptr,
        T,
        V,
        stride_b,
        stride_t,
        gc_stride,
        gu_stride,
        scale2,
        HAS_COMMON: tl.constexpr,
        HAS_UNCOMMON: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Program (row r, vocab block), n = chunk of r; c = cpos[v] says where v's chunk
        # gradient lives: c >= 0 common block, c <= -2 uncommon block at -c - 2, -1 nowhere.
        #   G = gscale[0] gc[n, c] + gscale[1] gu[n, -c - 2]
        #   dz[r, v] = (G - p[r, v] gsum[n]) coef[n]
        r = tl.program_id(0).to(tl.int64)
        vb = tl.program_id(1)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = v < V
        n = tl.load(nidx_R_ptr + r).to(tl.int64)
        out_ptr = dz_ptr + r * V + v
        if n >= 0:
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            z = tl.load(row_ptr + v, mask=vm, other=0.0).to(tl.float32)
            p = tl.exp2(z * scale2 - tl.load(lse_R_ptr + r) * 1.4426950408889634)
            c = tl.load(cpos_V_ptr + v, mask=vm, other=-1)
            g = tl.full((BLOCK_V,), 0.0, tl.float32)
            if HAS_COMMON:
                gc = tl.load(gc_ptr + n * gc_stride + c, mask=c >= 0, other=0.0)
                g += tl.load(gscale_ptr) * gc
            if HAS_UNCOMMON:
                gu = tl.load(gu_ptr + n * gu_stride + (-2 - c), mask=c <= -2, other=0.0)
                g += tl.load(gscale_ptr + 1) * gu
            dz = (g - p * tl.load(gsum_N_ptr + n)) * tl.load(coef_N_ptr + n)
            tl.store(out_ptr, dz.to(dz_ptr.dtype.element_ty), mask=vm)
        else:
            tl.store(
                out_ptr,
                tl.full((BLOCK_V,), 0.0, tl.float32).to(dz_ptr.dtype.element_ty),
                mask=vm,
            )


# --------------------------------------------------------------------------- host wrappers


def _check_rows(z_BTV: torch.Tensor, nidx_R: torch.Tensor) -> None:
    if z_BTV.dim() != 3 or z_BTV.stride(-1) != 1:
        raise ValueError(
            f"logits must be [B, T, V] with a contiguous last dim, got shape {tuple(z_BTV.shape)} "
            f"strides {z_BTV.stride()}: call .contiguous() first"
        )
    if nidx_R.numel() != z_BTV.shape[0] * z_BTV.shape[1]:
        raise ValueError(
            f"nidx_R has {nidx_R.numel()} entries for {z_BTV.shape[0]}x{z_BTV.shape[1]} rows: "
            "pass one chunk index per logits row"
        )


def row_logsumexp(z_BTV: torch.Tensor, nidx_R: torch.Tensor, temperature: float) -> torch.Tensor:
    """Row logsumexp of ``z / temperature`` for the rows that belong to a valid chunk.

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous (row strides are free).
        nidx_R: [B*T] int, valid-chunk index of each row, -1 = none.
        temperature: softmax temperature (> 0).

    Returns:
        lse_R fp32 [B*T]; ``+inf`` on rows with ``nidx_R < 0`` (their probabilities are 0).

    Raises:
        ValueError: bad layout or row count.
    """
    _check_rows(z_BTV, nidx_R)
    B, T, V = z_BTV.shape
    lse_R = torch.empty(B * T, device=z_BTV.device, dtype=torch.float32)
    if B * T == 0:
        return lse_R
    if V == 0:
        return lse_R.fill_(float("-inf"))
    _row_lse_kernel[(B * T,)](
        z_BTV,
        nidx_R,
        lse_R,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        _LOG2E / temperature,
        BLOCK_V=_block("lse_block_v", V, 16),
        num_warps=KERNEL_CONFIG["lse_warps"],
    )
    return lse_R


def chunk_mean_columns(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    order_R: torch.Tensor,
    offsets_N1: torch.Tensor,
    temperature: float,
    cols_X: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk-averaged log-probabilities over a gathered column subset, valid chunks only.

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous.
        lse_R: [B*T] fp32 row logsumexp of ``z / temperature``.
        order_R: [B*T] int64, rows sorted by valid chunk (rows of no chunk last).
        offsets_N1: [N + 1] int64, rows of chunk n are ``order[offsets[n]:offsets[n + 1]]``.
        temperature: softmax temperature.
        cols_X: [X] int column ids (None: all V columns in order).

    Returns:
        out_NX fp32 [N, X]: ``mean_{r in n} (z[r, cols] / T - lse_r)`` (0 for an empty chunk).
    """
    B, T, V = z_BTV.shape
    N = offsets_N1.numel() - 1
    X = V if cols_X is None else cols_X.numel()
    out_NX = torch.empty((N, X), device=z_BTV.device, dtype=torch.float32)
    if N == 0 or X == 0:
        return out_NX
    block = _block("cols_block_x", X, 16)
    _chunk_cols_kernel[(N, _cdiv(X, block))](
        z_BTV,
        lse_R,
        order_R,
        offsets_N1,
        cols_X if cols_X is not None else offsets_N1,
        out_NX,
        T,
        X,
        z_BTV.stride(0),
        z_BTV.stride(1),
        out_NX.stride(0),
        1.0 / temperature,
        HAS_COLS=cols_X is not None,
        BLOCK_X=block,
        num_warps=KERNEL_CONFIG["cols_warps"],
    )
    return out_NX


def column_max(z_BTW: torch.Tensor, nidx_R: torch.Tensor) -> torch.Tensor:
    """Per-column max of the logits over the rows with ``nidx_R >= 0``.

    Args:
        z_BTW: [B, T, W] logits, last dim contiguous.
        nidx_R: [B*T] int, rows with a negative entry are ignored.

    Returns:
        max_W fp32 [W] (-inf where no row is used), equal to the masked ``amax`` exactly.
    """
    _check_rows(z_BTW, nidx_R)
    B, T, W = z_BTW.shape
    R = B * T
    rows = KERNEL_CONFIG["colmax_rows"]
    Q = max(_cdiv(R, rows), 1)
    part_QW = torch.empty((Q, W), device=z_BTW.device, dtype=torch.float32)
    if R == 0 or W == 0:
        return part_QW.fill_(float("-inf")).amax(0)
    block = _block("colmax_block_w", W, 16)
    _col_max_kernel[(_cdiv(W, block), Q)](
        z_BTW,
        nidx_R,
        part_QW,
        R,
        T,
        W,
        rows,
        z_BTW.stride(0),
        z_BTW.stride(1),
        BLOCK_W=block,
        num_warps=KERNEL_CONFIG["colmax_warps"],
    )
    return part_QW.amax(0)


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
    num_jb = _cdiv(K, bj)
    _proj_fwd_kernel[(_cdiv(R, bn) * num_jb,)](
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
        _LOG2E / temperature,
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
    temperature: float,
) -> torch.Tensor:
    """Gradient of :func:`project_rows_forward` w.r.t. the logits, in the logits dtype.

    Args:
        z_BTV: [B, T, V] logits.
        lse_R: [B*T] fp32 row logsumexp.
        dq_RK: [B*T, K] fp32 gradient of q (last dim contiguous).
        dot_R: [B*T] fp32 ``sum_j dq[r, j] q[r, j]``.
        ell_j_PS: [P, S] int32 (slot-major ELL) selected-column index of each row entry of M,
            -1 = none, entries packed to the low slots of each row (S <= V).
        ell_w_PS: [P, S] fp32 weights.
        temperature: softmax temperature.

    Returns:
        dz_BTV, contiguous, every element written.
    """
    B, T, V = z_BTV.shape
    R = B * T
    P, S = ell_j_PS.shape
    dz_BTV = torch.empty((B, T, V), device=z_BTV.device, dtype=z_BTV.dtype)
    if R == 0 or V == 0:
        return dz_BTV
    if dq_RK.stride(-1) != 1:
        dq_RK = dq_RK.contiguous()
    bn = _block("pbwd_block_n", R, 16)
    bv = _block("pbwd_block_v", V, 16)
    num_vb = _cdiv(V, bv)
    _proj_bwd_kernel[(_cdiv(R, bn) * num_vb,)](
        z_BTV,
        lse_R,
        dq_RK,
        dot_R,
        ell_j_PS,
        ell_w_PS,
        dz_BTV,
        R,
        T,
        V,
        S,
        num_vb,
        z_BTV.stride(0),
        z_BTV.stride(1),
        dq_RK.stride(0),
        _LOG2E / temperature,
        1.0 / temperature,
        P=P,
        BLOCK_N=bn,
        BLOCK_V=bv,
        num_warps=KERNEL_CONFIG["pbwd_warps"],
    )
    return dz_BTV


def gold_backward(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    nidx_R: torch.Tensor,
    g_common_NC: torch.Tensor | None,
    g_uncommon_NU: torch.Tensor | None,
    cpos_V: torch.Tensor,
    gsum_N: torch.Tensor,
    coef_N: torch.Tensor,
    gscale_2: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logits gradient of a loss on chunk-averaged log-probs given as compact chunk gradients.

    The chunk gradient of chunk n at vocab id v is ``gscale[0] * g_common[n, c]`` when
    ``c = cpos[v] >= 0``, ``gscale[1] * g_uncommon[n, -c - 2]`` when ``c <= -2``, else 0.

    Args:
        z_BTV: [B, T, V] logits.
        lse_R: [B*T] fp32 row logsumexp.
        nidx_R: [B*T] int valid-chunk index per row, -1 = none (gradient 0).
        g_common_NC: [N, Mc] fp32, or None.
        g_uncommon_NU: [N, Mu] fp32, or None.
        cpos_V: [V] int32 position code (see above).
        gsum_N: [N] fp32, the total (scaled) chunk gradient of each chunk.
        coef_N: [N] fp32, ``1 / (temperature * chunk size)``.
        gscale_2: [2] fp32 scales of the common and uncommon parts (upstream gradients).
        temperature: softmax temperature.

    Returns:
        dz_BTV in the logits dtype, contiguous.
    """
    B, T, V = z_BTV.shape
    R = B * T
    dz_BTV = torch.empty((B, T, V), device=z_BTV.device, dtype=z_BTV.dtype)
    if R == 0 or V == 0:
        return dz_BTV
    has_c = g_common_NC is not None and g_common_NC.numel() > 0
    has_u = g_uncommon_NU is not None and g_uncommon_NU.numel() > 0
    bv = _block("gbwd_block_v", V, 16)
    _gold_bwd_kernel[(R, _cdiv(V, bv))](
        z_BTV,
        lse_R,
        nidx_R,
        g_common_NC if has_c else gsum_N,  # any valid pointer when absent
        g_uncommon_NU if has_u else gsum_N,
        cpos_V,
        gsum_N,
        coef_N,
        gscale_2,
        dz_BTV,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        g_common_NC.stride(0) if has_c else 0,
        g_uncommon_NU.stride(0) if has_u else 0,
        _LOG2E / temperature,
        HAS_COMMON=has_c,
        HAS_UNCOMMON=has_u,
        BLOCK_V=bv,
        num_warps=KERNEL_CONFIG["gbwd_warps"],
    )
    return dz_BTV
