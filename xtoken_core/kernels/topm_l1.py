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

1. :func:`_hist_kernel`: the coarse histogram, 256 bins, 16 per binade of ``-x`` (bin 0
   everything above ``2^-8`` nats below 0, bin 254 everything below 240 nats, bin 255 NaN); or
   the caller's, counted as it wrote the rows
   (:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns` ``hist_NK=``).
2. :func:`_plan_kernel`: per bin, the counts above it, the members' signs and whether it is open;
   where each open bin's elements go in a pool (rows one after another).
3. :func:`_scatter_kernel`: one pass over both rows: the elements of decided bins add their signed
   probability (the student's is also its gradient, written to ``g``); the elements of open bins
   are copied to the pool, grouped by bin.
4. :func:`_refine_kernel`: per row and open bin, from the pool only: a fine histogram of 256
   bins (the coarse bin's span of bits, split evenly), classed alike; the elements of decided
   fine bins add their sign, those of open fine bins go to a list ordered by fine bin and are
   resolved by pairwise counts within their fine bin (rank and the other side's count above).

A row the grids cannot do (a top-m set reaching below the coarse range, NaN, an open bin larger
than the list, more open elements than a row may pool) goes to the reference; finding those rows
and the pool's size is the one wait for the device.

Legend: N rows, A / B the student / teacher columns, m the top-m length, K coarse bins,
F fine bins, P pool slots, L list slots per row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._utils import MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, next_power_of_2, tl, use_triton

__all__ = ["plan_stats", "topm_l1", "topm_l1_reference"]

#: Coarse bins: bits 30..19 of the fp32 ``-x`` (16 per binade) from ``2^-8`` up, clamped.
COARSE_BINS = 256
COARSE_SHIFT = 19
COARSE_BASE = (127 - 8) << 4  # the bits >> 19 of 2^-8
BELOW_BIN = COARSE_BINS - 2  # -x >= 240 (and -inf log-probs): below every window
#: Fine bins per open coarse bin: its 2^19 values of the bits in steps of 2^11.
FINE_BINS = 256
FINE_SHIFT = COARSE_SHIFT - 8
#: Pool slots a row may take for the elements of its open coarse bins (more: the reference's).
MAX_POOL_ROW = 32768
#: Tiles of :func:`_refine_kernel`: pool elements per step, listed elements per pairwise step.
REFINE_TILES = {"TILE": 1024, "PAIR_I": 32, "PAIR_J": 64}
#: Columns are packed with their side and fine bin in one int32.
_COL_BITS = 20
#: Rows of the per-row table of :func:`_refine_kernel`: fine tops and counts per side, class
#: codes, list offsets.
_TABLE_ROWS = 6
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
    ):
        # Program (row n, side, chunk of CHUNK columns), added into the row's coarse histogram:
        #   k = clamp((bits(-x) >> SHIFT) - BASE, 0, 254), 255 for NaN.
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        if side == 0:
            row = a_ptr + n * a_stride
            M = A
        else:
            row = b_ptr + n * b_stride
            M = B
        h = tl.full((256,), 0, tl.int32)
        first = tl.program_id(2) * CHUNK
        for start in range(first, tl.minimum(first + CHUNK, M), BLOCK):
            c = start + tl.arange(0, BLOCK)
            cm = c < M
            x = tl.load(row + c, mask=cm, other=0.0)
            bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
            k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), 254)
            k = tl.where(x != x, 255, k)
            h += tl.histogram(k, 256, mask=cm)
        tl.atomic_add(hist_ptr + (side * N + n) * 256 + tl.arange(0, 256), h, sem="relaxed")

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _plan_kernel(
        hist_ptr,
        top_ptr,
        cls_ptr,
        loc_ptr,
        opens_ptr,
        info_ptr,
        N,
        m,
        list_cap,
        BELOW: tl.constexpr,
    ):
        # Program (row n), over the 256 coarse bins k with counts ca / cb and the counts above
        # them ta / tb (exclusive prefix sums). The members of a bin on a side number
        # m_a = clamp(m - ta, 0, ca); D over the bin's a members ranges over
        # [above - m_b, above + m_a - 1], over its b members [above - m_b + 1, above + m_a],
        # above = min(ta, m) - min(tb, m). A bin is open when a side has members whose sign
        # or membership that range does not fix. Writes: tops, class codes, the pool offset of
        # each open bin within the row (its a's, then its b's), the list of open bins, and
        # (number of open bins, pool slots of the row, row ok).
        n = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, 256)
        ca = tl.load(hist_ptr + n * 256 + k)
        cb = tl.load(hist_ptr + (N + n) * 256 + k)
        ta = tl.associative_scan(ca, 0, SUM_COMBINE) - ca
        tb = tl.associative_scan(cb, 0, SUM_COMBINE) - cb
        tl.store(top_ptr + n * 256 + k, ta)
        tl.store(top_ptr + (N + n) * 256 + k, tb)
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
        code = tl.where(inside, a_state | (b_state << 2), 0) | tl.where(is_open, 16, 0)
        tl.store(cls_ptr + n * 256 + k, code)
        size = tl.where(is_open, ca + cb, 0)
        tl.store(loc_ptr + n * 256 + k, tl.associative_scan(size, 0, SUM_COMBINE) - size)
        one = is_open.to(tl.int32)
        tl.store(
            opens_ptr + n * 256 + tl.associative_scan(one, 0, SUM_COMBINE) - one, k, mask=is_open
        )
        in_range = (tl.reduce(tl.where(inside, ca, 0), 0, SUM_COMBINE) >= m) & (
            tl.reduce(tl.where(inside, cb, 0), 0, SUM_COMBINE) >= m
        )
        no_nan = tl.reduce(tl.where(k == 255, ca + cb, 0), 0, SUM_COMBINE) == 0
        fits = tl.reduce(size, 0, MAX_COMBINE) <= list_cap
        tl.store(info_ptr + n * 4, tl.reduce(one, 0, SUM_COMBINE))
        tl.store(info_ptr + n * 4 + 1, tl.reduce(size, 0, SUM_COMBINE))
        tl.store(info_ptr + n * 4 + 2, (in_range & no_nan & fits).to(tl.int32))

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _scatter_kernel(
        a_ptr,
        b_ptr,
        A,
        B,
        a_stride,
        b_stride,
        hist_ptr,
        cls_ptr,
        loc_ptr,
        base_ptr,
        fill_ptr,
        pool_val_ptr,
        pool_col_ptr,
        g_ptr,
        g_stride,
        part_ptr,
        N,
        CHUNK,
        NCHUNKS,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row n, side, chunk of CHUNK columns); rows with base < 0 are the
        # reference's. An element of a decided bin adds its signed probability (the student's is
        # also its gradient, written to g: 0 where not a member or open); an element of an open
        # bin k goes to the pool at base + loc[k] (+ ca[k] for the teacher) + the bin's fill.
        n = tl.program_id(0).to(tl.int64)
        side = tl.program_id(1)
        base = tl.load(base_ptr + n)
        total = tl.full((BLOCK,), 0.0, tl.float32)
        if base >= 0:
            if side == 0:
                row = a_ptr + n * a_stride
                M = A
            else:
                row = b_ptr + n * b_stride
                M = B
            first = tl.program_id(2) * CHUNK
            for start in range(first, tl.minimum(first + CHUNK, M), BLOCK):
                c = start + tl.arange(0, BLOCK)
                cm = c < M
                x = tl.load(row + c, mask=cm, other=0.0)
                bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
                k = tl.minimum(tl.maximum((bits >> SHIFT) - BASE, 0), 254)
                code = tl.load(cls_ptr + n * 256 + k, mask=cm, other=0)
                state = (code >> (2 * side)) & 3
                is_open = ((code & 16) != 0) & cm
                p = tl.exp(x)
                s = tl.where(state == 1, p, tl.where(state == 2, -p, 0.0))
                s = tl.where(is_open, 0.0, s)
                total += s
                if side == 0:
                    tl.store(g_ptr + n * g_stride + c, s, mask=cm)
                at = tl.load(loc_ptr + n * 256 + k, mask=is_open, other=0)
                if side == 1:
                    at += tl.load(hist_ptr + n * 256 + k, mask=is_open, other=0)
                at += tl.atomic_add(
                    fill_ptr + (side * N + n) * 256 + k, 1, mask=is_open, sem="relaxed"
                )
                tl.store(pool_val_ptr + base + at, x, mask=is_open)
                tl.store(pool_col_ptr + base + at, c, mask=is_open)
        tl.store(
            part_ptr + (side * N + n) * NCHUNKS + tl.program_id(2), tl.reduce(total, 0, SUM_COMBINE)
        )

    @lazy_jit(do_not_specialize=("N",))  # N: the batch's chunk count
    def _refine_kernel(
        pool_val_ptr,
        pool_col_ptr,
        base_ptr,
        info_ptr,
        opens_ptr,
        loc_ptr,
        hist_ptr,
        top_ptr,
        qbase_ptr,
        ffill_ptr,
        list_val_ptr,
        list_key_ptr,
        g_ptr,
        g_stride,
        res_ptr,
        N,
        P,
        m,
        BASE: tl.constexpr,
        SHIFT: tl.constexpr,
        FSHIFT: tl.constexpr,
        COL_BITS: tl.constexpr,
        TILE: tl.constexpr,
        PAIR_I: tl.constexpr,
        PAIR_J: tl.constexpr,
    ):
        # Program (row n, p-th open coarse bin k of the row), from the bin's pool slots (ca a's,
        # then cb b's). Fine bin f = clamp((bits - lo_k) >> FSHIFT, 0, 255); the fine
        # histograms and tops class the fine bins as _plan_kernel does the coarse ones;
        # elements of decided fine bins add their sign, those of open ones go to the bin's list
        # (at the bin's pool slots in the list buffers: values, and keys
        # side << 28 | f << 20 | column), ordered by fine bin. Each listed i is then compared
        # with its fine bin's span: rank = same-side elements above it, cross = other-side
        # elements above it (an a walks before an equal b), and
        #   member <=> top_side + rank < m
        #   D(a) = min(ta, m) + rank - min(tb, m) - min(cross, m_b),  + iff D >= 0
        #   D(b) = min(ta, m) + min(cross, m_a) - min(tb, m) - rank,  + iff D <= 0
        # with ta / tb / m_a / m_b those of its fine bin. Sums in fp64 (the pool's order within
        # a bin varies from run to run), written per (n, p).
        n = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        base = tl.load(base_ptr + n)
        l1 = tl.full([], 0, tl.float64)
        gsum = tl.full([], 0, tl.float64)
        if (base >= 0) & (p < tl.load(info_ptr + n * 4)):
            k = tl.load(opens_ptr + n * 256 + p)
            ca = tl.load(hist_ptr + n * 256 + k)
            cb = tl.load(hist_ptr + (N + n) * 256 + k)
            start = base + tl.load(loc_ptr + n * 256 + k)
            lo = (k + BASE) << SHIFT
            size = ca + cb
            f = tl.arange(0, 256)
            ha = tl.full((256,), 0, tl.int32)
            hb = tl.full((256,), 0, tl.int32)
            for i0 in range(0, size, TILE):
                i = i0 + tl.arange(0, TILE)
                im = i < size
                x = tl.load(pool_val_ptr + start + i, mask=im, other=0.0)
                bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
                fb = tl.minimum(tl.maximum((bits - lo) >> FSHIFT, 0), 255)
                ha += tl.histogram(fb, 256, mask=im & (i < ca))
                hb += tl.histogram(fb, 256, mask=im & (i >= ca))
            ta = tl.load(top_ptr + n * 256 + k) + tl.associative_scan(ha, 0, SUM_COMBINE) - ha
            tb = tl.load(top_ptr + (N + n) * 256 + k) + tl.associative_scan(hb, 0, SUM_COMBINE) - hb
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
            offs = tl.associative_scan(listed, 0, SUM_COMBINE) - listed
            n_list = tl.reduce(listed, 0, SUM_COMBINE)
            ffill = ffill_ptr + (tl.load(qbase_ptr + n) + p) * 256
            lval = list_val_ptr + start
            lkey = list_key_ptr + start
            grow = g_ptr + n * g_stride
            for i0 in range(0, size, TILE):
                i = i0 + tl.arange(0, TILE)
                im = i < size
                is_a = i < ca
                x = tl.load(pool_val_ptr + start + i, mask=im, other=0.0)
                col = tl.load(pool_col_ptr + start + i, mask=im, other=0)
                bits = tl.maximum((-x).to(tl.int32, bitcast=True), 0)
                fb = tl.minimum(tl.maximum((bits - lo) >> FSHIFT, 0), 255)
                ecode = tl.gather(code, fb, 0)
                lst = ((ecode & 16) != 0) & im
                state = tl.where(is_a, ecode & 3, (ecode >> 2) & 3)
                px = tl.exp(x)
                s = tl.where(state == 1, px, tl.where(state == 2, -px, 0.0))
                s = tl.where(lst | ~im, 0.0, s)
                g_a = tl.where(is_a, s, 0.0)
                l1 += tl.reduce(s.to(tl.float64), 0, SUM_COMBINE)
                gsum += tl.reduce(g_a.to(tl.float64), 0, SUM_COMBINE)
                tl.store(grow + col, g_a, mask=im & is_a & ~lst)
                at = tl.gather(offs, fb, 0)
                at += tl.atomic_add(ffill + fb, 1, mask=lst, sem="relaxed")
                key = (tl.where(is_a, 0, 1) << 28) | (fb << COL_BITS) | col
                tl.store(lval + at, x, mask=lst)
                tl.store(lkey + at, key, mask=lst)
            tl.debug_barrier()  # the list is written before any of it is read
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
                sign = tl.where(ia, tl.where(d_a >= 0, 1.0, -1.0), tl.where(d_b <= 0, 1.0, -1.0))
                s = tl.where(member, sign * tl.exp(v_i), 0.0)
                g_a = tl.where(ia, s, 0.0)
                l1 += tl.reduce(s.to(tl.float64), 0, SUM_COMBINE)
                gsum += tl.reduce(g_a.to(tl.float64), 0, SUM_COMBINE)
                tl.store(grow + col_i, g_a, mask=im & ia)
        tl.store(res_ptr + (n * P + p) * 2, l1)
        tl.store(res_ptr + (n * P + p) * 2 + 1, gsum)


class _Plan(NamedTuple):
    """The coarse pass's result per row (int32): histograms and the counts above each bin
    ``[2, N, K]``, class codes, pool offsets within the row and the open bins in order
    ``[N, K]``, and ``info_N4`` = (open bins, pool slots, row ok, -)."""

    hist_2NK: torch.Tensor
    top_2NK: torch.Tensor
    cls_NK: torch.Tensor
    loc_NK: torch.Tensor
    opens_NK: torch.Tensor
    info_N4: torch.Tensor


def _grid(a_NA: torch.Tensor, b_NB: torch.Tensor):
    """Block, columns per program, chunks per row of the full-row passes."""
    most = max(a_NA.shape[1], b_NB.shape[1])
    block = min(1024, next_power_of_2(most))
    chunk = block * max(1, 8192 // block)
    return block, chunk, cdiv(most, chunk)


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
        block, chunk, nchunks = _grid(a_NA, b_NB)
        hist_2NK = torch.zeros((2, N, COARSE_BINS), **i32)
        _hist_kernel[(N, 2, nchunks)](
            a_NA, b_NB, a_NA.shape[1], b_NB.shape[1], a_NA.stride(0), b_NB.stride(0), hist_2NK,
            N, chunk, BASE=COARSE_BASE, SHIFT=COARSE_SHIFT, BLOCK=block, num_warps=4,
        )  # fmt: skip
    plan = _Plan(
        hist_2NK,
        torch.empty((2, N, COARSE_BINS), **i32),
        *(torch.empty((N, COARSE_BINS), **i32) for _ in range(3)),
        torch.empty((N, 4), **i32),
    )
    _plan_kernel[(N,)](*plan, N, m, list_cap, BELOW=BELOW_BIN, num_warps=4)
    return plan


def plan_stats(a_NA: torch.Tensor, b_NB: torch.Tensor, m: int) -> dict[str, float]:
    """How :func:`topm_l1` would split these rows (for benchmarks): open coarse bins and pool
    slots per row (mean, max) and the rows its counts cannot do (before the pool's limit).

    Args:
        a_NA: [N, A] fp32 student log-probs.
        b_NB: [N, B] fp32 teacher log-probs.
        m: compared length.

    Returns:
        ``open_bins_mean``, ``open_bins_max``, ``pool_slots_mean``, ``pool_slots_max``,
        ``rows_not_ok``.
    """
    info_N4 = _coarse_plan(a_NA, b_NB, m, b_NB.shape[1] // 2).info_N4.double()
    return {
        "open_bins_mean": info_N4[:, 0].mean().item(),
        "open_bins_max": info_N4[:, 0].max().item(),
        "pool_slots_mean": info_N4[:, 1].mean().item(),
        "pool_slots_max": info_N4[:, 1].max().item(),
        "rows_not_ok": int((info_N4[:, 2] == 0).sum().item()),
    }


def topm_l1(
    a_NA: torch.Tensor,
    b_NB: torch.Tensor,
    m: int,
    *,
    out_g: torch.Tensor | None = None,
    overwrite_b: bool = False,
    max_pool_row: int = MAX_POOL_ROW,
    hist_2NK: torch.Tensor | None = None,
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
        overwrite_b: ``b_NB`` may be used as scratch (its values are lost); else a buffer of its
            size is allocated for the lists of open fine bins.
        max_pool_row: pool slots a row may take for the elements of its open coarse bins
            (a row that needs more goes to the reference); the pool is sized to the rows kept.
        hist_2NK: [2, N, 256] int32 coarse histograms of ``a`` and ``b`` when the caller made
            them with the rows (:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns`
            ``hist_NK=``); None: counted here (one more pass over both rows).

    Returns:
        ``(l1_N, g_NA, gsum_N)`` as :func:`topm_l1_reference`.

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
        return _reference_into(a_NA, b_NB, m, out_g)
    device = a_NA.device
    list_cap = B // 2  # the most elements an open coarse bin may hold
    plan = _coarse_plan(a_NA, b_NB, m, list_cap, hist_2NK)
    ok_N = (plan.info_N4[:, 2] != 0) & (plan.info_N4[:, 1] <= max_pool_row)
    slots_N = plan.info_N4[:, 1].long() * ok_N
    opens_N = plan.info_N4[:, 0].long() * ok_N
    end_N = slots_N.cumsum(0)
    qend_N = opens_N.cumsum(0)
    # the one wait for the device: pool size, open bins (most in a row, all), rows not ok
    pool_size, max_open, total_open, n_bad = torch.stack(
        [end_N[-1], opens_N.max(), qend_N[-1], N - ok_N.sum()]
    ).tolist()
    if n_bad == N:
        return _reference_into(a_NA, b_NB, m, out_g)
    if n_bad:  # before g (which may be a) and the lists (which may be b) are written
        bad = (~ok_N).nonzero().flatten()
        l1_bad, g_bad, gsum_bad = _reference_into(a_NA[bad], b_NB[bad], m, None)
    base_N = torch.where(ok_N, end_N - slots_N, -1)  # -1: the reference's row
    g_NA = torch.empty_like(a_NA) if out_g is None else out_g
    block, chunk, nchunks = _grid(a_NA, b_NB)
    i32 = dict(dtype=torch.int32, device=device)
    pool_val_P = torch.empty(pool_size, dtype=torch.float32, device=device)
    pool_col_P = torch.empty(pool_size, **i32)
    fill_2NK = torch.zeros((2, N, COARSE_BINS), **i32)
    part_2NC = torch.empty((2, N, nchunks), dtype=torch.float32, device=device)
    _scatter_kernel[(N, 2, nchunks)](
        a_NA, b_NB, A, B, a_NA.stride(0), b_NB.stride(0), plan.hist_2NK, plan.cls_NK,
        plan.loc_NK, base_N, fill_2NK, pool_val_P, pool_col_P, g_NA, g_NA.stride(0), part_2NC,
        N, chunk, nchunks, BASE=COARSE_BASE, SHIFT=COARSE_SHIFT, BLOCK=block, num_warps=4,
    )  # fmt: skip
    # the lists of open fine bins take their bin's pool slots in a buffer of values and one of
    # keys: b's storage when it may be overwritten and is large enough
    if overwrite_b and b_NB.is_contiguous() and b_NB.numel() >= 2 * pool_size:
        list_2P = b_NB.view(-1)[: 2 * pool_size].view(2, pool_size)
    else:
        list_2P = torch.empty((2, pool_size), dtype=torch.float32, device=device)
    ffill_QF = torch.zeros((total_open, FINE_BINS), **i32)
    res_NP2 = torch.empty((N, max(max_open, 1), 2), dtype=torch.float64, device=device)
    _refine_kernel[(N, max(max_open, 1))](
        pool_val_P, pool_col_P, base_N, plan.info_N4, plan.opens_NK, plan.loc_NK, plan.hist_2NK,
        plan.top_2NK, qend_N - opens_N, ffill_QF, list_2P[0], list_2P[1].view(torch.int32),
        g_NA, g_NA.stride(0), res_NP2, N, max(max_open, 1), m, BASE=COARSE_BASE,
        SHIFT=COARSE_SHIFT, FSHIFT=FINE_SHIFT, COL_BITS=_COL_BITS, **REFINE_TILES, num_warps=4,
    )  # fmt: skip
    res_2N = res_NP2.sum(1).T.float()
    part_2N = part_2NC.sum(-1)
    l1_N = part_2N.sum(0) + res_2N[0]
    gsum_N = part_2N[0] + res_2N[1]
    if n_bad:
        l1_N[bad], g_NA[bad], gsum_N[bad] = l1_bad, g_bad, gsum_bad
    return l1_N, g_NA, gsum_N


def _reference_into(a_NA, b_NB, m, out_g):
    l1_N, g_NA, gsum_N = topm_l1_reference(a_NA, b_NB, m)
    if out_g is not None:
        g_NA = out_g.copy_(g_NA)
    return l1_N, g_NA, gsum_N
