"""Fused KD-loss row kernels: row logsumexp, gathered chunk averages, column max (shared config).

These kernels let the whole cross-tokenizer loss run from the bf16 logits plus one fp32 scalar
per row, never an fp32 ``[B, T, V]`` copy. The P-KL projection kernels live in
:mod:`xtoken_core.kernels.pkl_projection`, the gold backward in :mod:`xtoken_core.kernels.gold_student`; all
three read their block sizes from :data:`KERNEL_CONFIG` here. The modes' kernel paths
(:mod:`xtoken_core.losses.modes`) compose them (docs/design.md, "The loss math", has the math
they implement).

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, N valid chunks,
    X gathered columns, W teacher vocabulary (columns of M), S student vocabulary (rows of M),
    K selected teacher columns (P-KL), E entries of M, P entries per row of M (ELL width),
    M top-m entries (gold uncommon L1), Q row splits (column max).

Per row ``r`` with ``x = z / temperature`` and ``lse_r = logsumexp_v x[r, v]``
(``p = exp(x - lse)``):

* ``lse``: online softmax in base 2, one ``exp2`` per element. Rows outside every valid chunk
  get ``lse = +inf`` so that every later ``p`` of theirs is exactly 0.
* chunk average over gathered columns: ``out[n, i] = mean_{r in n} (x[r, cols[i]] - lse_r)``;
  with the lse over those columns only (P-KL teacher side).
* column max: ``max_W[w] = max_{r used} z[r, w]`` (P-KL teacher column selection).
* ascending ids: a set of distinct column ids (``torch.topk``'s indices) in ascending order,
  by a flag per column and a prefix sum (what ``torch.sort`` of the ids would give).
"""

from __future__ import annotations

import logging

import torch

from ._utils import (
    LOG2E,
    MAX_COMBINE,
    SUM_COMBINE,
    cdiv,
    lazy_jit,
    next_power_of_2,
    tl,
    use_triton,
)
from .topm_l1 import COARSE_BASE, COARSE_BINS, COARSE_SHIFT  # the bins of hist_NK

logger = logging.getLogger(__name__)

__all__ = [
    "KERNEL_CONFIG",
    "ascending_ids",
    "block_for",
    "check_rows",
    "chunk_mean_columns",
    "chunk_mean_log_softmax_columns",
    "column_max",
    "row_logsumexp",
    "use_triton",
]

#: Block sizes and warps per kernel (GPU), for this module, pkl_projection and gold_student; small problems
#: shrink the blocks to fit.
KERNEL_CONFIG = {
    "lse_block_v": 4096,
    "lse_warps": 8,
    "cols_block_x": 1024,
    "cols_warps": 4,
    "lsm_block_x": 2048,
    "lsm_warps": 4,
    "colmax_block_w": 1024,
    "colmax_rows": 64,
    "colmax_warps": 4,
    "ids_block": 4096,
    "ids_warps": 8,
    "proj_block_n": 32,
    "proj_block_e": 32,
    "proj_block_j": 32,
    "proj_warps": 4,
    "pbwd_block_n": 16,
    "pbwd_block_v": 512,
    "pbwd_warps": 4,
    "klf_block_k": 1024,
    "klf_warps": 4,
    "klb_block_r": 4,
    "klb_block_k": 256,
    "klb_warps": 4,
    "gbwd_block_v": 512,
    "gbwd_blocks": 16,
    "gbwd_warps": 4,
    "gcom_block_c": 256,
    "gcom_warps": 1,
}


def block_for(key: str, n: int, floor: int = 1) -> int:
    """Configured block size ``KERNEL_CONFIG[key]``, shrunk to the problem, at least ``floor``.

    Args:
        key: a :data:`KERNEL_CONFIG` key.
        n: the extent the block tiles.
        floor: the smallest block allowed (a power of two).

    Returns:
        ``max(min(config, next_power_of_2(n)), floor)``.
    """
    block = KERNEL_CONFIG[key]
    return max(min(block, next_power_of_2(n)), floor)


if tl is not None:

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=("nidx_R_ptr", "lse_R_ptr", "sum_R_ptr"),
    )
    def _row_lse_kernel(
        z_ptr,
        nidx_R_ptr,
        lse_R_ptr,
        sum_R_ptr,
        T,
        V,
        stride_b,
        stride_t,
        scale2,  # log2(e) / temperature
        ALL_ROWS: tl.constexpr,
        SUMS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row. m' = max(m, max x2); s' = s 2^(m - m') + sum 2^(x2 - m');
        # lse = (m + log2 s) ln 2. Rows of no valid chunk store +inf (then p = 0 downstream);
        # ALL_ROWS: every row is used. SUMS: also sum[r] = sum_v z[r, v] in fp32, every row
        # (NaN and inf propagate: the finite check of the logits, in the same read).
        r = tl.program_id(0).to(tl.int64)
        if ALL_ROWS:
            used = r >= 0
        else:
            used = tl.load(nidx_R_ptr + r) >= 0
        m = tl.full([], -1.0e30, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        total = tl.full([], 0.0, tl.float32)
        if used | SUMS:
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            offs = tl.arange(0, BLOCK_V)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                x = tl.load(row_ptr + v, mask=v < V, other=0.0).to(tl.float32)
                x2 = tl.where(v < V, x * scale2, float("-inf"))
                m_new = tl.maximum(m, tl.reduce(x2, 0, MAX_COMBINE))
                s = s * tl.exp2(m - m_new) + tl.reduce(tl.exp2(x2 - m_new), 0, SUM_COMBINE)
                m = m_new
                if SUMS:
                    total += tl.reduce(x, 0, SUM_COMBINE)
        if SUMS:
            tl.store(sum_R_ptr + r, total)
        if used:
            tl.store(lse_R_ptr + r, (m + tl.log2(s)) * 0.6931471805599453)
        else:
            tl.store(lse_R_ptr + r, float("inf"))

    # cols_X stays specialized on alignment: the gold loss's column tables are fixed per run
    # (the exact map's uncommon ids), and the aligned table saves ~8 % of the student's pass.
    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=("lse_R_ptr", "order_ptr", "offsets_N1_ptr", "hist_ptr"),
    )
    def _chunk_cols_kernel(
        z_ptr,
        lse_R_ptr,
        order_ptr,
        offsets_N1_ptr,
        cols_X_ptr,
        out_ptr,
        hist_ptr,
        T,
        X,
        stride_b,
        stride_t,
        out_stride,
        inv_temp,
        HAS_COLS: tl.constexpr,
        HIST: tl.constexpr,
        HIST_BINS: tl.constexpr,
        HIST_BASE: tl.constexpr,
        HIST_SHIFT: tl.constexpr,
        BLOCK_X: tl.constexpr,
    ):
        # Program (chunk n, column block): rows of n are order[offsets[n]:offsets[n + 1]].
        #   out[n, i] = sum_{r in n} (z[r, col_i] / T - lse_r) / max(|n|, 1)   (fixed order)
        # HIST: also add the block's values to the chunk's histogram, the K = HIST_BINS coarse
        # bins of kernels.topm_l1 (k = clamp((bits(-out) >> SHIFT) - BASE, 0, K - 2), K - 1 for
        # NaN); only the bins the block touches are added.
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
        if HIST:
            bits = tl.maximum((-out).to(tl.int32, bitcast=True), 0)
            bins = tl.minimum(tl.maximum((bits >> HIST_SHIFT) - HIST_BASE, 0), HIST_BINS - 2)
            h = tl.histogram(tl.where(out != out, HIST_BINS - 1, bins), HIST_BINS, mask=im)
            k = tl.arange(0, HIST_BINS)
            tl.atomic_add(hist_ptr + n * HIST_BINS + k, h, mask=h > 0, sem="relaxed")

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=(
            "order_ptr",
            "offsets_N1_ptr",
            "cols_X_ptr",
            "num_valid_ptr",
        ),
    )
    def _chunk_lsm_cols_kernel(
        z_ptr,
        order_ptr,
        offsets_N1_ptr,
        cols_X_ptr,
        num_valid_ptr,
        out_ptr,
        T,
        X,
        stride_b,
        stride_t,
        out_stride,
        scale2,  # log2(e) / temperature
        inv_temp,
        HAS_COLS: tl.constexpr,
        DEVICE_N: tl.constexpr,
        BLOCK_X: tl.constexpr,
    ):
        # Program per chunk n: the log-softmax over the gathered columns only, chunk-averaged,
        # with one gather of each row (the gathers touch every sector of a row: a second pass
        # would read the row again). mean_r (x_r - lse_r) = mean_r x_r - mean_r lse_r, so:
        #   per row r of n: out[n, :] += z[r, cols] / T (the row buffer stays in L2) while lse_r
        #   runs online (base 2); then out[n, :] = out[n, :] / |n| - sum_r lse_r / |n|.
        # With DEVICE_N the grid covers every chunk slot and programs n >= N (N read on the
        # device) do no work: the host never needs N.
        n = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_N1_ptr + n)
        end = tl.load(offsets_N1_ptr + n + 1)
        if DEVICE_N:
            live = n < tl.load(num_valid_ptr)
            end = tl.where(live, end, start)
            X_run = tl.where(live, X, 0)
        else:
            X_run = X
        offs = tl.arange(0, BLOCK_X)
        out_row = out_ptr + n * out_stride
        lse_sum = tl.full([], 0.0, tl.float32)
        for k in range(start, end):
            r = tl.load(order_ptr + k)
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            m = tl.full([], -1.0e30, tl.float32)
            s_lane = tl.full((BLOCK_X,), 0.0, tl.float32)
            for x0 in range(0, X_run, BLOCK_X):
                i = x0 + offs
                im = i < X
                if HAS_COLS:
                    col = tl.load(cols_X_ptr + i, mask=im, other=0).to(tl.int64)
                else:
                    col = i.to(tl.int64)
                z = tl.load(row_ptr + col, mask=im, other=float("-inf")).to(tl.float32)
                x2 = z * scale2
                m_new = tl.maximum(m, tl.reduce(x2, 0, MAX_COMBINE))
                s_lane = s_lane * tl.exp2(m - m_new) + tl.exp2(x2 - m_new)
                m = m_new
                prev = tl.load(out_row + i, mask=im & ((offs * 0 + k) > start), other=0.0)
                tl.store(out_row + i, prev + z * inv_temp, mask=im)
            lse_sum += (m + tl.log2(tl.reduce(s_lane, 0, SUM_COMBINE))) * 0.6931471805599453
            tl.debug_barrier()  # the next row reads back this row's sums
        size = tl.maximum(end - start, 1).to(tl.float32)
        mean_lse = lse_sum / size
        for x0 in range(0, X_run, BLOCK_X):
            i = x0 + offs
            im = i < X
            acc = tl.load(out_row + i, mask=im & ((offs * 0 + end) > start), other=0.0)
            tl.store(out_row + i, acc / size - mean_lse, mask=im)

    @lazy_jit(
        do_not_specialize=("R", "T", "rows_per_prog"),
        do_not_specialize_on_alignment=("nidx_R_ptr",),
    )
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
            n = tl.load(nidx_R_ptr + r)
            if n >= 0:
                r64 = zero64 + r  # int64 pointer math (a loop index may be a plain int)
                row_ptr = z_ptr + (r64 // T) * stride_b + (r64 % T) * stride_t
                z = tl.load(row_ptr + w, mask=wm, other=0.0).to(tl.float32)
                acc = tl.where(wm, tl.maximum(acc, z), acc)
        tl.store(part_QW_ptr + q.to(tl.int64) * W + w, acc, mask=wm)

    @lazy_jit
    def _ascending_ids_kernel(ids_K_ptr, flag_W_ptr, out_K_ptr, K, W, BLOCK: tl.constexpr):
        # One program: flag[w] = 1 for every w in ids, then each flagged w goes to the slot
        # given by the exclusive prefix sum of the flags (ascending). The barriers order this
        # program's own global writes before its reads.
        offs = tl.arange(0, BLOCK)
        zero = tl.full((BLOCK,), 0, tl.int32)
        for w0 in range(0, W, BLOCK):
            tl.store(flag_W_ptr + w0 + offs, zero, mask=w0 + offs < W)
        tl.debug_barrier()
        for k0 in range(0, K, BLOCK):
            km = k0 + offs < K
            i = tl.load(ids_K_ptr + k0 + offs, mask=km, other=0)
            tl.store(flag_W_ptr + i, zero + 1, mask=km)
        tl.debug_barrier()
        run = tl.full([], 0, tl.int32)
        for w0 in range(0, W, BLOCK):
            w = w0 + offs
            f = tl.load(flag_W_ptr + w, mask=w < W, other=0)
            slot = run + tl.associative_scan(f, 0, SUM_COMBINE) - f
            tl.store(out_K_ptr + slot, w.to(tl.int64), mask=f != 0)
            run += tl.reduce(f, 0, SUM_COMBINE)


# --------------------------------------------------------------------------- host wrappers


def check_rows(z_BTV: torch.Tensor, nidx_R: torch.Tensor | None) -> None:
    """Check the logits layout and the per-row chunk index that the row kernels need.

    Args:
        z_BTV: [B, T, V] logits.
        nidx_R: [B*T] valid-chunk index per row, or None (every row: only the layout is checked).

    Raises:
        ValueError: the logits are not 3-d with a contiguous last dim, or the row count differs.
    """
    if z_BTV.dim() != 3 or z_BTV.stride(-1) != 1:
        raise ValueError(
            f"logits must be [B, T, V] with a contiguous last dim, got shape {tuple(z_BTV.shape)} "
            f"strides {z_BTV.stride()}: call .contiguous() first"
        )
    if nidx_R is not None and nidx_R.numel() != z_BTV.shape[0] * z_BTV.shape[1]:
        raise ValueError(
            f"nidx_R has {nidx_R.numel()} entries for {z_BTV.shape[0]}x{z_BTV.shape[1]} rows: "
            "pass one chunk index per logits row"
        )


def row_logsumexp(
    z_BTV: torch.Tensor,
    nidx_R: torch.Tensor | None,
    temperature: float,
    *,
    row_sum_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row logsumexp of ``z / temperature`` for the rows that belong to a valid chunk.

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous (row strides are free).
        nidx_R: [B*T] int, valid-chunk index of each row, -1 = none; None: every row.
        temperature: softmax temperature (> 0).
        row_sum_R: [B*T] fp32, or None: also written with each row's sum of ``z`` (every row,
            in fp32; NaN and inf propagate), the finite check of the logits in the same read.

    Returns:
        lse_R fp32 [B*T]; ``+inf`` on rows with ``nidx_R < 0`` (their probabilities are 0).

    Raises:
        ValueError: bad layout or row count.
    """
    check_rows(z_BTV, nidx_R)
    B, T, V = z_BTV.shape
    if row_sum_R is not None and row_sum_R.shape != (B * T,):
        raise ValueError(f"row_sum_R must be [{B * T}] fp32, got {tuple(row_sum_R.shape)}")
    lse_R = torch.empty(B * T, device=z_BTV.device, dtype=torch.float32)
    if B * T == 0:
        return lse_R
    if V == 0:
        if row_sum_R is not None:
            row_sum_R.zero_()
        return lse_R.fill_(float("-inf"))
    _row_lse_kernel[(B * T,)](
        z_BTV,
        lse_R if nidx_R is None else nidx_R,  # any valid pointer when every row is used
        lse_R,
        lse_R if row_sum_R is None else row_sum_R,  # any valid pointer when absent
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        LOG2E / temperature,
        ALL_ROWS=nidx_R is None,
        SUMS=row_sum_R is not None,
        BLOCK_V=block_for("lse_block_v", V, 16),
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
    *,
    hist_NK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk-averaged log-probabilities over a gathered column subset, valid chunks only.

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous.
        lse_R: [B*T] fp32 row logsumexp of ``z / temperature``.
        order_R: [B*T] int64, rows sorted by valid chunk (rows of no chunk last).
        offsets_N1: [N + 1] int64, rows of chunk n are ``order[offsets[n]:offsets[n + 1]]``.
        temperature: softmax temperature.
        cols_X: [X] int column ids (None: all V columns in order).
        hist_NK: [N, K] int32 zeros (K = ``topm_l1.COARSE_BINS``), or None: the output rows'
            coarse histograms of :mod:`xtoken_core.kernels.topm_l1` are added into it (spares
            that kernel a pass).

    Returns:
        out_NX fp32 [N, X]: ``mean_{r in n} (z[r, cols] / T - lse_r)`` (0 for an empty chunk).
    """
    B, T, V = z_BTV.shape
    N = offsets_N1.numel() - 1
    X = V if cols_X is None else cols_X.numel()
    out_NX = torch.empty((N, X), device=z_BTV.device, dtype=torch.float32)
    if hist_NK is not None and tuple(hist_NK.shape) != (N, COARSE_BINS):
        raise ValueError(f"hist_NK must be [{N}, {COARSE_BINS}] int32, got {tuple(hist_NK.shape)}")
    if N == 0 or X == 0:
        return out_NX
    block = block_for("cols_block_x", X, 16)
    _chunk_cols_kernel[(N, cdiv(X, block))](
        z_BTV,
        lse_R,
        order_R,
        offsets_N1,
        cols_X if cols_X is not None else offsets_N1,
        out_NX,
        hist_NK if hist_NK is not None else offsets_N1,  # any valid pointer when absent
        T,
        X,
        z_BTV.stride(0),
        z_BTV.stride(1),
        out_NX.stride(0),
        1.0 / temperature,
        HAS_COLS=cols_X is not None,
        HIST=hist_NK is not None,
        HIST_BINS=COARSE_BINS,
        HIST_BASE=COARSE_BASE,
        HIST_SHIFT=COARSE_SHIFT,
        BLOCK_X=block,
        num_warps=KERNEL_CONFIG["cols_warps"],
    )
    return out_NX


def chunk_mean_log_softmax_columns(
    z_BTV: torch.Tensor,
    order_R: torch.Tensor,
    offsets_N1: torch.Tensor,
    temperature: float,
    cols_X: torch.Tensor | None = None,
    num_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk-averaged log-softmax restricted to a column subset.

    Equal to ``chunk_mean_columns(z[..., cols], row_logsumexp(z[..., cols]), ...)`` without
    the gathered copy: the softmax is over the ``X`` gathered columns only (the P-KL teacher
    side over its selected columns).

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous.
        order_R: [B*T] int64, rows sorted by valid chunk.
        offsets_N1: [N + 1] int64, rows of chunk n are ``order[offsets[n]:offsets[n + 1]]``.
        temperature: softmax temperature.
        cols_X: [X] int column ids (None: all V columns).
        num_valid: int64 device tensor holding N when ``offsets_N1`` covers more slots than
            there are valid chunks (rows n >= N of the result are left unwritten); None: N is
            ``offsets_N1.numel() - 1``.

    Returns:
        out_NX fp32 [N, X]: ``mean_{r in n} log_softmax(z[r, cols] / T)`` (0 for an empty chunk).
    """
    B, T, V = z_BTV.shape
    N = offsets_N1.numel() - 1
    X = V if cols_X is None else cols_X.numel()
    out_NX = torch.empty((N, X), device=z_BTV.device, dtype=torch.float32)
    if N == 0 or X == 0:
        return out_NX
    _chunk_lsm_cols_kernel[(N,)](
        z_BTV,
        order_R,
        offsets_N1,
        cols_X if cols_X is not None else offsets_N1,
        num_valid if num_valid is not None else offsets_N1,
        out_NX,
        T,
        X,
        z_BTV.stride(0),
        z_BTV.stride(1),
        out_NX.stride(0),
        LOG2E / temperature,
        1.0 / temperature,
        HAS_COLS=cols_X is not None,
        DEVICE_N=num_valid is not None,
        BLOCK_X=block_for("lsm_block_x", X, 16),
        num_warps=KERNEL_CONFIG["lsm_warps"],
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
    check_rows(z_BTW, nidx_R)
    B, T, W = z_BTW.shape
    R = B * T
    rows = KERNEL_CONFIG["colmax_rows"]
    Q = max(cdiv(R, rows), 1)
    device = z_BTW.device
    part_QW = torch.empty((Q, W), device=device, dtype=torch.float32)
    if R == 0 or W == 0:
        return part_QW.fill_(float("-inf")).amax(0)
    block = block_for("colmax_block_w", W, 16)
    _col_max_kernel[(cdiv(W, block), Q)](
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


def ascending_ids(ids_K: torch.Tensor, W: int) -> torch.Tensor:
    """The distinct ids ``ids_K`` (in ``[0, W)``, any order) sorted ascending.

    Equal to ``torch.sort(ids_K).values`` for distinct ids (e.g. the indices of
    ``torch.topk``); duplicates collapse, so the tail of the result is then unspecified. Runs
    where :func:`use_triton` says so, else ``torch.sort``.

    Args:
        ids_K: [K] int, distinct, each in ``[0, W)`` (not checked: it costs a host sync).
        W: the id range (the teacher vocab).

    Returns:
        int64 [K], ascending.
    """
    K = ids_K.numel()
    if not use_triton(ids_K) or K == 0:
        return torch.sort(ids_K.reshape(-1)).values.to(torch.int64)
    out_K = torch.empty(K, device=ids_K.device, dtype=torch.int64)
    flag_W = torch.empty(W, device=ids_K.device, dtype=torch.int32)
    _ascending_ids_kernel[(1,)](
        ids_K.reshape(-1),
        flag_W,
        out_K,
        K,
        W,
        BLOCK=block_for("ids_block", max(W, K), 16),
        num_warps=KERNEL_CONFIG["ids_warps"],
    )
    return out_K
