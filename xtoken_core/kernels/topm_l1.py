"""Sorted top-m L1 between two rows of log-probs, and its gradient, without sorting.

The gold loss compares the ``m`` largest uncommon probabilities of the student and the teacher
rank by rank: for each row ``n``, with ``a_(0) >= a_(1) >= ...`` the student's sorted values and
``b_(0) >= ...`` the teacher's,

    l1_n = sum_{j < m} |e^a_(j) - e^b_(j)|,    d l1_n / d a_(j) = sign(a_(j) - b_(j)) e^a_(j).

:func:`topm_l1_reference` does it as written (two ``torch.topk`` and a scatter). :func:`topm_l1`
gets the same numbers from counts. Walk the union of both top-m sets from the largest value down
and let ``D`` be (a's seen) - (b's seen) before each element; an ``a`` meets its partner
``b_(rank)`` below it exactly when ``D >= 0``, a ``b`` is below its partner when ``D > 0``. So

    l1_n = sum_{a in A} (+1 if D >= 0 else -1) e^a + sum_{b in B} (-1 if D > 0 else +1) e^b

(at equal values an ``a`` walks before a ``b``, equal values of one side by column). ``D`` only
needs counts of larger values, which a histogram over a common grid of the row gives for every
bin at once: where ``D`` cannot change sign inside a bin (the usual case), every element of the
bin takes its sign from the counts above the bin; only the few bins where it can (and the bin
holding each side's m-th value) are resolved element by element. Per row:

1. :func:`_hist_kernel`, coarse: histogram of the float bits of ``-x`` (4096 bins, 16 per
   binade) -> a window ``[lo, hi]`` that holds both top-m sets.
2. :func:`_hist_kernel`, fine: histogram over ``num_bins`` equal bins of the window.
3. :func:`_bin_classes` (torch, on the histograms): for each bin and side, member or not and the
   sign, or "resolve". A window that misses a top-m set or more resolve elements than the buffer
   holds sends the whole call to the reference (one host sync per call).
4. :func:`_final_kernel`: one pass over both rows: signs of the decided bins summed, ``g``
   written (0 where undecided), elements of resolve bins appended to a per-row buffer.
5. :func:`_resolve_kernel`: pairwise counts within each resolve bin -> rank, membership, ``D``.

Not yet used by the loss: on an H100 at the gold loss's 1x4096 shapes it takes ~81 ms against
~14 ms for the reference, almost all in ``tl.histogram`` with 4096 bins (its cost grows with the
bin count; see benchmarks/results/losses_kd_loss.md).

Legend: N rows, A / B the student / teacher columns, m the top-m length, K fine bins,
S buffer slots per row and side.
"""

from __future__ import annotations

import torch

from ._utils import SUM_COMBINE, lazy_jit, next_power_of_2, tl, use_triton

__all__ = ["topm_l1", "topm_l1_reference"]

#: Coarse bins: bits 30..19 of the fp32 ``-x`` (8 exponent bits, 4 mantissa bits).
COARSE_BINS = 4096
COARSE_SHIFT = 19
#: Fine bins over the window (the last one holds everything below it).
FINE_BINS = 4096
#: Buffer slots per row and side for the elements of resolve bins.
RESOLVE_SLOTS = 4096

# class codes of a (row, bin): bits 0-1 student state, bits 2-3 teacher state, bit 4 resolve
_NONE, _PLUS, _MINUS = 0, 1, 2
_RESOLVE = 16


def topm_l1_reference(
    a_NA: torch.Tensor, b_NB: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted top-m L1 of ``e^a`` against ``e^b`` per row, by ``torch.topk``.

    Args:
        a_NA: [N, A] fp32 student log-probs (differentiated).
        b_NB: [N, B] fp32 teacher log-probs.
        m: compared length, ``1 <= m <= min(A, B)``.

    Returns:
        ``(l1_N, g_NA, gsum_N)``: [N] the L1; [N, A] ``d l1 / d a`` (``sign(e^a_(j) - e^b_(j))
        e^a_(j)`` at the student's top-m columns, 0 elsewhere); [N] the row sums of ``g``.
    """
    top_a = torch.topk(a_NA, m, dim=-1)
    p_Nm = top_a.values.exp()
    diff_Nm = p_Nm - torch.topk(b_NB, m, dim=-1).values.exp()
    g_Nm = diff_Nm.sign() * p_Nm
    g_NA = torch.zeros_like(a_NA).scatter_(1, top_a.indices, g_Nm)
    return diff_Nm.abs().sum(-1), g_NA, g_Nm.sum(-1)


if tl is not None:

    @lazy_jit
    def _hist_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        lo_ptr,
        hi_ptr,
        scale_ptr,
        hist_ptr,
        N,
        NBINS: tl.constexpr,
        FINE: tl.constexpr,
        SHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row n, side): histogram of the row's bins. Coarse: bits 30..19 of -x (a
        # larger x has a smaller bin). Fine: floor((hi - x) * scale) clamped to [0, NBINS - 2],
        # NBINS - 1 for x < lo (and for the padding lanes in both modes).
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        if side == 0:
            row = a_ptr + n * a_stride
            M = A
        else:
            row = b_ptr + n * b_stride
            M = B
        if FINE:
            lo = tl.load(lo_ptr + n)
            hi = tl.load(hi_ptr + n)
            scale = tl.load(scale_ptr + n)
        h = tl.full((NBINS,), 0, tl.int32)
        for start in range(0, M, BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            if FINE:
                k = tl.floor((hi - x) * scale).to(tl.int32)
                k = tl.minimum(tl.maximum(k, 0), NBINS - 2)
                k = tl.where(x < lo, NBINS - 1, k)
            else:
                k = tl.maximum((-x).to(tl.int32, bitcast=True), 0) >> SHIFT
            k = tl.where(cm, k, NBINS - 1)
            h += tl.histogram(k, NBINS)
        tl.store(hist_ptr + (side * N + n) * NBINS + tl.arange(0, NBINS), h)

    @lazy_jit
    def _final_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        lo_ptr,
        hi_ptr,
        scale_ptr,
        cls_ptr,
        g_ptr,
        g_stride,
        col_ptr,
        val_ptr,
        part_ptr,
        N,
        NBINS: tl.constexpr,
        SLOTS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row n, side): every element of a decided bin adds its signed probability
        # (the student's is also its gradient, written to g: 0 where not a member or undecided);
        # elements of resolve bins are appended to the side's buffer (column and value).
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        if side == 0:
            row = a_ptr + n * a_stride
            M = A
            shift = 0
        else:
            row = b_ptr + n * b_stride
            M = B
            shift = 2
        lo = tl.load(lo_ptr + n)
        hi = tl.load(hi_ptr + n)
        scale = tl.load(scale_ptr + n)
        total = tl.full((BLOCK,), 0, tl.float32)
        run = 0
        slot_base = (side * N + n) * SLOTS
        for start in range(0, M, BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            k = tl.floor((hi - x) * scale).to(tl.int32)
            k = tl.minimum(tl.maximum(k, 0), NBINS - 2)
            k = tl.where(x < lo, NBINS - 1, k)
            code = tl.load(cls_ptr + n * NBINS + k, mask=cm, other=0).to(tl.int32)
            state = (code >> shift) & 3
            res = ((code & 16) != 0) & cm
            p = tl.exp(x)
            s = tl.where(state == 1, p, tl.where(state == 2, -p, 0.0))
            s = tl.where(res, 0.0, s)
            total += s
            if side == 0:
                tl.store(g_ptr + n * g_stride + c, s, mask=cm)
            r = res.to(tl.int32)
            slot = run + tl.associative_scan(r, 0, SUM_COMBINE) - r
            keep = res & (slot < SLOTS)
            tl.store(col_ptr + slot_base + slot, c, mask=keep)
            tl.store(val_ptr + slot_base + slot, x, mask=keep)
            run += tl.reduce(r, 0, SUM_COMBINE)
        tl.store(part_ptr + side * N + n, tl.reduce(total, 0, SUM_COMBINE))

    @lazy_jit
    def _resolve_kernel(
        col_ptr,
        val_ptr,
        count_ptr,
        lo_ptr,
        hi_ptr,
        scale_ptr,
        hist_ptr,
        top_ptr,
        g_ptr,
        g_stride,
        out_ptr,
        N,
        m,
        NBINS: tl.constexpr,
        SLOTS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # Program (row n): the buffered elements of both sides as one list, i < na from the
        # student. For each i: rank = same-side elements of its bin above it, cross = other-side
        # elements of its bin above it (an a walks before an equal b). Then, with top / count
        # the side's elements above the bin / in it:
        #   member  <=> top_side + rank < m
        #   D(a) = min(topA, m) + rank - min(topB, m) - min(cross, mB),  + iff D >= 0
        #   D(b) = min(topA, m) + min(cross, mA) - min(topB, m) - rank,  + iff D <= 0
        # with mA = clamp(m - topA, 0, countA) the members of the bin (mB likewise).
        n = tl.program_id(0).to(tl.int64)
        na = tl.minimum(tl.load(count_ptr + n), SLOTS)
        nb = tl.minimum(tl.load(count_ptr + N + n), SLOTS)
        total = na + nb
        lo = tl.load(lo_ptr + n)
        hi = tl.load(hi_ptr + n)
        scale = tl.load(scale_ptr + n)
        base_a = n * SLOTS
        base_b = (N + n) * SLOTS
        l1 = tl.full((TILE,), 0, tl.float32)
        gsum = tl.full((TILE,), 0, tl.float32)
        for i0 in range(0, total, TILE):
            i = i0 + tl.arange(0, TILE)
            im = i < total
            ia = i < na
            off_i = tl.where(ia, base_a + i, base_b + i - na)
            col_i = tl.load(col_ptr + off_i, mask=im, other=0)
            v_i = tl.load(val_ptr + off_i, mask=im, other=0.0)
            k_i = tl.floor((hi - v_i) * scale).to(tl.int32)
            k_i = tl.minimum(tl.maximum(k_i, 0), NBINS - 2)
            k_i = tl.where(v_i < lo, NBINS - 1, k_i)
            rank = tl.full((TILE,), 0, tl.int32)
            cross = tl.full((TILE,), 0, tl.int32)
            for j0 in range(0, total, TILE):
                j = j0 + tl.arange(0, TILE)
                jm = j < total
                ja = j < na
                off_j = tl.where(ja, base_a + j, base_b + j - na)
                col_j = tl.load(col_ptr + off_j, mask=jm, other=0)
                v_j = tl.load(val_ptr + off_j, mask=jm, other=0.0)
                k_j = tl.floor((hi - v_j) * scale).to(tl.int32)
                k_j = tl.minimum(tl.maximum(k_j, 0), NBINS - 2)
                k_j = tl.where(v_j < lo, NBINS - 1, k_j)
                same_bin = (k_i[:, None] == k_j[None, :]) & jm[None, :]
                gt = v_j[None, :] > v_i[:, None]
                eq = v_j[None, :] == v_i[:, None]
                same_side = ia[:, None] == ja[None, :]
                above_same = gt | (eq & (col_j[None, :] < col_i[:, None]))
                # an a (i) sees b's strictly above it; a b (i) sees a's above or equal
                above_cross = gt | (eq & ja[None, :])
                rank += tl.reduce((same_bin & same_side & above_same).to(tl.int32), 1, SUM_COMBINE)
                cross += tl.reduce(
                    (same_bin & (~same_side) & above_cross).to(tl.int32), 1, SUM_COMBINE
                )
            row_k = n * NBINS + k_i
            top_a = tl.load(top_ptr + row_k, mask=im, other=0)
            top_b = tl.load(top_ptr + N * NBINS + row_k, mask=im, other=0)
            cnt_a = tl.load(hist_ptr + row_k, mask=im, other=0)
            cnt_b = tl.load(hist_ptr + N * NBINS + row_k, mask=im, other=0)
            m_a = tl.minimum(tl.maximum(m - top_a, 0), cnt_a)
            m_b = tl.minimum(tl.maximum(m - top_b, 0), cnt_b)
            above = tl.minimum(top_a, m) - tl.minimum(top_b, m)
            member = im & (tl.where(ia, top_a, top_b) + rank < m)
            d_a = above + rank - tl.minimum(cross, m_b)
            d_b = above + tl.minimum(cross, m_a) - rank
            p = tl.exp(v_i)
            sign = tl.where(ia, tl.where(d_a >= 0, 1.0, -1.0), tl.where(d_b <= 0, 1.0, -1.0))
            s = tl.where(member, sign * p, 0.0)
            l1 += s
            g_a = tl.where(ia, s, 0.0)
            gsum += g_a
            tl.store(g_ptr + n * g_stride + col_i, g_a, mask=member & ia)
        tl.store(out_ptr + n, tl.reduce(l1, 0, SUM_COMBINE))
        tl.store(out_ptr + N + n, tl.reduce(gsum, 0, SUM_COMBINE))


def _window(hist_2NC: torch.Tensor, m: int, fine_bins: int):
    """``(lo, hi, scale, ok)`` per row from the coarse histograms: the window reaches down to the
    lower of the two m-th values' bins and up to the first occupied bin; ``ok`` is False where it
    is not finite (infinite or NaN values).
    """
    cum = hist_2NC.cumsum(-1)
    t = (cum < m).sum(-1).amax(0)  # the later threshold bin of the two sides
    t0 = ((hist_2NC.sum(0) > 0).to(torch.int32).cumsum(-1) == 0).sum(-1)
    inf_bits = 0x7F800000
    lo_bits = ((t + 1) << COARSE_SHIFT).clamp_max(inf_bits).to(torch.int32)
    hi_bits = (t0 << COARSE_SHIFT).clamp_max(inf_bits).to(torch.int32)
    lo = -lo_bits.view(torch.float32)
    hi = -hi_bits.view(torch.float32)
    ok = torch.isfinite(lo) & torch.isfinite(hi) & (lo < hi)
    lo, hi = torch.where(ok, lo, -1.0), torch.where(ok, hi, 0.0)
    return lo, hi, (fine_bins - 1) / (hi - lo), ok


def _bin_classes(
    hist_2NK: torch.Tensor, m: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, bin): the class code, the elements above the bin per side, and whether a row
    can be done by counts (both top-m sets inside the window, resolve bins within the buffer).
    """
    top_2NK = hist_2NK.cumsum(-1, dtype=torch.int32) - hist_2NK
    count_a, count_b = hist_2NK.unbind(0)
    top_a, top_b = top_2NK.unbind(0)
    m_a = (m - top_a).clamp(min=0).minimum(count_a)
    m_b = (m - top_b).clamp(min=0).minimum(count_b)
    above = top_a.clamp(max=m) - top_b.clamp(max=m)
    # the range of D over an a of the bin is [above - m_b, above + m_a - 1]; of a b,
    # [above - m_b + 1, above + m_a]
    a_plus, a_minus = above - m_b >= 0, above + m_a - 1 < 0
    b_plus, b_minus = above + m_a <= 0, above - m_b + 1 > 0
    a_open = (m_a > 0) & ((m_a < count_a) | ~(a_plus | a_minus))
    b_open = (m_b > 0) & ((m_b < count_b) | ~(b_plus | b_minus))
    resolve = a_open | b_open
    resolve[:, -1] = False  # below the window
    a_state = torch.where(m_a > 0, torch.where(a_plus, _PLUS, _MINUS), _NONE)
    b_state = torch.where(m_b > 0, torch.where(b_plus, _PLUS, _MINUS), _NONE)
    cls_NK = (a_state | (b_state << 2) | torch.where(resolve, _RESOLVE, 0)).to(torch.int8)
    cls_NK[:, -1] = 0
    inside = hist_2NK[..., :-1].sum(-1)
    resolve_count = (hist_2NK * resolve).sum(-1)
    ok_N = (inside >= m).all(0) & (resolve_count <= slots).all(0)
    return cls_NK, top_2NK, ok_N


def topm_l1(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    *,
    out_g: torch.Tensor | None = None,
    fine_bins: int = FINE_BINS,
    slots: int = RESOLVE_SLOTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topm_l1_reference` from counts (no sort), exact; see the module docstring.

    Falls back to :func:`topm_l1_reference` for the whole call when a row cannot be done by
    counts (non-finite values, or more than :data:`RESOLVE_SLOTS` elements to resolve: long
    runs of ties), and without Triton.

    Args:
        a_NA: [N, A] fp32 student log-probs, last dim contiguous.
        b_NB: [N, B] fp32 teacher log-probs, last dim contiguous.
        m: compared length, ``1 <= m <= min(A, B)``.
        out_g: where to write ``g`` ([N, A] fp32); may be ``a_NA`` itself (each value is read
            before its gradient is written).
        fine_bins: fine bins per row (a power of two); fewer bins, more elements to resolve.
        slots: buffer slots per row and side for the elements to resolve.

    Returns:
        ``(l1_N, g_NA, gsum_N)`` as :func:`topm_l1_reference`.
    """
    N, A = a_NA.shape
    B = b_NB.shape[1]
    if not 1 <= m <= min(A, B):
        raise ValueError(f"m={m} must be in [1, min(A={A}, B={B})]")
    if N == 0 or not use_triton(a_NA):
        return _reference_into(a_NA, b_NB, m, out_g)
    device = a_NA.device
    hist_2NC = torch.empty((2, N, COARSE_BINS), dtype=torch.int32, device=device)
    dummy = torch.empty(N, dtype=torch.float32, device=device)
    block = min(1024, next_power_of_2(max(A, B)))
    _hist_kernel[(N, 2)](
        a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0), dummy, dummy, dummy, hist_2NC, N,
        NBINS=COARSE_BINS, FINE=False, SHIFT=COARSE_SHIFT, BLOCK=block, num_warps=4,
    )  # fmt: skip
    lo_N, hi_N, scale_N, window_ok_N = _window(hist_2NC, m, fine_bins)
    del hist_2NC
    hist_2NK = torch.empty((2, N, fine_bins), dtype=torch.int32, device=device)
    _hist_kernel[(N, 2)](
        a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0), lo_N, hi_N, scale_N, hist_2NK, N,
        NBINS=fine_bins, FINE=True, SHIFT=COARSE_SHIFT, BLOCK=block, num_warps=4,
    )  # fmt: skip
    cls_NK, top_2NK, ok_N = _bin_classes(hist_2NK, m, slots)
    if not bool((ok_N & window_ok_N).all()):  # the one host sync: a row the counts cannot do
        return _reference_into(a_NA, b_NB, m, out_g)
    g_NA = torch.empty_like(a_NA) if out_g is None else out_g
    col_2NS = torch.empty((2, N, slots), dtype=torch.int32, device=device)
    val_2NS = torch.empty((2, N, slots), dtype=torch.float32, device=device)
    part_2N = torch.empty((2, N), dtype=torch.float32, device=device)
    _final_kernel[(N, 2)](
        a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0), lo_N, hi_N, scale_N, cls_NK,
        g_NA, g_NA.stride(0), col_2NS, val_2NS, part_2N, N,
        NBINS=fine_bins, SLOTS=slots, BLOCK=block, num_warps=4,
    )  # fmt: skip
    count_2N = (hist_2NK * (cls_NK >= _RESOLVE)).sum(-1, dtype=torch.int32)
    res_2N = torch.empty((2, N), dtype=torch.float32, device=device)
    _resolve_kernel[(N,)](
        col_2NS, val_2NS, count_2N, lo_N, hi_N, scale_N, hist_2NK, top_2NK, g_NA,
        g_NA.stride(0), res_2N, N, m, NBINS=fine_bins, SLOTS=slots, TILE=64,
        num_warps=4,
    )  # fmt: skip
    l1_N = part_2N.sum(0) + res_2N[0]
    gsum_N = part_2N[0] + res_2N[1]
    return l1_N, g_NA, gsum_N


def _reference_into(a_NA, b_NB, m, out_g):
    l1_N, g_NA, gsum_N = topm_l1_reference(a_NA, b_NB, m)
    if out_g is not None:
        g_NA = out_g.copy_(g_NA)
    return l1_N, g_NA, gsum_N
