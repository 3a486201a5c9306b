"""Fused chunk-averaged log-softmax: Triton kernels, autograd Function, PyTorch reference.

Legend (shape suffixes):
    B batch, T positions, V vocabulary, C chunks per sample,
    R = B*T rows (flattened positions), S = B*C segments (flattened chunks).

Math. With x = z / temperature and lse_r = logsumexp_v x[r, v]:
    avg[s, v]  = (1 / n_s) * sum_{r in s} (x[r, v] - lse_r)            (0 when n_s == 0)
    dz[r, v]   = (1 / (temperature * n_s)) * (g[s, v] - softmax(x_r)[v] * sum_v' g[s, v'])
                 for the segment s of row r, and 0 for rows with chunk id -1.

Forward, deterministic (fixed-order sums over rows sorted by segment, no atomics): a row
logsumexp kernel (online softmax), then a segmented sum per (segment, V block).
The segment structure (rows sorted by segment, offsets, sizes) is one small launch, a stable
counting sort (``_segments_kernel``), not a torch sort: no host sync, few host ops.
Backward is one pass (plus a row sum of the incoming gradient). Only the input logits and one
fp32 scalar per row are saved: no [B, T, V] fp32 copy is ever made.
"""

import logging
import math

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

logger = logging.getLogger(__name__)

__all__ = [
    "chunk_avg_log_softmax",
    "chunk_avg_log_softmax_reference",
    "ChunkAvgLogSoftmax",
]


# Block sizes per pass (GPU). Benchmarks may override entries; tests run them interpreted.
KERNEL_CONFIG = {
    # Chunk ids already on the GPU are range-checked only when this is True (a device sync per
    # call, which stalls the host queue); unchecked, out-of-range ids count as -1 (ignored, as
    # in the one-hot reference). Ids passed on the CPU are always checked, on the host.
    "check_device_ids": False,
    "lse_block_v": 4096,
    "lse_warps": 8,
    "acc_block_v": 2048,
    "acc_warps": 4,
    "bwd_block_v": 2048,
    "bwd_warps": 4,
}


def chunk_avg_log_softmax_reference(
    logits_BTV: torch.Tensor,
    chunk_id_BT: torch.Tensor,
    num_chunks: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Obviously-correct PyTorch version (fp32 log-softmax + index_add segmented mean).

    Differentiable through autograd. Costs an fp32 [B, T, V] copy: use it for tests and the CPU
    fallback, not on the GPU hot path.

    Args:
        logits_BTV: [B, T, V] logits, any float dtype.
        chunk_id_BT: [B, T] integer chunk ids in [-1, num_chunks); -1 = no chunk.
        num_chunks: C, chunk buckets per sample.
        temperature: softmax temperature (> 0).

    Returns:
        (avg_BCV fp32 [B, C, V], sizes_BC fp32 [B, C]); empty chunks have a zero row, size 0.
    """
    B, T, V = logits_BTV.shape
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    cid_BT = chunk_id_BT.to(device=logits_BTV.device, dtype=torch.long)
    valid_BT = cid_BT >= 0
    seg_BT = torch.arange(B, device=cid_BT.device)[:, None] * num_chunks + cid_BT
    seg_N = seg_BT[valid_BT]
    sums_SV = logp_BTV.new_zeros(B * num_chunks, V).index_add(0, seg_N, logp_BTV[valid_BT])
    sizes_S = logp_BTV.new_zeros(B * num_chunks).index_add(
        0, seg_N, torch.ones_like(seg_N, dtype=logp_BTV.dtype)
    )
    avg_SV = sums_SV / sizes_S.clamp(min=1.0)[:, None]
    return avg_SV.view(B, num_chunks, V), sizes_S.view(B, num_chunks)


if tl is not None:

    @lazy_jit(
        do_not_specialize=("R", "T", "C", "S"),
        do_not_specialize_on_alignment=(
            "cid_ptr",
            "seg_R_ptr",
            "order_R_ptr",
            "offsets_S1_ptr",
            "sizes_S_ptr",
        ),
    )
    def _segments_kernel(
        cid_ptr,
        seg_R_ptr,
        order_R_ptr,
        offsets_S1_ptr,
        sizes_S_ptr,
        R,
        T,
        C,
        S,
        BLOCK_R: tl.constexpr,
    ):
        # One program per segment s in [0, S]; s == S is the bucket of rows outside every chunk.
        # key_r = b * C + cid_r for ids in [0, C), else S (the stable-sort key of _segments).
        # Pass 1: offsets[s] = #rows with key < s. Pass 2: rows with key == s, in row order,
        # go to order[offsets[s] + rank]: a stable counting sort, identical to sorting by key.
        # Program 0 also writes seg_R (key, or -1). No atomics: deterministic.
        s = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_R).to(tl.int64)
        before = tl.full([], 0, tl.int64)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + offs
            in_r = r < R
            cid = tl.load(cid_ptr + r, mask=in_r, other=-1).to(tl.int64)
            ok = (cid >= 0) & (cid < C)
            key = tl.where(ok, (r // T) * C + cid, S)
            tl.store(seg_R_ptr + r, tl.where(ok, key, -1), mask=in_r & ((r * 0 + s) == 0))
            before += tl.reduce(((key < s) & in_r).to(tl.int64), 0, SUM_COMBINE)
        running = before
        for r0 in range(0, R, BLOCK_R):
            r = r0 + offs
            in_r = r < R
            cid = tl.load(cid_ptr + r, mask=in_r, other=-1).to(tl.int64)
            ok = (cid >= 0) & (cid < C)
            key = tl.where(ok, (r // T) * C + cid, S)
            hit = ((key == s) & in_r).to(tl.int64)
            rank = tl.associative_scan(hit, 0, SUM_COMBINE) - 1
            tl.store(order_R_ptr + running + rank, r, mask=hit > 0)
            running += tl.reduce(hit, 0, SUM_COMBINE)
        tl.store(offsets_S1_ptr + s, before)
        tl.store(sizes_S_ptr + s, (running - before).to(tl.float32), mask=s < S)

    @lazy_jit(do_not_specialize=("T",), do_not_specialize_on_alignment=("seg_R_ptr", "lse_R_ptr"))
    def _row_lse_kernel(
        logits_ptr,
        seg_R_ptr,
        lse_R_ptr,
        T,
        V,
        stride_b,
        stride_t,
        scale2,  # log2(e) / temperature: x2 = z * scale2 is the row in base-2 units
        BLOCK_V: tl.constexpr,
    ):
        # One program per row r. Online softmax in base 2 over V blocks, one exp2 per element
        # and one block max per step; the sums stay per lane until the end:
        #   m' = max(m, max_blk x2);  s_lane' = s_lane * 2^(m - m') + 2^(x2 - m')
        # lse (natural log) = (m + log2 sum_lanes s_lane) * ln 2. Rows outside every chunk skip.
        r = tl.program_id(0).to(tl.int64)
        seg = tl.load(seg_R_ptr + r)
        if seg >= 0:
            row_ptr = logits_ptr + (r // T) * stride_b + (r % T) * stride_t
            offs = tl.arange(0, BLOCK_V)
            m = tl.full([], -1.0e30, tl.float32)
            s_lane = tl.full((BLOCK_V,), 0.0, tl.float32)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                x2 = tl.load(row_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32) * scale2
                m_new = tl.maximum(m, tl.reduce(x2, 0, MAX_COMBINE))
                s_lane = s_lane * tl.exp2(m - m_new) + tl.exp2(x2 - m_new)
                m = m_new
            total = tl.reduce(s_lane, 0, SUM_COMBINE)
            tl.store(lse_R_ptr + r, (m + tl.log2(total)) * 0.6931471805599453)
        else:
            tl.store(lse_R_ptr + r, 0.0)

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=("order_N_ptr", "offsets_S1_ptr", "lse_R_ptr"),
    )
    def _chunk_acc_kernel(
        logits_ptr,
        order_N_ptr,
        offsets_S1_ptr,
        lse_R_ptr,
        out_SV_ptr,
        T,
        V,
        stride_b,
        stride_t,
        inv_temp,
        BLOCK_V: tl.constexpr,
    ):
        # One program per (segment s, V block). Rows of s are order[offsets[s]:offsets[s+1]]
        # (sorted once by segment on the host side): a fixed-order sum, no atomics.
        #   out[s, v] = sum_{r in s} (z[r, v] * inv_temp - lse_r) / max(n_s, 1)
        s_id = tl.program_id(0).to(tl.int64)
        vb = tl.program_id(1)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = v < V
        start = tl.load(offsets_S1_ptr + s_id)
        end = tl.load(offsets_S1_ptr + s_id + 1)
        acc = tl.full((BLOCK_V,), 0.0, tl.float32)
        for i in range(start, end):
            r = tl.load(order_N_ptr + i)
            row_ptr = logits_ptr + (r // T) * stride_b + (r % T) * stride_t
            z = tl.load(row_ptr + v, mask=vmask, other=0.0).to(tl.float32)
            acc += z * inv_temp - tl.load(lse_R_ptr + r)
        n = tl.maximum(end - start, 1).to(tl.float32)
        out = acc / n
        tl.store(out_SV_ptr + s_id * V + v, out.to(out_SV_ptr.dtype.element_ty), mask=vmask)

    @lazy_jit(
        do_not_specialize=("T", "C"),
        do_not_specialize_on_alignment=("seg_R_ptr", "lse_R_ptr", "sizes_S_ptr", "gsum_S_ptr"),
    )
    def _chunk_bwd_kernel(
        logits_ptr,
        grad_ptr,
        seg_R_ptr,
        lse_R_ptr,
        sizes_S_ptr,
        gsum_S_ptr,
        dlogits_ptr,
        T,
        V,
        C,
        stride_b,
        stride_t,
        g_stride_b,
        g_stride_c,
        g_stride_v,
        scale2,  # log2(e) / temperature
        inv_temp,
        BLOCK_V: tl.constexpr,
    ):
        # One program per (row r, V block):
        #   dz[r, v] = (g[s, v] - 2^(z*scale2 - lse_r*log2 e) * gsum[s]) * inv_temp / n_s
        r = tl.program_id(0).to(tl.int64)
        vb = tl.program_id(1)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = v < V
        seg = tl.load(seg_R_ptr + r)
        out_ptr = dlogits_ptr + r * V + v
        if seg >= 0:
            row_ptr = logits_ptr + (r // T) * stride_b + (r % T) * stride_t
            g_ptr = grad_ptr + (seg // C) * g_stride_b + (seg % C) * g_stride_c
            z = tl.load(row_ptr + v, mask=vmask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + v * g_stride_v, mask=vmask, other=0.0).to(tl.float32)
            lse2 = tl.load(lse_R_ptr + r) * 1.4426950408889634
            p = tl.exp2(z * scale2 - lse2)
            coef = inv_temp / tl.load(sizes_S_ptr + seg)
            dz = (g - p * tl.load(gsum_S_ptr + seg)) * coef
            tl.store(out_ptr, dz.to(dlogits_ptr.dtype.element_ty), mask=vmask)
        else:
            tl.store(
                out_ptr,
                tl.full((BLOCK_V,), 0.0, tl.float32).to(dlogits_ptr.dtype.element_ty),
                mask=vmask,
            )


def _block(key: str, V: int) -> int:
    """GPU block size from KERNEL_CONFIG, or one block covering small rows (cheap interpreted)."""
    block = KERNEL_CONFIG[key]
    if not torch.cuda.is_available() or V < block:
        block = min(block, next_power_of_2(V))
    return block


def _validate(logits_BTV, chunk_id_BT, num_chunks, temperature) -> None:
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits_BTV must be [B, T, V], got shape {tuple(logits_BTV.shape)}")
    if not logits_BTV.is_floating_point():
        raise ValueError(f"logits_BTV must be a float tensor, got {logits_BTV.dtype}")
    if tuple(chunk_id_BT.shape) != tuple(logits_BTV.shape[:2]):
        raise ValueError(
            f"chunk_id_BT shape {tuple(chunk_id_BT.shape)} must equal logits [B, T] "
            f"{tuple(logits_BTV.shape[:2])}"
        )
    if chunk_id_BT.is_floating_point() or chunk_id_BT.dtype == torch.bool:
        raise ValueError(f"chunk_id_BT must be an integer tensor, got {chunk_id_BT.dtype}")
    if num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def _segments(chunk_id_BT: torch.Tensor, num_chunks: int, check: bool = True):
    """Segment structure: per-row segment id, rows sorted by segment, segment offsets.

    Ids outside [-1, num_chunks) are treated as -1, so the kernels stay in bounds unchecked.

    Args:
        chunk_id_BT: [B, T] integer chunk ids.
        num_chunks: C.
        check: raise on a bad id (a device sync when the ids are on the GPU).

    Returns:
        seg_R int64 [R] (-1 = no chunk), order_N int64 [R] (rows sorted by segment, invalid rows
        last), offsets_S1 int64 [S + 1], sizes_S int64 [S].

    Raises:
        ValueError: with ``check``, a chunk id is < -1 or >= num_chunks.
    """
    B, T = chunk_id_BT.shape
    S = B * num_chunks
    cid_BT = chunk_id_BT.to(torch.long)
    ok_BT = (cid_BT >= -1) & (cid_BT < num_chunks)
    if check and cid_BT.numel():
        _raise_on_bad_ids(~ok_BT.all(), cid_BT, num_chunks)
    base_B1 = torch.arange(B, device=cid_BT.device)[:, None] * num_chunks
    seg_BT = torch.where(ok_BT & (cid_BT >= 0), base_B1 + cid_BT, torch.full_like(cid_BT, -1))
    seg_R = seg_BT.reshape(-1).contiguous()
    key_R = torch.where(seg_R >= 0, seg_R, torch.full_like(seg_R, S))
    sorted_key_R, order_R = torch.sort(key_R, stable=True)
    bounds_S1 = torch.arange(S + 1, device=cid_BT.device)
    offsets_S1 = torch.searchsorted(sorted_key_R, bounds_S1).contiguous()
    sizes_S = offsets_S1[1:] - offsets_S1[:-1]
    return seg_R, order_R.contiguous(), offsets_S1, sizes_S


#: Above this many (segment, row) pairs the one-launch segment kernel (each of its S + 1
#: programs scans all R ids) gives way to the sort-based torch path.
SEGMENTS_KERNEL_MAX_WORK = 1 << 27


def _segments_device(chunk_id_BT: torch.Tensor, num_chunks: int):
    """Segment structure of :func:`_segments` (same values, bit for bit) by a Triton kernel.

    Replaces ~15 small torch ops (where, stable sort, searchsorted, ...) by a stable counting
    sort: no host sync and no data-dependent sizes. Falls back to :func:`_segments` (unchecked)
    for empty inputs or when S * R exceeds ``SEGMENTS_KERNEL_MAX_WORK``.

    Args:
        chunk_id_BT: [B, T] integer chunk ids on the kernels' device; out-of-range ids count
            as -1.
        num_chunks: C.

    Returns:
        seg_R int64 [R], order_R int64 [R], offsets_S1 int64 [S + 1], sizes_S fp32 [S].
    """
    B, T = chunk_id_BT.shape
    R, S = B * T, B * num_chunks
    if R == 0 or (S + 1) * R > SEGMENTS_KERNEL_MAX_WORK:
        seg_R, order_R, offsets_S1, sizes_S = _segments(chunk_id_BT, num_chunks, check=False)
        return seg_R, order_R, offsets_S1, sizes_S.to(torch.float32)
    buf_N = torch.empty(2 * R + S + 1, device=chunk_id_BT.device, dtype=torch.long)
    sizes_S = torch.empty(S + 1, device=chunk_id_BT.device, dtype=torch.float32)
    seg_R, order_R, offsets_S1 = buf_N[:R], buf_N[R : 2 * R], buf_N[2 * R :]
    _segments_kernel[(S + 1,)](
        chunk_id_BT.contiguous(),
        seg_R,
        order_R,
        offsets_S1,
        sizes_S,
        R,
        T,
        num_chunks,
        S,
        BLOCK_R=min(1024, next_power_of_2(R)),
        num_warps=4,
    )
    return seg_R, order_R, offsets_S1, sizes_S[:S]


def _raise_on_bad_ids(bad: torch.Tensor, cid_BT: torch.Tensor, num_chunks: int) -> None:
    """Raise ValueError when ``bad`` (0-d bool, possibly on the GPU: this syncs) is set."""
    if bool(bad):
        lo, hi = int(cid_BT.min()), int(cid_BT.max())
        raise ValueError(
            f"chunk ids must lie in [-1, num_chunks={num_chunks}), got range [{lo}, {hi}]: "
            "raise num_chunks or mark positions outside every chunk with -1"
        )


def chunk_avg_log_softmax_forward(logits_BTV, chunk_id_BT, num_chunks, temperature, out_dtype):
    """Triton forward. Returns (avg_BCV, sizes_BC fp32, lse_R fp32, seg_R, sizes_S fp32).

    Args:
        logits_BTV: [B, T, V] logits (last dim contiguous is used as is; other layouts copied).
        chunk_id_BT: [B, T] chunk ids.
        num_chunks: C.
        temperature: softmax temperature.
        out_dtype: dtype of avg_BCV (accumulation is fp32 regardless).

    Returns:
        The outputs plus what the backward needs.
    """
    B, T, V = logits_BTV.shape
    C = num_chunks
    if (not chunk_id_BT.is_cuda or KERNEL_CONFIG["check_device_ids"]) and chunk_id_BT.numel():
        cid_BT = chunk_id_BT.to(torch.long)
        _raise_on_bad_ids(((cid_BT < -1) | (cid_BT >= C)).any(), cid_BT, C)
    seg_R, order_R, offsets_S1, sizes_Sf = _segments_device(chunk_id_BT, C)
    R, S = B * T, B * C
    lse_R = torch.empty(R, device=logits_BTV.device, dtype=torch.float32)
    avg_BCV = torch.empty(B, C, V, device=logits_BTV.device, dtype=out_dtype)
    sb, st = logits_BTV.stride(0), logits_BTV.stride(1)
    if R > 0 and V > 0:
        _row_lse_kernel[(R,)](
            logits_BTV,
            seg_R,
            lse_R,
            T,
            V,
            sb,
            st,
            LOG2E / temperature,
            BLOCK_V=_block("lse_block_v", V),
            num_warps=KERNEL_CONFIG["lse_warps"],
        )
    if S > 0 and V > 0:
        block = _block("acc_block_v", V)
        _chunk_acc_kernel[(S, cdiv(V, block))](
            logits_BTV,
            order_R,
            offsets_S1,
            lse_R,
            avg_BCV,
            T,
            V,
            sb,
            st,
            1.0 / temperature,
            BLOCK_V=block,
            num_warps=KERNEL_CONFIG["acc_warps"],
        )
    return avg_BCV, sizes_Sf.view(B, C), lse_R, seg_R, sizes_Sf


def chunk_avg_log_softmax_backward(
    grad_BCV, logits_BTV, lse_R, seg_R, sizes_S, num_chunks, temperature
):
    """Triton backward: dL/dlogits [B, T, V] in the logits dtype.

    Args:
        grad_BCV: [B, C, V] gradient of avg_BCV (any strides, e.g. expanded).
        logits_BTV: the forward's logits.
        lse_R: [R] fp32 row logsumexp of logits / temperature.
        seg_R: [R] int64 segment per row (-1 = none).
        sizes_S: [S] fp32 segment sizes.
        num_chunks: C.
        temperature: softmax temperature.

    Returns:
        dlogits_BTV, contiguous, dtype of logits_BTV.
    """
    B, T, V = logits_BTV.shape
    R = B * T
    dlogits_BTV = torch.empty((B, T, V), device=logits_BTV.device, dtype=logits_BTV.dtype)
    if R == 0 or V == 0:
        return dlogits_BTV
    gsum_S = torch.sum(grad_BCV, dim=-1, dtype=torch.float32).reshape(-1).contiguous()
    block = _block("bwd_block_v", V)
    _chunk_bwd_kernel[(R, cdiv(V, block))](
        logits_BTV,
        grad_BCV,
        seg_R,
        lse_R,
        sizes_S,
        gsum_S,
        dlogits_BTV,
        T,
        V,
        max(num_chunks, 1),
        logits_BTV.stride(0),
        logits_BTV.stride(1),
        grad_BCV.stride(0),
        grad_BCV.stride(1),
        grad_BCV.stride(2),
        LOG2E / temperature,
        1.0 / temperature,
        BLOCK_V=block,
        num_warps=KERNEL_CONFIG["bwd_warps"],
    )
    return dlogits_BTV


class ChunkAvgLogSoftmax(torch.autograd.Function):
    """Autograd Function over the Triton forward/backward (no double backward)."""

    @staticmethod
    def forward(ctx, logits_BTV, chunk_id_BT, num_chunks, temperature, out_dtype):
        if logits_BTV.stride(-1) != 1:
            logits_BTV = logits_BTV.contiguous()
        avg_BCV, sizes_BC, lse_R, seg_R, sizes_S = chunk_avg_log_softmax_forward(
            logits_BTV, chunk_id_BT, num_chunks, temperature, out_dtype
        )
        ctx.save_for_backward(logits_BTV, lse_R, seg_R, sizes_S)
        ctx.num_chunks = num_chunks
        ctx.temperature = temperature
        ctx.mark_non_differentiable(sizes_BC)
        return avg_BCV, sizes_BC

    @staticmethod
    def backward(ctx, grad_avg_BCV, grad_sizes_BC):
        logits_BTV, lse_R, seg_R, sizes_S = ctx.saved_tensors
        if grad_avg_BCV is None:
            return None, None, None, None, None
        dlogits_BTV = chunk_avg_log_softmax_backward(
            grad_avg_BCV, logits_BTV, lse_R, seg_R, sizes_S, ctx.num_chunks, ctx.temperature
        )
        return dlogits_BTV, None, None, None, None


def chunk_avg_log_softmax(
    logits_BTV: torch.Tensor,
    chunk_id_BT: torch.Tensor,
    num_chunks: int,
    temperature: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-averaged log-softmax, fused: mean over each chunk's positions of
    ``log_softmax(logits / temperature)``, differentiable w.r.t. the logits.

    Shape:
        logits_BTV: [B, T, V], fp32 / bf16 / fp16 (the last dim must be contiguous or it is
            copied; row strides are free, e.g. a vocab-sliced view).
        chunk_id_BT: [B, T] integer, values in [-1, num_chunks); -1 = no chunk.
        avg_BCV: [B, C, V], ``out_dtype`` (fp32 by default; accumulation is always fp32).
        sizes_BC: [B, C] fp32, number of positions in each chunk (0 = empty: its row is 0).
        gradient: [B, T, V] in the logits dtype; 0 on positions with chunk id -1.

    Runs the Triton kernels on CUDA tensors (or anywhere under ``TRITON_INTERPRET=1``);
    otherwise falls back to :func:`chunk_avg_log_softmax_reference`.

    Args:
        logits_BTV: logits.
        chunk_id_BT: chunk id per position.
        num_chunks: C, chunk buckets per sample.
        temperature: softmax temperature (> 0).
        out_dtype: dtype of the averaged log-probs.

    Returns:
        (avg_BCV, sizes_BC).

    Raises:
        ValueError: bad shapes or dtypes, temperature <= 0, chunk ids outside [-1, C) (ids
            passed on the CPU always; ids already on the GPU only with
            ``KERNEL_CONFIG["check_device_ids"]``, else they count as -1: no device sync).
    """
    _validate(logits_BTV, chunk_id_BT, num_chunks, temperature)
    if not chunk_id_BT.is_cuda and chunk_id_BT.numel():  # free on the host: always checked
        cid_BT = chunk_id_BT.to(torch.long)
        _raise_on_bad_ids(((cid_BT < -1) | (cid_BT >= num_chunks)).any(), cid_BT, num_chunks)
    chunk_id_BT = chunk_id_BT.to(logits_BTV.device)
    if not use_triton(logits_BTV):
        avg_BCV, sizes_BC = chunk_avg_log_softmax_reference(
            logits_BTV, chunk_id_BT, num_chunks, temperature
        )
        return avg_BCV.to(out_dtype), sizes_BC
    return ChunkAvgLogSoftmax.apply(
        logits_BTV, chunk_id_BT, int(num_chunks), float(temperature), out_dtype
    )
