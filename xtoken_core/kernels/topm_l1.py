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
needs counts of larger values, which a histogram of both rows over a common grid gives for every
bin at once: where ``D`` cannot change sign inside a bin (the usual case), every element of the
bin takes its sign from the counts above it. The grids are on the float bits of ``-x`` (an int
that grows as ``x`` falls). Per row:

1. :func:`_hist_kernel`, coarse: 256 bins, 16 per binade of ``-x`` (bin 0 everything above
   ``2^-8`` nats below 0, bin 254 everything below 240 nats, bin 255 NaN).
2. :func:`_classes` (torch, on the histograms): per bin and side, member or not and the sign;
   a bin where that is open is resolved element by element when it is small, else refined.
3. :func:`_hist_kernel`, fine: 255 equal bins (of the bits) from the first refined coarse bin to
   the last, classed alike; an open fine bin is resolved element by element.
4. :func:`_final_kernel`: one pass over both rows: the signs of decided elements summed, ``g``
   written (0 where undecided), the elements to resolve appended to a per-row buffer.
5. :func:`_resolve_kernel`: pairwise counts within each resolve group -> rank, membership, ``D``.

A row the grids cannot do (a top-m set reaching below the coarse range, NaN, more elements to
resolve than the buffer holds: long runs of ties, a teacher close to the student at every rank)
goes to the reference; finding those rows is the one host sync.

Legend: N rows, A / B the student / teacher columns, m the top-m length, K coarse bins,
F fine bins, G resolve groups (coarse bins, then fine bins), S buffer slots per row and side.
"""

from __future__ import annotations

import torch

from ._utils import MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, next_power_of_2, tl, use_triton

__all__ = ["topm_l1", "topm_l1_reference"]

#: Coarse bins: bits 30..19 of the fp32 ``-x`` (16 per binade) from ``2^-8`` up, clamped.
COARSE_BINS = 256
COARSE_SHIFT = 19
COARSE_BASE = (127 - 8) << 4  # the bits >> 19 of 2^-8
BELOW_BIN = COARSE_BINS - 2  # -x >= 240 (and -inf log-probs): below every window
NAN_BIN = COARSE_BINS - 1
#: Fine bins over the refined range (the last one: outside it).
FINE_BINS = 256
#: Open bins with at most this many elements (both sides) are resolved without refining.
DIRECT_MAX = 64
#: Buffer slots per row and side for the elements to resolve.
RESOLVE_SLOTS = 4096
#: Columns are packed with their resolve group in one int32.
_COL_BITS = 20

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
        k0_ptr,
        k1_ptr,
        scale_ptr,
        hist_ptr,
        N,
        CHUNK,
        FINE: tl.constexpr,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row n, side, chunk of CHUNK columns), added into the row's: the coarse histogram of the row (bins as in the module
        # docstring) or, FINE, the fine one: bin floor((bits - lo) * scale) (at most 254) for
        # the elements of the refined coarse bins [k0, k1] (lo: the first bits of k0), the last
        # bin elsewhere.
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        if side == 0:
            row = a_ptr + n * a_stride
            M = A
        else:
            row = b_ptr + n * b_stride
            M = B
        if FINE:
            k0 = tl.load(k0_ptr + n)
            k1 = tl.load(k1_ptr + n)
            lo = (k0 + BASE) << SHIFT
            scale = tl.load(scale_ptr + n)
        h = tl.full((256,), 0, tl.int32)
        first = tl.program_id(2) * CHUNK
        for start in range(first, tl.minimum(first + CHUNK, M), BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
            k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), 254)
            k = tl.where(x != x, 255, k)
            k = tl.where(cm, k, 254)  # padding lanes: below the range (fine: no slot)
            if FINE:
                f = tl.minimum(
                    tl.maximum(((bits - lo).to(tl.float32) * scale).to(tl.int32), 0), 254
                )
                k = tl.where((k >= k0) & (k <= k1) & cm, f, 255)
            h += tl.histogram(k, 256)
        tl.atomic_add(hist_ptr + (side * N + n) * 256 + tl.arange(0, 256), h, sem="relaxed")

    @lazy_jit
    def _final_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        cls_ptr,
        k0_ptr,
        k1_ptr,
        scale_ptr,
        fine_ptr,
        g_ptr,
        g_stride,
        key_ptr,
        val_ptr,
        off_ptr,
        fill_ptr,
        part_ptr,
        N,
        CHUNK,
        NCHUNKS,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        SLOTS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row n, side, chunk of CHUNK columns): every element of a decided bin adds its
        # signed probability (the student's is also its gradient, written to g: 0 where not a
        # member or undecided); an element to resolve goes to the side's buffer, at its group's
        # offset plus the group's fill count (group << 20 | column, value).
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
        k0 = tl.load(k0_ptr + n)
        k1 = tl.load(k1_ptr + n)
        lo = (k0 + BASE) << SHIFT
        scale = tl.load(scale_ptr + n)
        groups = (side * N + n) * 512
        total = tl.full((BLOCK,), 0, tl.float32)
        first = tl.program_id(2) * CHUNK
        for start in range(first, tl.minimum(first + CHUNK, M), BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
            k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), 254)
            f = tl.minimum(tl.maximum(((bits - lo).to(tl.float32) * scale).to(tl.int32), 0), 254)
            refined = (k >= k0) & (k <= k1)
            code = tl.load(cls_ptr + n * 256 + k, mask=cm & ~refined, other=0)
            fcode = tl.load(fine_ptr + n * 256 + f, mask=cm & refined, other=0)
            code = tl.where(refined, fcode, code).to(tl.int32)
            group = tl.where(refined, 256 + f, k)
            state = (code >> shift) & 3
            res = ((code & 16) != 0) & cm
            p = tl.exp(x)
            s = tl.where(state == 1, p, tl.where(state == 2, -p, 0.0))
            s = tl.where(res, 0.0, s)
            total += s
            if side == 0:
                tl.store(g_ptr + n * g_stride + c, s, mask=cm)
            at = tl.load(off_ptr + groups + group, mask=res, other=0)
            at += tl.atomic_add(fill_ptr + groups + group, 1, mask=res, sem="relaxed")
            keep = res & (at < SLOTS)
            slot = (side * N + n) * SLOTS + at
            tl.store(key_ptr + slot, (group << 20) | c, mask=keep)
            tl.store(val_ptr + slot, x, mask=keep)
        tl.store(
            part_ptr + (side * N + n) * NCHUNKS + tl.program_id(2), tl.reduce(total, 0, SUM_COMBINE)
        )

    @lazy_jit
    def _resolve_kernel(
        key_ptr,
        val_ptr,
        count_ptr,
        off_ptr,
        rcount_ptr,
        top_ptr,
        cnt_ptr,
        g_ptr,
        g_stride,
        out_ptr,
        N,
        m,
        SLOTS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        # Program (row n): the buffered elements of both sides as one list, i < na from the
        # student; each side's buffer is ordered by group, so the elements i is compared with
        # are the spans of the groups of its tile. For each i: rank = same-side elements of its
        # group above it, cross = other-side elements of its group above it (an a walks before
        # an equal b). Then, with top / cnt the side's elements above the group / in it:
        #   member  <=> top_side + rank < m
        #   D(a) = min(topA, m) + rank - min(topB, m) - min(cross, mB),  + iff D >= 0
        #   D(b) = min(topA, m) + min(cross, mA) - min(topB, m) - rank,  + iff D <= 0
        # with mA = clamp(m - topA, 0, cntA) the members of the group (mB likewise).
        n = tl.program_id(0).to(tl.int64)
        na = tl.minimum(tl.load(count_ptr + n), SLOTS)
        nb = tl.minimum(tl.load(count_ptr + N + n), SLOTS)
        total = na + nb
        base_a = n * SLOTS
        base_b = (N + n) * SLOTS
        ga = n * 512
        gb = (N + n) * 512
        l1 = tl.full((TILE,), 0, tl.float64)
        gsum = tl.full((TILE,), 0, tl.float64)
        for i0 in range(0, total, TILE):
            i = i0 + tl.arange(0, TILE)
            im = i < total
            ia = i < na
            off_i = tl.where(ia, base_a + i, base_b + i - na)
            key_i = tl.load(key_ptr + off_i, mask=im, other=0)
            v_i = tl.load(val_ptr + off_i, mask=im, other=0.0)
            grp_i = key_i >> 20
            col_i = key_i & 0xFFFFF
            g_lo = tl.reduce(tl.where(im, -grp_i, -511), 0, MAX_COMBINE) * -1
            g_hi = tl.reduce(tl.where(im, grp_i, 0), 0, MAX_COMBINE)
            rank = tl.full((TILE,), 0, tl.int32)
            cross = tl.full((TILE,), 0, tl.int32)
            for side in range(2):
                groups = tl.where(side == 0, ga, gb)
                base = tl.where(side == 0, base_a, base_b)
                j_lo = tl.load(off_ptr + groups + g_lo)
                j_hi = tl.load(off_ptr + groups + g_hi) + tl.load(rcount_ptr + groups + g_hi)
                for j0 in range(j_lo, j_hi, TILE):
                    j = j0 + tl.arange(0, TILE)
                    jm = j < j_hi
                    key_j = tl.load(key_ptr + base + j, mask=jm, other=0)
                    v_j = tl.load(val_ptr + base + j, mask=jm, other=0.0)
                    same = (grp_i[:, None] == (key_j >> 20)[None, :]) & jm[None, :]
                    col_j = key_j & 0xFFFFF
                    gt = v_j[None, :] > v_i[:, None]
                    eq = v_j[None, :] == v_i[:, None]
                    same_side = ia[:, None] == (side == 0)
                    above_same = gt | (eq & (col_j[None, :] < col_i[:, None]))
                    # an a (i) sees b's strictly above it; a b (i) sees a's above or equal
                    above_cross = gt | (eq & (side == 0))
                    rank += tl.reduce((same & same_side & above_same).to(tl.int32), 1, SUM_COMBINE)
                    cross += tl.reduce(
                        (same & (~same_side) & above_cross).to(tl.int32), 1, SUM_COMBINE
                    )
            top_a = tl.load(top_ptr + ga + grp_i, mask=im, other=0)
            top_b = tl.load(top_ptr + gb + grp_i, mask=im, other=0)
            cnt_a = tl.load(cnt_ptr + ga + grp_i, mask=im, other=0)
            cnt_b = tl.load(cnt_ptr + gb + grp_i, mask=im, other=0)
            m_a = tl.minimum(tl.maximum(m - top_a, 0), cnt_a)
            m_b = tl.minimum(tl.maximum(m - top_b, 0), cnt_b)
            above = tl.minimum(top_a, m) - tl.minimum(top_b, m)
            member = im & (tl.where(ia, top_a, top_b) + rank < m)
            d_a = above + rank - tl.minimum(cross, m_b)
            d_b = above + tl.minimum(cross, m_a) - rank
            p = tl.exp(v_i)
            sign = tl.where(ia, tl.where(d_a >= 0, 1.0, -1.0), tl.where(d_b <= 0, 1.0, -1.0))
            s = tl.where(member, sign * p, 0.0)
            # fp64 sums: the buffer's order within a group varies from run to run
            l1 += s.to(tl.float64)
            g_a = tl.where(ia, s, 0.0)
            gsum += g_a.to(tl.float64)
            tl.store(g_ptr + n * g_stride + col_i, g_a, mask=member & ia)
        tl.store(out_ptr + n, tl.reduce(l1, 0, SUM_COMBINE).to(tl.float32))
        tl.store(out_ptr + N + n, tl.reduce(gsum, 0, SUM_COMBINE).to(tl.float32))


def _classes(count_2NG: torch.Tensor, top_2NG: torch.Tensor, m: int):
    """Per (row, group) from the counts in it and above it per side: the members' sign code
    (student bits 0-1, teacher bits 2-3) and whether the group is open (a member's sign or the
    membership of an element is not fixed by the counts)."""
    count_a, count_b = count_2NG.unbind(0)
    top_a, top_b = top_2NG.unbind(0)
    m_a = (m - top_a).clamp(min=0).minimum(count_a)
    m_b = (m - top_b).clamp(min=0).minimum(count_b)
    above = top_a.clamp(max=m) - top_b.clamp(max=m)
    # D over an a of the group ranges over [above - m_b, above + m_a - 1]; over a b,
    # [above - m_b + 1, above + m_a]
    a_plus, a_minus = above - m_b >= 0, above + m_a - 1 < 0
    b_plus, b_minus = above + m_a <= 0, above - m_b + 1 > 0
    a_open = (m_a > 0) & ((m_a < count_a) | ~(a_plus | a_minus))
    b_open = (m_b > 0) & ((m_b < count_b) | ~(b_plus | b_minus))
    a_state = torch.where(m_a > 0, torch.where(a_plus, _PLUS, _MINUS), _NONE)
    b_state = torch.where(m_b > 0, torch.where(b_plus, _PLUS, _MINUS), _NONE)
    return a_state | (b_state << 2), a_open | b_open


def _above(count_2NG: torch.Tensor) -> torch.Tensor:
    """Elements in the groups before each group (exclusive cumsum over the last dim)."""
    return count_2NG.cumsum(-1, dtype=torch.int32) - count_2NG


def _coarse_plan(coarse_2NK: torch.Tensor, m: int, direct_max: int):
    """Coarse classes ``cls_NK``, tops ``top_2NK``, resolve bins, the refined coarse bins per
    row (``k0_N`` to ``k1_N``, fine bins per bit ``scale_N``) and whether the row is in range.

    An open bin of at most ``direct_max`` elements is resolved as it is; the range from the
    first larger one to the last is refined (rows without one get an empty range)."""
    top_2NK = _above(coarse_2NK)
    code_NK, open_NK = _classes(coarse_2NK, top_2NK, m)
    open_NK[:, BELOW_BIN:] = False
    code_NK[:, BELOW_BIN:] = _NONE
    small_NK = coarse_2NK.sum(0) <= direct_max
    refine_NK = open_NK & ~small_NK
    any_N = refine_NK.any(-1)
    k0_N = torch.where(any_N, refine_NK.int().argmax(-1), 1).int()
    k1_N = torch.where(any_N, COARSE_BINS - 1 - refine_NK.flip(-1).int().argmax(-1), 0).int()
    k = torch.arange(COARSE_BINS, device=coarse_2NK.device)
    inside_NK = (k >= k0_N[:, None]) & (k <= k1_N[:, None])
    resolve_NK = open_NK & small_NK & ~inside_NK
    cls_NK = (code_NK | (resolve_NK.to(torch.int32) << 4)).to(torch.uint8)
    width_N = ((k1_N - k0_N + 1) << COARSE_SHIFT).clamp_min(1).to(torch.float32)
    scale_N = torch.where(any_N, (FINE_BINS - 1) / width_N, 0.0)
    ok_N = (
        (coarse_2NK[..., :BELOW_BIN].sum(-1) >= m).all(0)  # both top-m sets in range
        & (coarse_2NK[..., NAN_BIN] == 0).all(0)
    )
    return cls_NK, top_2NK, resolve_NK, (k0_N, k1_N, scale_N), ok_N


def _fine_plan(fine_2NF: torch.Tensor, top_2NK: torch.Tensor, k0_N: torch.Tensor, m: int):
    """Fine classes ``fine_NF`` and the fine bins' counts and tops ``[2, N, F]`` (the last bin,
    outside the range, zeroed)."""
    count_2NF = fine_2NF.clone()
    count_2NF[..., -1] = 0
    base_2N1 = top_2NK.gather(2, k0_N.long().view(1, -1, 1).expand(2, -1, 1))
    top_2NF = base_2N1 + _above(count_2NF)
    code_NF, open_NF = _classes(count_2NF, top_2NF, m)
    fine_NF = (code_NF | (open_NF.to(torch.int32) << 4)).to(torch.uint8)
    return fine_NF, count_2NF, top_2NF


def topm_l1(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    *,
    out_g: torch.Tensor | None = None,
    direct_max: int = DIRECT_MAX,
    slots: int = RESOLVE_SLOTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topm_l1_reference` from counts (no sort), exact; see the module docstring.

    Rows the counts cannot do go to :func:`topm_l1_reference` (so does everything without
    Triton).

    Args:
        a_NA: [N, A] fp32 student log-probs, last dim contiguous.
        b_NB: [N, B] fp32 teacher log-probs, last dim contiguous.
        m: compared length, ``1 <= m <= min(A, B)``.
        out_g: where to write ``g`` ([N, A] fp32); may be ``a_NA`` itself (each value is read
            before its gradient is written).
        direct_max: open bins with at most this many elements are resolved without refining.
        slots: buffer slots per row and side for the elements to resolve.

    Returns:
        ``(l1_N, g_NA, gsum_N)`` as :func:`topm_l1_reference`.
    """
    N, A = a_NA.shape
    B = b_NB.shape[1]
    if not 1 <= m <= min(A, B):
        raise ValueError(f"m={m} must be in [1, min(A={A}, B={B})]")
    if N == 0 or not use_triton(a_NA) or max(A, B) >= 1 << _COL_BITS:
        return _reference_into(a_NA, b_NB, m, out_g)
    device = a_NA.device
    block = min(1024, next_power_of_2(max(A, B)))
    chunk = block * max(1, 8192 // block)  # columns per program
    nchunks = cdiv(max(A, B), chunk)
    grid = (N, 2, nchunks)
    rows = (a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0))
    bins = dict(BASE=COARSE_BASE, SHIFT=COARSE_SHIFT)  # the coarse grid
    coarse_2NK = torch.zeros((2, N, COARSE_BINS), dtype=torch.int32, device=device)
    none = coarse_2NK  # the coarse pass reads no range
    _hist_kernel[grid](
        *rows, none, none, none, coarse_2NK, N, chunk, FINE=False, **bins, BLOCK=block, num_warps=4
    )
    cls_NK, top_2NK, resolve_NK, (k0_N, k1_N, scale_N), ok_N = _coarse_plan(
        coarse_2NK, m, direct_max
    )
    fine_2NF = torch.zeros((2, N, FINE_BINS), dtype=torch.int32, device=device)
    _hist_kernel[grid](
        *rows, k0_N, k1_N, scale_N, fine_2NF, N, chunk, FINE=True, **bins, BLOCK=block, num_warps=4
    )
    fine_NF, count_fine_2NF, top_fine_2NF = _fine_plan(fine_2NF, top_2NK, k0_N, m)
    # resolve groups: the coarse bins, then the fine bins; the buffer in group order
    count_2NG = torch.cat([coarse_2NK, count_fine_2NF], -1)
    top_2NG = torch.cat([top_2NK, top_fine_2NF], -1)
    resolve_NG = torch.cat([resolve_NK, (fine_NF & _RESOLVE) != 0], -1)
    rcount_2NG = count_2NG * resolve_NG
    off_2NG = _above(rcount_2NG)
    buffered_2N = rcount_2NG.sum(-1, dtype=torch.int32)
    ok_N &= (buffered_2N <= slots).all(0)
    bad = (~ok_N).nonzero().flatten()  # the one host sync
    if bad.numel() == N:
        return _reference_into(a_NA, b_NB, m, out_g)
    if bad.numel():  # before g (which may be a) is written
        l1_bad, g_bad, gsum_bad = _reference_into(a_NA[bad], b_NB[bad], m, None)
    buffered_2N *= ok_N  # nothing to resolve in those rows
    g_NA = torch.empty_like(a_NA) if out_g is None else out_g
    key_2NS = torch.empty((2, N, slots), dtype=torch.int32, device=device)
    val_2NS = torch.empty((2, N, slots), dtype=torch.float32, device=device)
    fill_2NG = torch.zeros_like(off_2NG)
    part_2NC = torch.empty((2, N, nchunks), dtype=torch.float32, device=device)
    _final_kernel[grid](
        *rows, cls_NK, k0_N, k1_N, scale_N, fine_NF, g_NA, g_NA.stride(0), key_2NS, val_2NS,
        off_2NG, fill_2NG, part_2NC, N, chunk, nchunks, **bins, SLOTS=slots, BLOCK=block, num_warps=4,
    )  # fmt: skip
    res_2N = torch.empty((2, N), dtype=torch.float32, device=device)
    _resolve_kernel[(N,)](
        key_2NS, val_2NS, buffered_2N, off_2NG, rcount_2NG, top_2NG, count_2NG, g_NA,
        g_NA.stride(0), res_2N, N, m, SLOTS=slots, TILE=64, num_warps=4,
    )  # fmt: skip
    part_2N = part_2NC.sum(-1)
    l1_N = part_2N.sum(0) + res_2N[0]
    gsum_N = part_2N[0] + res_2N[1]
    if bad.numel():
        l1_N[bad], g_NA[bad], gsum_N[bad] = l1_bad, g_bad, gsum_bad
    return l1_N, g_NA, gsum_N


def _reference_into(a_NA, b_NB, m, out_g):
    l1_N, g_NA, gsum_N = topm_l1_reference(a_NA, b_NB, m)
    if out_g is not None:
        g_NA = out_g.copy_(g_NA)
    return l1_N, g_NA, gsum_N
