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
bin at once: where neither ``D``'s sign nor membership in the top-m can change inside a bin (the
usual case), every element of the bin takes its sign from the counts above it; such a bin is
*decided*, the others are *open*. The grids are on the float bits of ``-x`` (an int that grows as
``x`` falls). Per row:

1. :func:`_hist_kernel`: the coarse histogram, K = 512 bins, 32 per binade of ``-x`` (bin 0
   everything above ``2^-8`` nats below 0, bin K - 2 everything below 248 nats, K - 1 NaN); or
   the caller's, counted as it wrote the rows
   (:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns` ``hist_NK=``).
2. :func:`_plan_kernel`: per bin, the counts above it, the members' signs and whether it is open
   (an open bin's code also holds its place among the row's open bins); :func:`_places_kernel`:
   each row's places in the tables of open bins and open elements, and their sizes.
3. :func:`_count_kernel`, a pass over both rows: the elements of decided bins add their signed
   probability (the student's write their state); those of open bins count in the open bin's
   fine histogram (256 bins, the coarse bin's span of bits split evenly) and are copied out to
   the row's records in column order, the student's then the teacher's (value, side and
   column; the plan knows how many of each).
4. :func:`_fine_plan_kernel`, per row and open bin: the fine bins classed alike.
5. :func:`_mark_kernel`, over the records only: the elements of decided fine bins add their
   sign (and state); the few in open fine bins go to the bin's list, ordered by fine bin.
6. :func:`_resolve_kernel`, per row and open bin: each listed element by pairwise counts within
   its fine bin (rank and the other side's count above); :func:`_row_sums_kernel` adds up the
   passes' partial sums per row.

The gradient is not written: :func:`topm_l1_signs` returns the student's states (int8: not a
member, ``+e^a``, ``-e^a``), which :func:`topm_gradient` or the gold loss's backward kernel turn
into it. A row the grids cannot do (a top-m set reaching below the coarse range, NaN, an open
coarse bin of more than B / 2 elements, more open elements than ``max_open_row``) goes to the
reference. The host waits for the device once, for the rows to refer and the numbers of open
bins and open elements (:func:`topm_l1_signs` ``before_wait`` queues other work before it, for
the GPU to run while the host waits); the lists are sized by the open elements, which they are
a part of, so the host then queues every pass to the end without waiting. A call whose every row
goes to the reference still runs the counts' kernels once per widths and ``m``, on two made-up
rows (:func:`_compile_counts`): compiled at the first call (a run's first step), not in the
first later step with a row they can do.

Legend: N rows, A / B the student / teacher columns, m the top-m length, K coarse bins,
F fine bins, P most open bins in a row, Q open bins in all, O open elements in all (the
records), L listed elements in all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._utils import (
    MAX_COMBINE,
    SUM_COMBINE,
    cdiv,
    interpret_mode,
    lazy_jit,
    next_power_of_2,
    read_later,
    tl,
    use_triton,
)

__all__ = [
    "TopmSigns",
    "plan_stats",
    "topm_gradient",
    "topm_l1",
    "topm_l1_reference",
    "topm_l1_signs",
]

#: Coarse bins: the top bits of the fp32 ``-x`` (32 per binade: its exponent and 5 mantissa
#: bits) over the 16 binades from ``2^-8`` up, clamped.
COARSE_PER_BINADE_BITS = 5
COARSE_SHIFT = 23 - COARSE_PER_BINADE_BITS
COARSE_BASE = (127 - 8) << COARSE_PER_BINADE_BITS  # the bits >> COARSE_SHIFT of 2^-8
COARSE_BINS = 16 << COARSE_PER_BINADE_BITS
BELOW_BIN = COARSE_BINS - 2  # -x >= 248 (and -inf log-probs): below every window
#: Fine bins per open coarse bin: its 2^COARSE_SHIFT values of the bits in 256 even steps.
FINE_BINS = 256
FINE_SHIFT = COARSE_SHIFT - 8
#: Elements of open coarse bins a row may have (more: the reference's row).
MAX_OPEN_ROW = 32768
#: Rows per step of :func:`_places_kernel` (one program), and per program of
#: :func:`_row_sums_kernel`.
PLACES_BLOCK = 1024
SUMS_BLOCK = 128
#: Tiles of :func:`_resolve_kernel`: listed elements per step, and per pairwise step.
RESOLVE_TILES = {"PAIR_I": 32, "PAIR_J": 32}
#: The full-row passes (:func:`_hist_kernel`, :func:`_count_kernel`): columns per step, columns
#: per program of the histogram pass (a multiple of the step; the count pass takes a whole row
#: side, its records' places following from one running count), warps.
PASS_TILES = {"block": 512, "columns": 16384, "warps": 4}
#: :func:`_mark_kernel`: records per step, records per program (a multiple of the step), warps.
MARK_TILES = {"block": 512, "records": 4096, "warps": 4}
#: Columns are packed with their side and fine bin in one int32.
_COL_BITS = 20
# The kernels' class code of a (row, bin): bits 0-1 the student's members, bits 2-3 the
# teacher's (0 none, 1 sign +, 2 sign -), bit 4 (16) open.


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

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _hist_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        hist_ptr,
        N,
        CHUNK,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
        K: tl.constexpr,
    ):
        # Program (row n, side, chunk of CHUNK columns), added into the row's coarse histogram:
        #   k = clamp((bits(-x) >> SHIFT) - BASE, 0, K - 2), K - 1 for NaN.
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        if side == 0:
            row = a_ptr + n * a_stride
            M = A
        else:
            row = b_ptr + n * b_stride
            M = B
        h = tl.full((K,), 0, tl.int32)
        first = tl.program_id(2) * CHUNK
        for start in range(first, tl.minimum(first + CHUNK, M), BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
            k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), K - 2)
            k = tl.where(x != x, K - 1, k)
            h += tl.histogram(k, K, mask=cm)
        tl.atomic_add(hist_ptr + (side * N + n) * K + tl.arange(0, K), h, sem="relaxed")

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _plan_kernel(
        hist_ptr,
        top_ptr,
        cls_ptr,
        opens_ptr,
        info_ptr,
        N,
        m,
        list_cap,
        BELOW: tl.constexpr,
        K: tl.constexpr,
    ):
        # Program (row n), over the K coarse bins k with counts ca / cb and the counts above
        # them ta / tb (exclusive prefix sums). The members of a bin on a side number
        # m_a = clamp(m - ta, 0, ca); D over the bin's a members ranges over
        # [above - m_b, above + m_a - 1], over its b members [above - m_b + 1, above + m_a],
        # above = min(ta, m) - min(tb, m). A bin is open when a side has members whose sign
        # or membership that range does not fix. Writes: tops, class codes (an open bin's with
        # its place p among the row's open bins in bits 8 and up), the open bins in order, and
        # (number of open bins, open elements of the row, row ok, the student's open elements).
        n = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K)
        ca = tl.load(hist_ptr + n * K + k)
        cb = tl.load(hist_ptr + (N + n) * K + k)
        ta = tl.associative_scan(ca, 0, SUM_COMBINE) - ca
        tb = tl.associative_scan(cb, 0, SUM_COMBINE) - cb
        tl.store(top_ptr + n * K + k, ta)
        tl.store(top_ptr + (N + n) * K + k, tb)
        m_a = tl.minimum(tl.maximum(m - ta, 0), ca)
        m_b = tl.minimum(tl.maximum(m - tb, 0), cb)
        above = tl.minimum(ta, m) - tl.minimum(tb, m)
        a_plus = above - m_b >= 0
        a_minus = above + m_a - 1 < 0
        b_plus = above + m_a <= 0
        b_minus = above - m_b + 1 > 0
        a_open = (m_a > 0) & ((m_a < ca) | ~(a_plus | a_minus))
        b_open = (m_b > 0) & ((m_b < cb) | ~(b_plus | b_minus))
        inside = k < BELOW
        is_open = (a_open | b_open) & inside
        a_state = tl.where(m_a > 0, tl.where(a_plus, 1, 2), 0)
        b_state = tl.where(m_b > 0, tl.where(b_plus, 1, 2), 0)
        one = is_open.to(tl.int32)
        place = tl.associative_scan(one, 0, SUM_COMBINE) - one
        code = tl.where(inside, a_state | (b_state << 2), 0) | tl.where(
            is_open, 16 | (place << 8), 0
        )
        tl.store(cls_ptr + n * K + k, code)
        tl.store(opens_ptr + n * K + place, k, mask=is_open)
        size = tl.where(is_open, ca + cb, 0)
        in_range = (tl.reduce(tl.where(inside, ca, 0), 0, SUM_COMBINE) >= m) & (
            tl.reduce(tl.where(inside, cb, 0), 0, SUM_COMBINE) >= m
        )
        no_nan = tl.reduce(tl.where(k == K - 1, ca + cb, 0), 0, SUM_COMBINE) == 0
        fits = tl.reduce(size, 0, MAX_COMBINE) <= list_cap
        tl.store(info_ptr + n * 4, tl.reduce(one, 0, SUM_COMBINE))
        tl.store(info_ptr + n * 4 + 1, tl.reduce(size, 0, SUM_COMBINE))
        tl.store(info_ptr + n * 4 + 2, (in_range & no_nan & fits).to(tl.int32))
        tl.store(info_ptr + n * 4 + 3, tl.reduce(tl.where(is_open, ca, 0), 0, SUM_COMBINE))

    @lazy_jit(
        do_not_specialize=("N", "max_open_row"),
        do_not_specialize_on_alignment=("obase_ptr", "sizes_ptr"),
    )
    def _places_kernel(
        info_ptr,
        qbase_ptr,
        obase_ptr,
        ocap_ptr,
        sizes_ptr,
        N,
        max_open_row,
        BLOCK: tl.constexpr,
    ):
        # One program over the rows in order. A row is done here when its plan says so and it
        # has at most max_open_row open elements; such a row's open bins and open elements
        # take their places after those of the rows before it:
        #   qbase[n] = open bins before n (-1: the reference's row), obase[n] = open elements
        #   before n, ocap[n] = n's open elements (0 when not done here);
        #   sizes = (most open bins in a row, open bins, rows not done, most open elements in
        #   a row, open elements).
        bins_before = tl.full([], 0, tl.int64)
        opens_before = tl.full([], 0, tl.int64)
        most_bins = tl.full([], 0, tl.int64)
        most_opens = tl.full([], 0, tl.int64)
        n_bad = tl.full([], 0, tl.int64)
        for n0 in range(0, N, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            nm = n < N
            bins = tl.load(info_ptr + n * 4, mask=nm, other=0).to(tl.int64)
            opens = tl.load(info_ptr + n * 4 + 1, mask=nm, other=0).to(tl.int64)
            ok = nm & (tl.load(info_ptr + n * 4 + 2, mask=nm, other=0) != 0)
            ok = ok & (opens <= max_open_row)
            bins = tl.where(ok, bins, 0)
            opens = tl.where(ok, opens, 0)
            bins_end = bins_before + tl.associative_scan(bins, 0, SUM_COMBINE)
            opens_end = opens_before + tl.associative_scan(opens, 0, SUM_COMBINE)
            tl.store(qbase_ptr + n, tl.where(ok, bins_end - bins, -1), mask=nm)
            tl.store(obase_ptr + n, opens_end - opens, mask=nm)
            tl.store(ocap_ptr + n, opens.to(tl.int32), mask=nm)
            bins_before += tl.reduce(bins, 0, SUM_COMBINE)
            opens_before += tl.reduce(opens, 0, SUM_COMBINE)
            most_bins = tl.maximum(most_bins, tl.reduce(bins, 0, MAX_COMBINE))
            most_opens = tl.maximum(most_opens, tl.reduce(opens, 0, MAX_COMBINE))
            n_bad += tl.reduce((nm & ~ok).to(tl.int64), 0, SUM_COMBINE)
        tl.store(sizes_ptr, most_bins)
        tl.store(sizes_ptr + 1, bins_before)
        tl.store(sizes_ptr + 2, n_bad)
        tl.store(sizes_ptr + 3, most_opens)
        tl.store(sizes_ptr + 4, opens_before)

    @lazy_jit(do_not_specialize=("N", "C2", "P"), do_not_specialize_on_alignment=("gsum_ptr",))
    def _row_sums_kernel(
        part_ptr,
        part2_ptr,
        res_ptr,
        l1_ptr,
        gsum_ptr,
        N,
        C2,
        P,
        BLOCK: tl.constexpr,
    ):
        # Rows n of one block: the partial sums of the count pass (part [2, N] fp32), the mark
        # pass (part2 [2, N, C2] fp64) and the resolve pass (res [N, P, 2] fp64) per side
        #   side_s = part[s] (as fp64) + sum part2[s],
        #   l1 = side_0 + side_1 + sum res[.., 0],  gsum = side_0 + sum res[.., 1]  (as fp32).
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        nm = n < N
        a2 = tl.load(part_ptr + n, mask=nm, other=0.0).to(tl.float64)
        b2 = tl.load(part_ptr + N + n, mask=nm, other=0.0).to(tl.float64)
        for c in range(0, C2):
            a2 += tl.load(part2_ptr + n * C2 + c, mask=nm, other=0.0)
            b2 += tl.load(part2_ptr + (N + n) * C2 + c, mask=nm, other=0.0)
        l1 = tl.full((BLOCK,), 0.0, tl.float64)
        gsum = tl.full((BLOCK,), 0.0, tl.float64)
        for p in range(0, P):
            l1 += tl.load(res_ptr + (n * P + p) * 2, mask=nm, other=0.0)
            gsum += tl.load(res_ptr + (n * P + p) * 2 + 1, mask=nm, other=0.0)
        tl.store(l1_ptr + n, (a2 + b2 + l1).to(tl.float32), mask=nm)
        tl.store(gsum_ptr + n, (a2 + gsum).to(tl.float32), mask=nm)

    @lazy_jit(  # N: the batch's chunk count; the row bases are carved from one buffer
        do_not_specialize=("N",), do_not_specialize_on_alignment=("obase_ptr",)
    )
    def _count_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        cls_ptr,
        info_ptr,
        qbase_ptr,
        fhist_ptr,
        state_ptr,
        state_stride,
        part_ptr,
        obase_ptr,
        ocap_ptr,
        rec_val_ptr,
        rec_key_ptr,
        N,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        FSHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
        K: tl.constexpr,
    ):
        # Program (row n, side), over the whole row; rows with qbase < 0 are the reference's.
        # An element of a decided coarse bin adds its signed probability (a's also write their
        # state: 0 not a member, 1 sign +, 2 sign -); one of an open bin k counts in the fine
        # histogram of that bin (q = qbase + p, p in bits 8 and up of its code):
        #   f = clamp((bits - lo_k) >> FSHIFT, 0, 255),  lo_k = (k + BASE) << SHIFT,
        # and is copied out to the row's records (obase[n] on, ocap[n] of them: the plan's
        # count of open elements, the student's first: info[n, 3] of them) in column order, as
        # value and key side << 28 | column.
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        qbase = tl.load(qbase_ptr + n)
        total = tl.full((BLOCK,), 0.0, tl.float32)
        if qbase >= 0:
            if side == 0:
                row = a_ptr + n * a_stride
                M = A
                fill = tl.full([], 0, tl.int32)
            else:
                row = b_ptr + n * b_stride
                M = B
                fill = tl.load(info_ptr + n * 4 + 3)  # after the student's open elements
            # the row's tables as scalar bases; per element int32 offsets
            cls_row = cls_ptr + n * K
            state_row = state_ptr + n * state_stride
            fhist_row = fhist_ptr + (qbase * 2 + side) * 256
            records = tl.load(obase_ptr + n)
            ocap = tl.load(ocap_ptr + n)
            c = tl.arange(0, BLOCK)
            x_next = tl.load(row + c, mask=c < M, other=0.0)
            for start in range(0, M, BLOCK):
                c = start + tl.arange(0, BLOCK)
                cm = c < M
                x = x_next
                # the next step's load, in flight while this one works
                x_next = tl.load(row + c + BLOCK, mask=c + BLOCK < M, other=0.0)
                bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
                k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), K - 2)
                code = tl.load(cls_row + k, mask=cm, other=0)
                state = (code >> (2 * side)) & 3
                is_open = ((code & 16) != 0) & cm
                p = tl.exp(x)
                s = tl.where(state == 1, p, tl.where(state == 2, -p, 0.0))
                total += tl.where(is_open, 0.0, s)
                if side == 0:
                    st = tl.where(is_open, 0, state).to(tl.int8)
                    tl.store(state_row + c, st, mask=cm)
                f = tl.minimum(tl.maximum((bits - ((k + BASE) << SHIFT)) >> FSHIFT, 0), 255)
                fi = (code >> 8) * 512 + f  # place p's fine bin f, this side
                tl.atomic_add(fhist_row + fi, 1, mask=is_open, sem="relaxed")
                one = is_open.to(tl.int32)
                at = fill + tl.associative_scan(one, 0, SUM_COMBINE) - one
                fill += tl.reduce(one, 0, SUM_COMBINE)
                kept = is_open & (at < ocap)  # (the plan's count: never more)
                tl.store(rec_val_ptr + records + at, x, mask=kept)
                tl.store(rec_key_ptr + records + at, (side << 28) | c, mask=kept)
        tl.store(part_ptr + side * N + n, tl.reduce(total, 0, SUM_COMBINE))

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _fine_plan_kernel(
        fhist_ptr,
        top_ptr,
        opens_ptr,
        info_ptr,
        qbase_ptr,
        fcode_ptr,
        foffs_ptr,
        nlist_ptr,
        N,
        m,
        K: tl.constexpr,
    ):
        # Program (row n, p-th open coarse bin k of the row, q = qbase + p): its fine bins
        # classed as _plan_kernel classes the coarse ones, from the fine histograms and the
        # counts above bin k. Writes the fine class codes and, for the open fine bins (whose
        # elements are listed and resolved one by one), where each starts in the bin's list,
        # and the list's length.
        n = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        qbase = tl.load(qbase_ptr + n)
        if (qbase >= 0) & (p < tl.load(info_ptr + n * 4)):
            q = qbase + p
            k = tl.load(opens_ptr + n * K + p)
            f = tl.arange(0, 256)
            ha = tl.load(fhist_ptr + q * 512 + f)
            hb = tl.load(fhist_ptr + q * 512 + 256 + f)
            ta = tl.load(top_ptr + n * K + k) + tl.associative_scan(ha, 0, SUM_COMBINE) - ha
            tb = tl.load(top_ptr + (N + n) * K + k) + tl.associative_scan(hb, 0, SUM_COMBINE) - hb
            m_a = tl.minimum(tl.maximum(m - ta, 0), ha)
            m_b = tl.minimum(tl.maximum(m - tb, 0), hb)
            above = tl.minimum(ta, m) - tl.minimum(tb, m)
            a_plus = above - m_b >= 0
            a_minus = above + m_a - 1 < 0
            b_plus = above + m_a <= 0
            b_minus = above - m_b + 1 > 0
            a_open = (m_a > 0) & ((m_a < ha) | ~(a_plus | a_minus))
            b_open = (m_b > 0) & ((m_b < hb) | ~(b_plus | b_minus))
            is_open = a_open | b_open
            a_state = tl.where(m_a > 0, tl.where(a_plus, 1, 2), 0)
            b_state = tl.where(m_b > 0, tl.where(b_plus, 1, 2), 0)
            code = a_state | (b_state << 2) | tl.where(is_open, 16, 0)
            listed = tl.where(is_open, ha + hb, 0)
            tl.store(fcode_ptr + q * 256 + f, code.to(tl.uint8))
            tl.store(foffs_ptr + q * 256 + f, tl.associative_scan(listed, 0, SUM_COMBINE) - listed)
            tl.store(nlist_ptr + q, tl.reduce(listed, 0, SUM_COMBINE))

    @lazy_jit(  # N: the batch's chunk count; NPROGS from its open elements; the row bases are
        # carved from one buffer
        do_not_specialize=("N", "NPROGS"),
        do_not_specialize_on_alignment=("obase_ptr",),
    )
    def _mark_kernel(
        rec_val_ptr,
        rec_key_ptr,
        obase_ptr,
        ocap_ptr,
        cls_ptr,
        qbase_ptr,
        fcode_ptr,
        foffs_ptr,
        lbase_ptr,
        list_val_ptr,
        list_key_ptr,
        state_ptr,
        state_stride,
        sums_ptr,
        N,
        RECORDS,
        NPROGS,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        FSHIFT: tl.constexpr,
        COL_BITS: tl.constexpr,
        BLOCK: tl.constexpr,
        K: tl.constexpr,
    ):
        # Program (row n, block of RECORDS of the row's records: the elements of its open
        # coarse bins, both sides). In a decided fine bin an element adds its signed
        # probability (a's write their state); in an open one it goes to its coarse bin's
        # list (from lbase[q]) at the fine bin's next place (foffs counts up), as value and key
        # side << 28 | f << COL_BITS | column. Sums per side in fp64.
        n = tl.program_id(0).to(tl.int64)
        qbase = tl.load(qbase_ptr + n)
        first = tl.program_id(1) * RECORDS
        total_a = tl.full((BLOCK,), 0.0, tl.float64)
        total_b = tl.full((BLOCK,), 0.0, tl.float64)
        if qbase >= 0:
            obase = tl.load(obase_ptr + n)
            count = tl.load(ocap_ptr + n)
            cls_row = cls_ptr + n * K
            state_row = state_ptr + n * state_stride
            fcode_row = fcode_ptr + qbase * 256
            foffs_row = foffs_ptr + qbase * 256
            lbase_row = lbase_ptr + qbase
            for start in range(first, tl.minimum(first + RECORDS, count), BLOCK):
                i = start + tl.arange(0, BLOCK)
                im = i < count
                x = tl.load(rec_val_ptr + obase + i, mask=im, other=0.0)
                key = tl.load(rec_key_ptr + obase + i, mask=im, other=0)
                side = key >> 28
                c = key & ((1 << COL_BITS) - 1)
                bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
                k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), K - 2)
                code = tl.load(cls_row + k, mask=im, other=0)
                f = tl.minimum(tl.maximum((bits - ((k + BASE) << SHIFT)) >> FSHIFT, 0), 255)
                fi = (code >> 8) * 256 + f  # place p's fine bin f
                fcode = tl.load(fcode_row + fi, mask=im, other=0).to(tl.int32)
                state = (fcode >> (2 * side)) & 3
                listed = im & ((fcode & 16) != 0)
                p = tl.exp(x)
                s = tl.where(state == 1, p, tl.where(state == 2, -p, 0.0))
                s = tl.where(im & ~listed, s, 0.0).to(tl.float64)
                total_a += tl.where(side == 0, s, 0.0)
                total_b += tl.where(side == 0, 0.0, s)
                tl.store(state_row + c, state.to(tl.int8), mask=im & ~listed & (side == 0))
                at = tl.load(lbase_row + (code >> 8), mask=listed, other=0)
                at += tl.atomic_add(foffs_row + fi, 1, mask=listed, sem="relaxed")
                tl.store(list_val_ptr + at, x, mask=listed)
                tl.store(list_key_ptr + at, (side << 28) | (f << COL_BITS) | c, mask=listed)
        block = tl.program_id(1)
        tl.store(sums_ptr + n * NPROGS + block, tl.reduce(total_a, 0, SUM_COMBINE))
        tl.store(sums_ptr + (N + n) * NPROGS + block, tl.reduce(total_b, 0, SUM_COMBINE))

    @lazy_jit(do_not_specialize=("N", "P"))  # N: the batch's chunk count; P its most open bins
    def _resolve_kernel(
        fhist_ptr,
        top_ptr,
        opens_ptr,
        info_ptr,
        qbase_ptr,
        fcode_ptr,
        lbase_ptr,
        list_val_ptr,
        list_key_ptr,
        state_ptr,
        state_stride,
        res_ptr,
        N,
        P,
        m,
        COL_BITS: tl.constexpr,
        PAIR_I: tl.constexpr,
        PAIR_J: tl.constexpr,
        K: tl.constexpr,
    ):
        # Program (row n, p-th open coarse bin k of the row): its list, ordered by fine bin.
        # Each listed i is compared with its fine bin's span: rank = same-side elements above
        # it, cross = other-side elements above it (an a walks before an equal b), and
        #   member <=> top_side + rank < m
        #   D(a) = min(ta, m) + rank - min(tb, m) - min(cross, m_b),  + iff D >= 0
        #   D(b) = min(ta, m) + min(cross, m_a) - min(tb, m) - rank,  + iff D <= 0
        # with ta / tb / m_a / m_b those of its fine bin. The student's listed elements write
        # their state; sums in fp64 per (n, p).
        n = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        qbase = tl.load(qbase_ptr + n)
        l1 = tl.full([], 0, tl.float64)
        gsum = tl.full([], 0, tl.float64)
        if (qbase >= 0) & (p < tl.load(info_ptr + n * 4)):
            q = qbase + p
            k = tl.load(opens_ptr + n * K + p)
            f = tl.arange(0, 256)
            ha = tl.load(fhist_ptr + q * 512 + f)
            hb = tl.load(fhist_ptr + q * 512 + 256 + f)
            ta = tl.load(top_ptr + n * K + k) + tl.associative_scan(ha, 0, SUM_COMBINE) - ha
            tb = tl.load(top_ptr + (N + n) * K + k) + tl.associative_scan(hb, 0, SUM_COMBINE) - hb
            fcode = tl.load(fcode_ptr + q * 256 + f).to(tl.int32)
            listed = tl.where((fcode & 16) != 0, ha + hb, 0)
            offs = tl.associative_scan(listed, 0, SUM_COMBINE) - listed
            n_list = tl.reduce(listed, 0, SUM_COMBINE)
            start = tl.load(lbase_ptr + q)
            lval = list_val_ptr + start
            lkey = list_key_ptr + start
            for i0 in range(0, n_list, PAIR_I):
                i = i0 + tl.arange(0, PAIR_I)
                im = i < n_list
                key_i = tl.load(lkey + i, mask=im, other=0)
                v_i = tl.load(lval + i, mask=im, other=0.0)
                ia = (key_i >> 28) == 0
                f_i = (key_i >> COL_BITS) & 255
                col_i = key_i & ((1 << COL_BITS) - 1)
                f_lo = -tl.reduce(tl.where(im, -f_i, -255), 0, MAX_COMBINE)
                f_hi = tl.reduce(tl.where(im, f_i, 0), 0, MAX_COMBINE)
                j_lo = tl.reduce(tl.where(f == f_lo, offs, 0), 0, SUM_COMBINE)
                j_hi = tl.reduce(tl.where(f == f_hi, offs + listed, 0), 0, SUM_COMBINE)
                rank = tl.full((PAIR_I,), 0, tl.int32)
                cross = tl.full((PAIR_I,), 0, tl.int32)
                for j0 in range(j_lo, j_hi, PAIR_J):
                    j = j0 + tl.arange(0, PAIR_J)
                    jm = j < j_hi
                    key_j = tl.load(lkey + j, mask=jm, other=0)
                    v_j = tl.load(lval + j, mask=jm, other=0.0)
                    same = (f_i[:, None] == ((key_j >> COL_BITS) & 255)[None, :]) & jm[None, :]
                    ja = (key_j >> 28) == 0
                    same_side = ia[:, None] == ja[None, :]
                    col_j = key_j & ((1 << COL_BITS) - 1)
                    gt = v_j[None, :] > v_i[:, None]
                    eq = v_j[None, :] == v_i[:, None]
                    above_same = gt | (eq & (col_j[None, :] < col_i[:, None]))
                    # an a (i) sees b's strictly above it; a b (i) sees a's above or equal
                    above_cross = gt | (eq & ja[None, :])
                    rank += tl.reduce((same & same_side & above_same).to(tl.int32), 1, SUM_COMBINE)
                    cross += tl.reduce(
                        (same & (~same_side) & above_cross).to(tl.int32), 1, SUM_COMBINE
                    )
                ta_i = tl.gather(ta, f_i, 0)
                tb_i = tl.gather(tb, f_i, 0)
                ma_i = tl.minimum(tl.maximum(m - ta_i, 0), tl.gather(ha, f_i, 0))
                mb_i = tl.minimum(tl.maximum(m - tb_i, 0), tl.gather(hb, f_i, 0))
                above_i = tl.minimum(ta_i, m) - tl.minimum(tb_i, m)
                member = im & (tl.where(ia, ta_i, tb_i) + rank < m)
                d_a = above_i + rank - tl.minimum(cross, mb_i)
                d_b = above_i + tl.minimum(cross, ma_i) - rank
                plus = tl.where(ia, d_a >= 0, d_b <= 0)
                s = tl.where(member, tl.where(plus, 1.0, -1.0) * tl.exp(v_i), 0.0)
                l1 += tl.reduce(s.to(tl.float64), 0, SUM_COMBINE)
                gsum += tl.reduce(tl.where(ia, s, 0.0).to(tl.float64), 0, SUM_COMBINE)
                state = tl.where(member, tl.where(plus, 1, 2), 0).to(tl.int8)
                tl.store(state_ptr + n * state_stride + col_i, state, mask=im & ia)
        tl.store(res_ptr + (n * P + p) * 2, l1)
        tl.store(res_ptr + (n * P + p) * 2 + 1, gsum)


class _Plan(NamedTuple):
    """The coarse pass's result per row (int32): histograms and the counts above each bin
    ``[2, N, K]``; class codes and the open bins in order ``[N, K]``; ``info_N4`` = (open bins,
    open elements, row ok, -)."""

    hist_2NK: torch.Tensor
    top_2NK: torch.Tensor
    cls_NK: torch.Tensor
    opens_NK: torch.Tensor
    info_N4: torch.Tensor


class TopmSigns(NamedTuple):
    """:func:`topm_l1_signs`'s result: the L1, and per student element the state of its
    gradient (0: not in the top-m, gradient 0; 1: ``+e^a``; 2: ``-e^a``); the gradient itself
    is made where it is needed (:func:`topm_gradient`, the gold loss's backward kernel).

    Attributes:
        l1_N: [N] fp32 sorted top-m L1.
        gsum_N: [N] fp32 row sums of the gradient.
        state_NA: [N, A] int8 the states.
    """

    l1_N: torch.Tensor
    gsum_N: torch.Tensor
    state_NA: torch.Tensor


def _pass_block(a_NA: torch.Tensor, b_NB: torch.Tensor) -> int:
    """Columns per step of the full-row passes (:data:`PASS_TILES`)."""
    return min(PASS_TILES["block"], next_power_of_2(max(a_NA.shape[1], b_NB.shape[1])))


def _coarse_plan(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    list_cap: int,
    hist_2NK: torch.Tensor | None = None,
) -> _Plan:
    """Coarse histograms of both rows (:func:`_hist_kernel`, unless given) and their plan
    (:func:`_plan_kernel`)."""
    N = a_NA.shape[0]
    i32 = dict(dtype=torch.int32, device=a_NA.device)
    if hist_2NK is None:
        # the histogram pass splits a row side over programs of PASS_TILES["columns"]
        block = _pass_block(a_NA, b_NB)
        chunk = block * max(1, PASS_TILES["columns"] // block)
        nchunks = cdiv(max(a_NA.shape[1], b_NB.shape[1]), chunk)
        hist_2NK = torch.zeros((2, N, COARSE_BINS), **i32)
        _hist_kernel[(N, 2, nchunks)](
            a_NA, b_NB, a_NA.shape[1], b_NB.shape[1], a_NA.stride(0), b_NB.stride(0), hist_2NK,
            N, chunk, K=COARSE_BINS, BASE=COARSE_BASE, SHIFT=COARSE_SHIFT, BLOCK=block, num_warps=4,
        )  # fmt: skip
    plan = _Plan(
        hist_2NK,
        torch.empty((2, N, COARSE_BINS), **i32),
        *(torch.empty((N, COARSE_BINS), **i32) for _ in range(2)),
        torch.empty((N, 4), **i32),
    )
    _plan_kernel[(N,)](*plan, N, m, list_cap, K=COARSE_BINS, BELOW=BELOW_BIN, num_warps=4)
    return plan


def plan_stats(a_NA: torch.Tensor, b_NB: torch.Tensor, m: int) -> dict[str, float]:
    """How :func:`topm_l1` would split these rows (for benchmarks): open coarse bins and their
    elements per row (mean, max) and the rows its counts cannot do (before ``max_open_row``).

    Args:
        a_NA: [N, A] fp32 student log-probs.
        b_NB: [N, B] fp32 teacher log-probs.
        m: compared length.

    Returns:
        ``open_bins_mean``, ``open_bins_max``, ``open_elements_mean``, ``open_elements_max``,
        ``rows_not_ok``.
    """
    info_N4 = _coarse_plan(a_NA, b_NB, m, b_NB.shape[1] // 2).info_N4.double()
    return {
        "open_bins_mean": info_N4[:, 0].mean().item(),
        "open_bins_max": info_N4[:, 0].max().item(),
        "open_elements_mean": info_N4[:, 1].mean().item(),
        "open_elements_max": info_N4[:, 1].max().item(),
        "rows_not_ok": int((info_N4[:, 2] == 0).sum().item()),
    }


def topm_l1(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    *,
    out_g: torch.Tensor | None = None,
    max_open_row: int = MAX_OPEN_ROW,
    hist_2NK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topm_l1_reference` from counts (no sort), exact; see the module docstring.

    :func:`topm_l1_signs`, then the gradient from its states (:func:`topm_gradient`).

    Args:
        a_NA, b_NB, m, max_open_row, hist_2NK: as :func:`topm_l1_signs`.
        out_g: where to write ``g`` ([N, A] fp32); may be ``a_NA`` itself.

    Returns:
        ``(l1_N, g_NA, gsum_N)`` as :func:`topm_l1_reference`.
    """
    signs = topm_l1_signs(a_NA, b_NB, m, max_open_row=max_open_row, hist_2NK=hist_2NK)
    g_NA = topm_gradient(a_NA, signs.state_NA)
    if out_g is not None:
        g_NA = out_g.copy_(g_NA)
    return signs.l1_N, g_NA, signs.gsum_N


def topm_l1_signs(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    *,
    max_open_row: int = MAX_OPEN_ROW,
    hist_2NK: torch.Tensor | None = None,
    before_wait: Callable[[], None] | None = None,
) -> TopmSigns:
    """The sorted top-m L1 of ``e^a`` against ``e^b`` per row and the state of each student
    element's gradient, from counts; see the module docstring. ``a`` and ``b`` are only read.

    The host waits for the device once (see the module docstring); ``before_wait`` is called
    before the wait to queue work the top-m does not need, which the GPU then runs while the
    host waits.

    Rows the counts cannot do go to :func:`topm_l1_reference` (so does everything without
    Triton).

    Args:
        a_NA: [N, A] fp32 student log-probs, last dim contiguous.
        b_NB: [N, B] fp32 teacher log-probs, last dim contiguous.
        m: compared length, ``1 <= m <= min(A, B)``.
        max_open_row: elements of open coarse bins a row may have (a row with more goes to the
            reference).
        hist_2NK: [2, N, K] int32 coarse histograms of ``a`` and ``b`` when the caller made
            them with the rows (:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns`
            ``hist_NK=``); None: counted here (one more pass over both rows).
        before_wait: called (no arguments) before the host wait, or None.

    Returns:
        :class:`TopmSigns`.

    Raises:
        ValueError: ``m`` outside ``[1, min(A, B)]``, or ``hist_2NK`` of the wrong shape.
    """
    N, A = a_NA.shape
    B = b_NB.shape[1]
    if not 1 <= m <= min(A, B):
        raise ValueError(f"m={m} must be in [1, min(A={A}, B={B})]")
    if hist_2NK is not None and tuple(hist_2NK.shape) != (2, N, COARSE_BINS):
        raise ValueError(
            f"hist_2NK must be [2, {N}, {COARSE_BINS}] int32, got {tuple(hist_2NK.shape)}"
        )
    if N == 0 or not use_triton(a_NA) or max(A, B) >= 1 << _COL_BITS:
        return _reference_signs(a_NA, b_NB, m)
    device = a_NA.device
    list_cap = B // 2  # the most elements an open coarse bin may hold
    plan = _coarse_plan(a_NA, b_NB, m, list_cap, hist_2NK)
    # each row's places in the open bins' and open elements' tables (qbase -1: the reference's
    # row), and the sizes: open bins (most in a row, all), rows not done, open elements (same)
    i32 = dict(dtype=torch.int32, device=device)
    qbase_N, obase_N, sizes_5 = torch.empty(2 * N + 5, dtype=torch.long, device=device).split(
        [N, N, 5]
    )
    ocap_N = torch.empty(N, **i32)
    _places_kernel[(1,)](
        plan.info_N4, qbase_N, obase_N, ocap_N, sizes_5, N, max_open_row,
        BLOCK=PLACES_BLOCK, num_warps=4,
    )  # fmt: skip
    sizes = read_later(sizes_5)
    if before_wait is not None:
        before_wait()
    max_bins, n_bins, n_bad, max_open, n_open = sizes()  # wait for the device
    widths = _widths(A, B, m, device)
    if n_bad == N:
        if widths not in _COUNTS_COMPILED:
            _compile_counts(A, B, m, device)
        return _reference_signs(a_NA, b_NB, m)
    _COUNTS_COMPILED.add(widths)
    bins = dict(K=COARSE_BINS, BASE=COARSE_BASE, SHIFT=COARSE_SHIFT, FSHIFT=FINE_SHIFT)
    P, Q = max(max_bins, 1), max(n_bins, 1)  # (no empty grids or pointers)
    fhist_Q2F = torch.zeros((Q, 2, FINE_BINS), **i32)
    state_NA = torch.empty((N, A), dtype=torch.int8, device=device)
    part_2N = torch.empty((2, N), dtype=torch.float32, device=device)
    # the open elements' records, a run per row
    rec_val_O = torch.empty(max(n_open, 1), dtype=torch.float32, device=device)
    rec_key_O = torch.empty(max(n_open, 1), **i32)
    _count_kernel[(N, 2)](
        a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0), plan.cls_NK, plan.info_N4, qbase_N,
        fhist_Q2F, state_NA, state_NA.stride(0), part_2N, obase_N, ocap_N, rec_val_O, rec_key_O,
        N, **bins, BLOCK=_pass_block(a_NA, b_NB), num_warps=PASS_TILES["warps"],
    )  # fmt: skip
    fcode_QF = torch.empty((Q, FINE_BINS), dtype=torch.uint8, device=device)
    foffs_QF = torch.empty((Q, FINE_BINS), **i32)
    nlist_Q = torch.zeros(Q, dtype=torch.long, device=device)
    _fine_plan_kernel[(N, P)](
        fhist_Q2F, plan.top_2NK, plan.opens_NK, plan.info_N4, qbase_N, fcode_QF, foffs_QF,
        nlist_Q, N, m, K=COARSE_BINS,
    )  # fmt: skip
    lbase_Q = nlist_Q.cumsum(0) - nlist_Q
    records = MARK_TILES["records"]
    nprogs = max(cdiv(max_open, records), 1)
    part2_2NC = torch.empty((2, N, nprogs), dtype=torch.float64, device=device)
    res_NP2 = torch.empty((N, P, 2), dtype=torch.float64, device=device)
    # the lists: the open elements of open fine bins, so never more than the records
    list_val_L = torch.empty(max(n_open, 1), dtype=torch.float32, device=device)
    list_key_L = torch.empty(max(n_open, 1), **i32)
    _mark_kernel[(N, nprogs)](
        rec_val_O, rec_key_O, obase_N, ocap_N, plan.cls_NK, qbase_N, fcode_QF, foffs_QF,
        lbase_Q, list_val_L, list_key_L, state_NA, state_NA.stride(0), part2_2NC, N, records,
        nprogs, **bins, COL_BITS=_COL_BITS, BLOCK=MARK_TILES["block"],
        num_warps=MARK_TILES["warps"],
    )  # fmt: skip
    _resolve_kernel[(N, P)](
        fhist_Q2F, plan.top_2NK, plan.opens_NK, plan.info_N4, qbase_N, fcode_QF, lbase_Q,
        list_val_L, list_key_L, state_NA, state_NA.stride(0), res_NP2, N, P, m,
        K=COARSE_BINS, COL_BITS=_COL_BITS, **RESOLVE_TILES, num_warps=4,
    )  # fmt: skip
    l1_N, gsum_N = torch.empty(2 * N, dtype=torch.float32, device=device).split([N, N])
    _row_sums_kernel[(cdiv(N, SUMS_BLOCK),)](
        part_2N, part2_2NC, res_NP2, l1_N, gsum_N, N, nprogs, P, BLOCK=SUMS_BLOCK
    )
    if n_bad:
        bad = (qbase_N < 0).nonzero().flatten()
        ref = _reference_signs(a_NA[bad], b_NB[bad], m)
        l1_N[bad], gsum_N[bad], state_NA[bad] = ref
    return TopmSigns(l1_N, gsum_N, state_NA)


#: ``(A, B, m, device, interpreted)`` of the rows the counts' kernels have run on in this process.
_COUNTS_COMPILED: set[tuple[int, int, int, str, bool]] = set()


def _compile_counts(A: int, B: int, m: int, device: torch.device) -> None:
    """Run the counts' kernels once on two rows of these widths that they can do, so that
    Triton compiles them now.

    A call whose every row goes to the reference launches none of them (a young model's rows
    are nearly flat: their top-m bins hold too many elements); the first later batch with a row
    the counts can do would compile five kernels mid-run, seconds on that step (at 4x2048 gold
    beside its teacher: 2.4 s on one step). Called from the first such call (a run's first
    step, which compiles the loss's other kernels too). The rows: log-probs spread evenly over
    1..200 nats, a few hundred elements a coarse bin. Same widths, same ``m``: the variants the
    real rows use (the row count and the counts of open bins and elements are not specialized
    on).
    """
    a_2A = -torch.linspace(1.0, 200.0, A, device=device).expand(2, A).contiguous()
    b_2B = -torch.linspace(1.5, 200.0, B, device=device).expand(2, B).contiguous()
    _COUNTS_COMPILED.add(_widths(A, B, m, device))  # tried once, whether the rows do or not
    topm_l1_signs(a_2A, b_2B, m)


def _widths(A: int, B: int, m: int, device: torch.device) -> tuple[int, int, int, str, bool]:
    """The key of :data:`_COUNTS_COMPILED`: what the counts' kernels compile for."""
    return A, B, m, str(device), interpret_mode()


def topm_gradient(a_NA: torch.Tensor, state_NA: torch.Tensor) -> torch.Tensor:
    """``d l1 / d a`` ([N, A] fp32) from :func:`topm_l1_signs`'s states: ``e^a`` where 1,
    ``-e^a`` where 2, else 0."""
    p_NA = a_NA.exp()
    return torch.where(state_NA == 1, p_NA, torch.where(state_NA == 2, -p_NA, 0.0))


def _reference_signs(a_NA, b_NB, m) -> TopmSigns:
    """:func:`topm_l1_reference` as :class:`TopmSigns`."""
    l1_N, g_NA, gsum_N = topm_l1_reference(a_NA, b_NB, m)
    state_NA = torch.where(g_NA > 0, 1, torch.where(g_NA < 0, 2, 0)).to(torch.int8)
    return TopmSigns(l1_N, gsum_N, state_NA)
