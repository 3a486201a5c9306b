"""The exact TokenAligner: chunks = groups of tokens between byte offsets that are token boundaries on both sides.

Legend: B batch, T student tokens, U teacher tokens, N tokens of either side, R regions (byte
intervals between consecutive common boundaries), C chunks.

How it works (per sample, vectorized over tokens):
1. Content tokens (mask on, not a zero-width special) have byte spans that tile the text.
   Boundaries of a side = starts and ends of its non-empty content spans.
2. Common boundaries = boundaries of both sides up to E = the shorter side's covered end; E is
   added when it is not common (then the last region straddles: the longer side's last token
   runs past E, and the chunk is invalid).
3. Each non-empty content token falls in the region holding its start; tokens starting at or
   past E are the one-sided tail. Empty content spans (SentencePiece dummy ``▁``, normalizer
   leftovers) join the previous token's region (the next one's at the start).
4. A region with tokens on both sides is a chunk, valid when both sides cover exactly its bytes;
   with tokens on one side only it is a one-sided chunk (never valid, tokens get chunk id -1).
5. Zero-width specials pair by role (bos/eos/pad) with the other side's special at the same byte
   position, in order; each pair is a valid chunk, unpaired specials are one-sided chunks.
Chunks are numbered in byte order (specials at a boundary between the chunk ending there and
the chunk starting there). Cost: O(N + L) numpy work per sample (L = bytes covered: common
boundaries and token regions are found by marking boundaries on the byte axis), no per-token
Python loop; only the few zero-width specials are paired and ordered in Python.

``align_sample`` first tries the fast path of tiled.py (both sides tile their bytes without gaps
from the same first byte: real tokenizers' output, right padding masked off), which gives the same
outputs bit for bit in about a third of the time; everything else takes the general path here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from xtoken_core.align.batch import AlignmentBatch, SampleAlignment
from xtoken_core.align.tiled import align_tiled, pad_masked, pair_markers, tiled_side
from xtoken_core.tokenizers.base import ROLE_CONTENT, TokenizedText

logger = logging.getLogger(__name__)


def _as_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def _check_starts(side: str, spans_N2: np.ndarray, mask_N: np.ndarray | None) -> None:
    """Raise unless every real token's span starts at a byte offset >= 0."""
    starts_N = spans_N2[:, 0]
    if mask_N is not None and mask_N.shape == starts_N.shape:
        starts_N = starts_N[mask_N]
    if starts_N.size and int(starts_N.min()) < 0:
        at = int(np.flatnonzero(spans_N2[:, 0] == starts_N.min())[0])
        raise ValueError(
            f"{side}: token {at} has span {spans_N2[at].tolist()} with a negative start; spans "
            "are [start, end) byte offsets into the text, >= 0 (use XTokenizer.encode to "
            "compute them)"
        )


class _Side:
    """One side's tokens split into content and zero-width specials (internal)."""

    def __init__(self, spans_N2: np.ndarray, mask_N: np.ndarray, roles_N: np.ndarray, side: str):
        n = spans_N2.shape[0]
        if spans_N2.shape != (n, 2) or mask_N.shape != (n,) or roles_N.shape != (n,):
            raise ValueError(
                f"{side}: spans {spans_N2.shape}, mask {mask_N.shape} and roles {roles_N.shape} "
                "must be [N, 2], [N], [N] for the same N"
            )
        self.n = n
        start_N, end_N = spans_N2[:, 0], spans_N2[:, 1]
        if ((end_N < start_N) & mask_N).any():
            raise ValueError(
                f"{side}: a span has end < start; spans must be [start, end) byte pairs"
            )
        zero_N = start_N == end_N
        self.marker_N = mask_N & (roles_N != ROLE_CONTENT) & zero_N
        content_N = mask_N & ~self.marker_N
        if content_N.all():  # the common case: no padding, no zero-width specials
            self.content_idx = np.arange(n)
            self.start, self.end = start_N, end_N
        else:
            self.content_idx = np.flatnonzero(content_N)
            self.start = start_N[self.content_idx]
            self.end = end_N[self.content_idx]
        nonempty = self.end > self.start
        self.all_nonempty = bool(nonempty.all())
        if self.all_nonempty:
            self.ne_idx = np.arange(len(self.start))  # positions within content arrays
            ne_start, ne_end = self.start, self.end
        else:
            self.ne_idx = np.flatnonzero(nonempty)
            ne_start, ne_end = self.start[self.ne_idx], self.end[self.ne_idx]
        self.covered_end = int(self.end.max()) if len(self.end) else 0
        self.first_start = int(ne_start[0]) if len(ne_start) else 0
        # Boundaries: the sorted unique starts and ends of non-empty spans. Non-empty spans that
        # are ordered and disjoint have strictly increasing ends; a start is a new boundary only
        # after a gap (bytes no token covers).
        if len(ne_start) > 1:
            gap = ne_start[1:] != ne_end[:-1]
            if (ne_start[1:][gap] < ne_end[:-1][gap]).any():
                raise ValueError(
                    f"{side}: content spans overlap or go backwards; spans must be ordered and "
                    "disjoint (use XTokenizer.encode to compute them)"
                )
            if gap.any():
                both = np.concatenate([ne_start[:1], ne_end, ne_start[1:][gap]])
                both.sort()
                self.boundaries = both
            else:
                self.boundaries = np.concatenate([ne_start[:1], ne_end])
        else:
            self.boundaries = np.concatenate([ne_start, ne_end])
        self.marker_idx = np.flatnonzero(self.marker_N)
        self.marker_pos = start_N[self.marker_idx]
        self.marker_role = roles_N[self.marker_idx]

    def regions(self, cuts_at_or_before: np.ndarray) -> np.ndarray:
        """Region index of every content token (len(cuts) = tail), -1 where none.

        Args:
            cuts_at_or_before: int [L + 1] number of cuts <= each byte offset (or a
                ``_SortedCuts`` giving the same by binary search).
        """
        if self.all_nonempty:
            return cuts_at_or_before[self.start]
        region = np.full(len(self.content_idx), -1, dtype=np.int64)
        if len(self.ne_idx) == 0:
            return region
        region[self.ne_idx] = cuts_at_or_before[self.start[self.ne_idx]]
        if len(self.ne_idx) < len(region):
            # Empty spans join the previous non-empty token, or the next one at the start.
            pos = np.arange(len(region))
            is_ne = np.zeros(len(region), dtype=bool)
            is_ne[self.ne_idx] = True
            prev = np.maximum.accumulate(np.where(is_ne, pos, -1))
            nxt = np.minimum.accumulate(np.where(is_ne, pos, len(region))[::-1])[::-1]
            src = np.where(prev >= 0, prev, nxt)
            region = region[src]
        return region


class _SortedCuts:
    """``cuts_at_or_before[x]`` for any byte offsets x, by binary search (sparse offsets)."""

    def __init__(self, cuts: np.ndarray) -> None:
        self.cuts = cuts

    def __getitem__(self, x: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.cuts, x, side="right")


class TokenAligner:
    """Exact, tokenizer-agnostic alignment of two tokenizations of the same text.

    Stateless; one instance can be shared by threads. See the module docstring for the rules.
    """

    def align_sample(
        self,
        student_spans: np.ndarray,
        teacher_spans: np.ndarray,
        student_mask: np.ndarray | None = None,
        teacher_mask: np.ndarray | None = None,
        student_roles: np.ndarray | None = None,
        teacher_roles: np.ndarray | None = None,
    ) -> SampleAlignment:
        """Align one sample; returns jagged (unpadded) arrays.

        Args:
            student_spans: int [T, 2] byte spans of the student tokens in the text.
            teacher_spans: int [U, 2] same for the teacher.
            student_mask: bool [T] real tokens (default all); masked tokens get chunk id -1.
            teacher_mask: bool [U].
            student_roles: int [T] role codes (xtoken_core.tokenizers ROLE_*); default all
                content. Zero-width tokens with a non-content role are specials.
            teacher_roles: int [U].

        Returns:
            SampleAlignment.

        Raises:
            ValueError: on mismatched shapes, negative span starts, or spans that are not
                ordered and disjoint.
        """
        s_spans = _as_numpy(student_spans, np.int64).reshape(-1, 2)
        t_spans = _as_numpy(teacher_spans, np.int64).reshape(-1, 2)
        t_n, u_n = s_spans.shape[0], t_spans.shape[0]
        s_mask = None if student_mask is None else _as_numpy(student_mask, bool)
        t_mask = None if teacher_mask is None else _as_numpy(teacher_mask, bool)
        s_roles = None if student_roles is None else _as_numpy(student_roles, np.int8)
        t_roles = None if teacher_roles is None else _as_numpy(teacher_roles, np.int8)
        for side, spans_N2, mask_N in (("student", s_spans, s_mask), ("teacher", t_spans, t_mask)):
            _check_starts(side, spans_N2, mask_N)
        # Fast path: both sides tile their bytes from the same first byte (real tokenizers'
        # output, right padding masked off); the general path handles everything else.
        s_fast = tiled_side(s_spans, s_mask, s_roles)
        t_fast = None if s_fast is None else tiled_side(t_spans, t_mask, t_roles)
        if t_fast is not None:
            out = align_tiled(s_fast, t_fast)
            if out is not None:
                return pad_masked(out, t_n, u_n)
        s = _Side(
            s_spans,
            np.ones(t_n, bool) if s_mask is None else s_mask,
            np.zeros(t_n, np.int8) if s_roles is None else s_roles,
            "student",
        )
        t = _Side(
            t_spans,
            np.ones(u_n, bool) if t_mask is None else t_mask,
            np.zeros(u_n, np.int8) if t_roles is None else t_roles,
            "teacher",
        )
        return _align(s, t)

    def align(
        self,
        student_ids,
        teacher_ids,
        student_spans,
        teacher_spans,
        student_mask,
        teacher_mask,
        student_roles=None,
        teacher_roles=None,
    ) -> AlignmentBatch:
        """Align a right-padded batch.

        Args:
            student_ids: [B, T] student ids (tensor or array; only the shape is used).
            teacher_ids: [B, U] teacher ids.
            student_spans: int [B, T, 2] byte spans (padding rows: anything, masked out).
            teacher_spans: int [B, U, 2].
            student_mask: bool [B, T] real tokens.
            teacher_mask: bool [B, U].
            student_roles: int [B, T] role codes, or None (all content).
            teacher_roles: int [B, U] or None.

        Returns:
            AlignmentBatch with T and U equal to the input widths and max_pairs >= 1.

        Raises:
            ValueError: on inconsistent shapes (names the argument) or bad spans.
        """
        b, t_len = tuple(student_ids.shape)
        b2, u_len = tuple(teacher_ids.shape)
        if b != b2:
            raise ValueError(f"student batch {b} != teacher batch {b2}; align the same texts")
        s_spans = _as_numpy(student_spans, np.int64)
        t_spans = _as_numpy(teacher_spans, np.int64)
        s_mask = _as_numpy(student_mask, bool)
        t_mask = _as_numpy(teacher_mask, bool)
        for name, arr, want in (
            ("student_spans", s_spans, (b, t_len, 2)),
            ("teacher_spans", t_spans, (b, u_len, 2)),
            ("student_mask", s_mask, (b, t_len)),
            ("teacher_mask", t_mask, (b, u_len)),
        ):
            if arr.shape != want:
                raise ValueError(f"{name} has shape {arr.shape}, expected {want}")
        s_roles = None if student_roles is None else _as_numpy(student_roles, np.int8)
        t_roles = None if teacher_roles is None else _as_numpy(teacher_roles, np.int8)
        samples = [
            self.align_sample(
                s_spans[i],
                t_spans[i],
                s_mask[i],
                t_mask[i],
                None if s_roles is None else s_roles[i],
                None if t_roles is None else t_roles[i],
            )
            for i in range(b)
        ]
        return AlignmentBatch.from_samples(samples, student_len=t_len, teacher_len=u_len)

    def align_tokenized(self, student: TokenizedText, teacher: TokenizedText) -> SampleAlignment:
        """Align two TokenizedText of the same text (already truncated as wanted).

        Args:
            student: student tokens.
            teacher: teacher tokens.

        Returns:
            SampleAlignment.
        """
        return self.align_sample(
            student.spans_N2, teacher.spans_N2, None, None, student.roles_N, teacher.roles_N
        )

    def align_texts(
        self,
        texts: Sequence[str],
        student_tok,
        teacher_tok,
        ctx_length_student: int | None = None,
        ctx_length_teacher: int | None = None,
    ) -> tuple[list[TokenizedText], list[TokenizedText], AlignmentBatch]:
        """Tokenize texts with both tokenizers, truncate, and align.

        Args:
            texts: B texts.
            student_tok: student XTokenizer.
            teacher_tok: teacher XTokenizer.
            ctx_length_student: student token cap (None: no cap).
            ctx_length_teacher: teacher token cap.

        Returns:
            (student TokenizedText list, teacher list, AlignmentBatch padded to the longest
            sample on each side).
        """
        students = [x.truncated(ctx_length_student) for x in student_tok.encode_batch(list(texts))]
        teachers = [x.truncated(ctx_length_teacher) for x in teacher_tok.encode_batch(list(texts))]
        samples = [self.align_tokenized(s, t) for s, t in zip(students, teachers)]
        return students, teachers, AlignmentBatch.from_samples(samples)


def _align(s: _Side, t: _Side) -> SampleAlignment:
    """Core of align_sample (see the module docstring)."""
    end = min(s.covered_end, t.covered_end)
    # Byte-axis marking is linear in the bytes covered; spans far apart (arbitrary offsets passed
    # to align_sample) use sorted-array searches instead, O(N log N) in the tokens.
    on_byte_axis = max(s.covered_end, t.covered_end) <= 16 * (s.n + t.n) + 4096
    s_b = s.boundaries[: np.searchsorted(s.boundaries, end, side="right")]
    t_b = t.boundaries[: np.searchsorted(t.boundaries, end, side="right")]
    if not (len(s_b) and len(t_b)):
        common = np.zeros(0, dtype=np.int64)
    elif on_byte_axis:
        hits = np.zeros(end + 1, dtype=np.int8)
        hits[s_b] = 1
        hits[t_b] += 1
        common = np.flatnonzero(hits == 2)
    else:
        pos = np.minimum(np.searchsorted(t_b, s_b), len(t_b) - 1)
        common = s_b[t_b[pos] == s_b]
    cuts = common if len(common) and common[-1] == end else np.append(common, end)
    r_count = len(cuts) + 1  # region len(cuts) = the tail, at or past `end`
    # Region of a token = number of cuts at or before its start byte.
    if on_byte_axis:
        is_cut = np.zeros(max(s.covered_end, t.covered_end) + 1, dtype=np.int32)
        is_cut[cuts] = 1
        cuts_at_or_before = np.cumsum(is_cut)
    else:
        cuts_at_or_before = _SortedCuts(cuts)
    s_region = s.regions(cuts_at_or_before)
    t_region = t.regions(cuts_at_or_before)

    def region_stats(side: _Side, region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = region >= 0
        count = np.bincount(region[ok], minlength=r_count)
        cover = np.bincount(region[ok], weights=(side.end - side.start)[ok], minlength=r_count)
        return count, cover.astype(np.int64)

    s_count, s_cover = region_stats(s, s_region)
    t_count, t_cover = region_stats(t, t_region)
    lo = np.empty(r_count, dtype=np.int64)
    lo[0] = min(s.first_start, t.first_start, int(cuts[0]))
    lo[1:] = cuts
    hi = np.empty(r_count, dtype=np.int64)
    hi[:-1] = cuts
    hi[-1] = -1  # the tail never matches a coverage
    width = hi - lo
    two_sided = (s_count > 0) & (t_count > 0)
    region_valid = two_sided & (s_cover == width) & (t_cover == width)
    region_used = (s_count > 0) | (t_count > 0)
    used_idx = np.flatnonzero(region_used)

    # Specials: pair by role at equal byte positions, in order on both sides.
    pairs, s_alone, t_alone = pair_markers(
        s.marker_pos.tolist(), s.marker_role.tolist(), t.marker_pos.tolist(), t.marker_role.tolist()
    )
    n_regions = len(used_idx)
    n_pairs, n_s_alone, n_t_alone = len(pairs), len(s_alone), len(t_alone)
    # Chunk order: by byte position; a special sorts before the region starting at its position
    # (regions are already in order, with strictly increasing starts), specials among
    # themselves by (position, student index, then teacher index).
    n_markers = n_pairs + n_s_alone + n_t_alone
    rank = np.empty(n_regions + n_markers, dtype=np.int64)
    if n_markers == 0:
        rank[:] = np.arange(n_regions)
    else:
        m_pos = np.concatenate(
            [
                s.marker_pos[[p[0] for p in pairs]] if n_pairs else np.zeros(0, np.int64),
                s.marker_pos[s_alone] if n_s_alone else np.zeros(0, np.int64),
                t.marker_pos[t_alone] if n_t_alone else np.zeros(0, np.int64),
            ]
        ).astype(np.int64)
        m_order = np.concatenate(
            [
                np.array([p[0] for p in pairs], np.int64),
                np.asarray(s_alone, np.int64),
                np.asarray(t_alone, np.int64) + s.n,
            ]
        )
        m_sorted = np.lexsort((m_order, m_pos))
        before_region = np.searchsorted(lo[used_idx], m_pos[m_sorted], side="left")
        rank[:n_regions] = np.arange(n_regions) + np.searchsorted(
            before_region, np.arange(n_regions), side="right"
        )
        rank[n_regions + m_sorted] = before_region + np.arange(n_markers)
    num_chunks = n_regions + n_markers

    chunk_valid = np.concatenate(
        [region_valid[used_idx], np.ones(n_pairs, bool), np.zeros(n_s_alone + n_t_alone, bool)]
    )
    pair_valid = np.zeros(num_chunks, dtype=bool)
    pair_valid[rank] = chunk_valid
    pair_is_correct = pair_valid.copy()

    # Region -> chunk id for two-sided regions (one-sided regions keep -1 for their tokens).
    region_chunk = np.full(r_count + 1, -1, dtype=np.int64)  # last slot: "no region" (-1 index)
    two_used = two_sided[used_idx]
    region_chunk[used_idx[two_used]] = rank[:n_regions][two_used]
    one_to_one = region_valid & (s_count == 1) & (t_count == 1)

    def token_outputs(side: _Side, region: np.ndarray, pair_pos: int):
        chunk_N = np.full(side.n, -1, dtype=np.int64)
        exact_N = np.zeros(side.n, dtype=bool)
        chunk_N[side.content_idx] = region_chunk[region]  # region -1 -> last slot (-1)
        exact_N[side.content_idx] = np.where(region >= 0, one_to_one[region], False)
        if n_pairs:
            mk = np.array([p[pair_pos] for p in pairs], np.int64)
            chunk_N[side.marker_idx[mk]] = rank[n_regions : n_regions + n_pairs]
        return chunk_N, exact_N

    s_chunk, s_exact = token_outputs(s, s_region, 0)
    t_chunk, t_exact = token_outputs(t, t_region, 1)
    return SampleAlignment(
        pair_valid=pair_valid,
        pair_is_correct=pair_is_correct,
        student_exact_partition_mask=s_exact,
        teacher_exact_partition_mask=t_exact,
        student_chunk_id=s_chunk,
        teacher_chunk_id=t_chunk,
        num_chunks=num_chunks,
    )
