"""The aligner's fast path: two tokenizations that tile their bytes without gaps from one byte.

Legend: N tokens of one side, R regions of one side (byte intervals between consecutive cuts),
L bytes (the byte axis up to the longer side's end).

Real tokenizers give spans that start where the previous one ends; then every region below
the shorter side's end holds tokens of both sides and is a valid chunk (except one straddling
that end), so validity needs no coverage sums and chunk ids are a repeat of region numbers:
about a dozen numpy calls per side. ``TokenAligner`` (aligner.py) tries this path first and falls
back to its general path; both give the same outputs bit for bit (tests/xtoken_core/align/
test_aligner_fast_path.py, benchmarks/align/check_aligner_outputs.py).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from xtoken_core.align.batch import SampleAlignment
from xtoken_core.tokenizers.base import ROLE_BOS, ROLE_CONTENT, ROLE_EOS, ROLE_PAD

PAIRABLE_ROLES = (ROLE_BOS, ROLE_EOS, ROLE_PAD)


class TiledSide:
    """One side whose spans tile their bytes without gaps, as the fast path sees it.

    Every span starts where the previous one ends and at least one is non-empty. The few
    zero-width tokens (specials, SentencePiece dummy pieces) are kept as Python lists.

    Attributes:
        n: tokens N.
        start_N, end_N: int64 [N] views of the span starts and ends.
        first: byte where the first non-empty token starts (F).
        covered_end: end of the last token.
        zero_idx: int64 [Z] indices of the zero-width tokens.
        lead: zero-width tokens before the first non-empty one.
        empty_lead: one of those is content (an empty piece joining the first region).
        marker_idx, marker_pos, marker_role: the zero-width specials (index, byte, role).
    """

    __slots__ = (
        "n",
        "start_N",
        "end_N",
        "first",
        "covered_end",
        "zero_idx",
        "lead",
        "empty_lead",
        "marker_idx",
        "marker_pos",
        "marker_role",
    )


def _tiling(spans_N2: np.ndarray, roles_N: np.ndarray | None) -> TiledSide | None:
    """The side as a tiling, or None when it needs the general path (gaps, no content, errors)."""
    n = spans_N2.shape[0]
    if n == 0:
        return None
    start_N, end_N = spans_N2[:, 0], spans_N2[:, 1]
    zero_idx = np.flatnonzero(end_N <= start_N)
    if len(zero_idx) == n or (start_N[1:] != end_N[:-1]).any():
        return None
    x = TiledSide()
    x.n, x.start_N, x.end_N = n, start_N, end_N
    x.first, x.covered_end = int(start_N[0]), int(end_N[-1])
    x.zero_idx, x.lead, x.empty_lead = zero_idx, 0, False
    x.marker_idx, x.marker_pos, x.marker_role = [], [], []
    if len(zero_idx):
        zero = zero_idx.tolist()
        zero_spans = spans_N2[zero_idx].tolist()
        if any(e < a for a, e in zero_spans):
            return None  # the general path raises the error
        zero_roles = [ROLE_CONTENT] * len(zero) if roles_N is None else roles_N[zero_idx].tolist()
        while x.lead < len(zero) and zero[x.lead] == x.lead:
            x.lead += 1  # zero-width tokens before the first non-empty one
        x.empty_lead = ROLE_CONTENT in zero_roles[: x.lead]  # they join the first region
        for i, (a, _), role in zip(zero, zero_spans, zero_roles):
            if role != ROLE_CONTENT:
                x.marker_idx.append(i)
                x.marker_pos.append(a)
                x.marker_role.append(role)
    return x


def tiled_side(
    spans_N2: np.ndarray, mask_N: np.ndarray | None, roles_N: np.ndarray | None
) -> TiledSide | None:
    """One side as a tiling, after dropping the masked-off right padding.

    Args:
        spans_N2: int64 [N, 2] byte spans.
        mask_N: bool [N] real tokens, or None (all).
        roles_N: int8 [N] role codes, or None (all content).

    Returns:
        TiledSide of the kept tokens, or None when the general path must run: the mask is not a
        prefix, shapes disagree, spans have gaps, go backwards or are all empty.
    """
    n = spans_N2.shape[0]
    if roles_N is not None and roles_N.shape != (n,):
        return None
    if mask_N is not None:
        if mask_N.shape != (n,):
            return None
        k = int(np.count_nonzero(mask_N))
        if not mask_N[:k].all():
            return None
        if k < n:
            spans_N2 = spans_N2[:k]
            roles_N = None if roles_N is None else roles_N[:k]
    return _tiling(spans_N2, roles_N)


def pad_masked(out: SampleAlignment, t_n: int, u_n: int) -> SampleAlignment:
    """Give the masked-off trailing tokens chunk id -1 and no exact match (in place).

    Args:
        out: the alignment of the kept (unmasked) tokens.
        t_n: student tokens T including the padding.
        u_n: teacher tokens U including the padding.

    Returns:
        ``out``, its per-token arrays extended to [T] and [U].
    """
    for side, n in (("student", t_n), ("teacher", u_n)):
        chunk_N = getattr(out, f"{side}_chunk_id")
        if len(chunk_N) < n:
            pad = n - len(chunk_N)
            setattr(out, f"{side}_chunk_id", np.concatenate([chunk_N, np.full(pad, -1, np.int64)]))
            exact_N = getattr(out, f"{side}_exact_partition_mask")
            setattr(
                out,
                f"{side}_exact_partition_mask",
                np.concatenate([exact_N, np.zeros(pad, dtype=bool)]),
            )
    return out


def align_tiled(s: TiledSide, t: TiledSide) -> SampleAlignment | None:
    """Align two tilings that start at the same byte (the common case), as aligner.py would.

    Both sides cover [F, their end) without gaps, so below the shorter end E every common
    boundary starts a token on both sides: regions are the same on both sides and all are valid
    chunks, except the last one when E is not a boundary of the longer side (it straddles E).
    The longer side's tokens starting at or past E are the one-sided tail (one chunk slot).
    Region k of a side starts at its token idx_R[k]; the zero-width tokens before idx_R[0]
    count in region 0, so chunk ids are a repeat of per-region values.

    Args:
        s: student side.
        t: teacher side.

    Returns:
        SampleAlignment equal to the general path's, or None when the sides start at different
        bytes or their bytes are too sparse for the byte axis.
    """
    first = s.first
    if t.first != first:
        return None
    end = min(s.covered_end, t.covered_end)
    size = max(s.covered_end, t.covered_end) + 1
    if size > 16 * (s.n + t.n) + 4096:
        return None
    cut_L = np.zeros(size, dtype=bool)
    cut_L[s.end_N] = True
    t_mark_L = np.zeros(size, dtype=bool)
    t_mark_L[t.end_N] = True
    np.logical_and(cut_L, t_mark_L, out=cut_L)  # common boundaries (none past E)
    cut_L[first] = True
    straddle = not cut_L[end]
    cut_L[end] = True
    if straddle:  # the longer side's tail starts after the token that runs past E
        longer = s if s.covered_end > end else t
        cut_L[longer.end_N[np.searchsorted(longer.end_N, end, side="right")]] = True

    s_flag_N = cut_L[s.start_N]
    if len(s.zero_idx):
        s_flag_N[s.zero_idx] = False
    s_idx_R = np.flatnonzero(s_flag_N)
    t_flag_N = cut_L[t.start_N]
    if len(t.zero_idx):
        t_flag_N[t.zero_idx] = False
    t_idx_R = np.flatnonzero(t_flag_N)
    r_two = min(len(s_idx_R), len(t_idx_R))  # two-sided regions; the longer side adds a tail
    has_tail = len(s_idx_R) != len(t_idx_R)
    assert abs(len(s_idx_R) - len(t_idx_R)) <= 1, "tilings disagree below the shorter end"

    # Specials in chunk order (by byte position, then student index, then teacher index) and
    # the number of regions before each (those starting before its byte).
    markers: list[tuple[int, int, int, int]] = []  # (pos, side, marker index, partner or -1)
    before: list[int] = []
    if s.marker_idx or t.marker_idx:
        pairs, s_alone, t_alone = pair_markers(
            s.marker_pos, s.marker_role, t.marker_pos, t.marker_role
        )
        s_pos, t_pos = s.marker_pos, t.marker_pos
        markers = sorted(
            [(s_pos[i], 0, i, k) for i, k in pairs]
            + [(s_pos[i], 0, i, -1) for i in s_alone]
            + [(t_pos[k], 1, k, -1) for k in t_alone]
        )
        for pos, *_ in markers:
            if pos <= first:
                before.append(0)
            elif pos >= end:
                before.append(r_two + (has_tail and pos > end))
            else:
                j = np.searchsorted(s.start_N, pos, side="left")
                before.append(int(np.searchsorted(s_idx_R, j, side="left")))
    num_chunks = r_two + has_tail + len(markers)
    pair_valid = np.ones(num_chunks, dtype=bool)
    # Chunk slot of region k: k + specials placed before it (``before`` is sorted).
    if straddle:
        pair_valid[r_two - 1 + bisect_right(before, r_two - 1)] = False
    if has_tail:
        pair_valid[r_two + bisect_right(before, r_two)] = False

    def per_region(x: TiledSide, idx_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens per region (zero-width ones included) and bool [r_two] "one content token"."""
        r = len(idx_R)
        size_R = np.empty(r, dtype=np.int64)
        np.subtract(idx_R[1:], idx_R[:-1], out=size_R[:-1])
        size_R[-1] = x.n - idx_R[-1]
        size_R[0] += idx_R[0]
        one_R = size_R[:r_two] == 1
        if x.lead or x.marker_idx:
            # Specials are not content: take them off their region's count.
            fix: dict[int, int] = {}
            for m in x.marker_idx:
                k = 0 if m < x.lead else int(np.searchsorted(idx_R, m, side="right")) - 1
                fix[k] = fix.get(k, 0) + 1
            for k, c in fix.items():
                if k < r_two:
                    one_R[k] = size_R[k] - c == 1
        return size_R, one_R

    s_size_R, s_one_R = per_region(s, s_idx_R)
    t_size_R, t_one_R = per_region(t, t_idx_R)
    one_R = s_one_R & t_one_R
    if straddle:
        one_R[-1] = False

    def token_outputs(x: TiledSide, idx_R: np.ndarray, size_R: np.ndarray):
        r = len(idx_R)
        lead_markers = bisect_right(before, 0)
        values_R = np.arange(lead_markers, lead_markers + r, dtype=np.int64)
        for b in before[lead_markers:]:
            values_R[b:] += 1
        values_R[r_two:] = -1  # the one-sided tail
        chunk_N = np.repeat(values_R, size_R)
        exact_N = np.zeros(x.n, dtype=bool)
        exact_N[idx_R[:r_two]] = one_R
        return chunk_N, exact_N

    s_chunk, s_exact = token_outputs(s, s_idx_R, s_size_R)
    t_chunk, t_exact = token_outputs(t, t_idx_R, t_size_R)
    for j, (_, side, i, partner) in enumerate(markers):
        slot = before[j] + j
        if partner >= 0:
            s_chunk[s.marker_idx[i]] = slot
            t_chunk[t.marker_idx[partner]] = slot
        else:
            pair_valid[slot] = False
            if side == 0:
                s_chunk[s.marker_idx[i]] = -1
            else:
                t_chunk[t.marker_idx[i]] = -1
    return SampleAlignment(
        pair_valid=pair_valid,
        pair_is_correct=pair_valid.copy(),
        student_exact_partition_mask=s_exact,
        teacher_exact_partition_mask=t_exact,
        student_chunk_id=s_chunk,
        teacher_chunk_id=t_chunk,
        num_chunks=num_chunks,
    )


def pair_markers(
    s_pos: list[int], s_role: list[int], t_pos: list[int], t_role: list[int]
) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Pair zero-width specials by (position, role), monotone on both sides.

    Args:
        s_pos: byte position of each student special, in token order.
        s_role: its role code.
        t_pos: same for the teacher.
        t_role: same for the teacher.

    Returns:
        (pairs as (student marker index, teacher marker index), unpaired student marker
        indices, unpaired teacher marker indices); indices into each side's marker lists.
    """
    ns, nt = len(s_pos), len(t_pos)
    if ns == 0 or nt == 0:
        return [], list(range(ns)), list(range(nt))
    pairs: list[tuple[int, int]] = []
    s_alone: list[int] = []
    j = 0
    for i in range(ns):
        if s_role[i] not in PAIRABLE_ROLES:
            s_alone.append(i)
            continue
        k = j
        while k < nt and t_pos[k] <= s_pos[i]:
            if t_pos[k] == s_pos[i] and t_role[k] == s_role[i]:
                break
            k += 1
        if k < nt and t_pos[k] == s_pos[i] and t_role[k] == s_role[i]:
            pairs.append((i, k))
            j = k + 1
        else:
            s_alone.append(i)
    paired_t = {p[1] for p in pairs}
    t_alone = [k for k in range(nt) if k not in paired_t]
    return pairs, s_alone, t_alone
