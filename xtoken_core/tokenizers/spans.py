"""Exact UTF-8 byte spans of tokens in the original text, from offsets and token bytes.

Legend: N tokens, M content tokens, L characters of the text, V vocabulary, Z bytes of all
tokens of a vocabulary.

Rules (documented once here, relied on by the aligner):
* Content spans are non-decreasing, never overlap, and tile the bytes they cover.
* Where the tokenizer did not change the text (no normalizer effect), spans come from the bytes
  each token decodes to: the cumulative sum of token byte lengths. This is exact even where a
  byte-level token splits a multi-byte character (HF offsets overlap there).
* Otherwise (a normalizer changed the text: lowercasing, NFC/NFKC; or the tokenizer dropped a
  character it has no token for), spans come from the tokenizer's offsets in the ORIGINAL text.
  Tokens whose offsets overlap (one character split over several tokens) form a group. Bytes no
  token claims between two groups (e.g. a combining mark merged by NFC) go to the group that
  decoded more bytes than it covers, else to the previous group; bytes after the last group go
  to it, and bytes before the first group to that one (so a trailing combining mark is handled
  as it is mid-text). Inside a group whose tokens spell exactly the original bytes it covers,
  the bytes are split by token length; otherwise the first token takes the whole group and the
  others get an empty span at its end. Whitespace the tokenizer dropped (e.g. a Whitespace
  pre-tokenizer, a Strip normalizer) stays uncovered, so spans tile except across such
  whitespace. A starter and the marks (or jamo) after it that NFC composes or reorders are one
  unit: the tokenizer's offsets point into it wrongly, so every token touching it joins one
  group covering all of it.
* SentencePiece's dummy-prefix ``▁`` covers no byte of the text: a leading ``▁`` piece alone gets
  the empty span [0, 0); ``▁Hi`` at the start covers only ``Hi``.
* Special tokens get an empty span at the end of the previous content token (0 at the start).
"""

from __future__ import annotations

import functools
import unicodedata

import numpy as np


def char_to_byte_offsets(text: str) -> np.ndarray:
    """Byte offset of every character boundary of ``text``.

    Args:
        text: any string encodable as UTF-8.

    Returns:
        int64 [L + 1]: entry i is the UTF-8 byte offset of character i (last = byte length).
    """
    codepoints_L = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    nbytes_L = (
        1
        + (codepoints_L >= 0x80).astype(np.int64)
        + (codepoints_L >= 0x800)
        + (codepoints_L >= 0x10000)
    )
    out = np.zeros(len(codepoints_L) + 1, dtype=np.int64)
    np.cumsum(nbytes_L, out=out[1:])
    return out


class PackedTokenBytes:
    """The bytes of every token of a vocabulary in one buffer, for vectorized spelling checks.

    Attributes:
        data_Z: uint8 [Z] all token bytes, concatenated in id order.
        start_V: int64 [V] offset of each token's bytes in ``data_Z``.
        len_V: int64 [V] byte length of each token.
    """

    def __init__(self, token_bytes: list[bytes]) -> None:
        """Pack ``token_bytes`` (id -> bytes)."""
        self.len_V = np.fromiter(
            (len(b) for b in token_bytes), dtype=np.int64, count=len(token_bytes)
        )
        self.start_V = np.zeros(len(token_bytes), dtype=np.int64)
        if len(token_bytes) > 1:
            np.cumsum(self.len_V[:-1], out=self.start_V[1:])
        self.data_Z = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)

    def spells(self, ids_M: np.ndarray, lens_M: np.ndarray, skip_first: int, text_bytes: bytes):
        """Whether tokens ``ids_M`` (the first one minus ``skip_first`` leading bytes) spell text.

        Args:
            ids_M: int64 [M] token ids.
            lens_M: int64 [M] byte lengths used (``len_V[ids_M]``, the first minus skip_first).
            skip_first: leading bytes of the first token that are no text (a dummy prefix).
            text_bytes: the text as UTF-8; ``lens_M.sum()`` must equal its length.

        Returns:
            True when the concatenated token bytes equal ``text_bytes``.
        """
        starts_M = self.start_V[ids_M]
        starts_M[0] += skip_first
        ends_M = np.cumsum(lens_M)
        # Byte j of the text comes from token m at data_Z[starts_M[m] + (j - (ends_M[m] - lens_M[m]))].
        shift_Z = np.repeat(starts_M - (ends_M - lens_M), lens_M)
        gathered_Z = self.data_Z[shift_Z + np.arange(len(text_bytes), dtype=np.int64)]
        return bool(np.array_equal(gathered_Z, np.frombuffer(text_bytes, dtype=np.uint8)))


def compute_byte_spans(
    text: str,
    text_bytes: bytes,
    ids_N: np.ndarray,
    offsets_N2,
    *,
    offsets_are_chars: bool,
    token_bytes: list[bytes],
    token_len: np.ndarray,
    is_content_N: np.ndarray,
    dummy_prefix: bool = False,
    packed: PackedTokenBytes | None = None,
) -> np.ndarray:
    """Byte span [start, end) of every token in ``text_bytes`` (see module docstring for rules).

    Args:
        text: the original text.
        text_bytes: ``text.encode("utf-8")``.
        ids_N: int64 [N] token ids.
        offsets_N2: int64 [N, 2] the tokenizer's offsets in the original text, or a callable
            returning them (called only when the token bytes do not spell the text).
        offsets_are_chars: True for character offsets (HF tokenizers), False for byte offsets
            (SentencePiece).
        token_bytes: id -> bytes the token decodes to (b"" for specials).
        token_len: int64 [vocab] ``len(token_bytes[id])``.
        is_content_N: bool [N] True for content tokens, False for special tokens.
        dummy_prefix: the first content token carries a SentencePiece dummy-prefix space.
        packed: the same vocabulary packed (vectorized check); None checks with ``bytes.join``.

    Returns:
        int64 [N, 2] spans.
    """
    n = int(ids_N.shape[0])
    spans_N2 = np.zeros((n, 2), dtype=np.int64)
    if n == 0:
        return spans_N2
    content_M = np.flatnonzero(is_content_N)
    if len(content_M):
        cids_M = ids_N[content_M]
        lens_M = token_len[cids_M]
        skip = 1 if dummy_prefix and token_bytes[int(cids_M[0])][:1] == b" " else 0
        if skip:
            lens_M = lens_M.copy()
            lens_M[0] -= 1
        exact = int(lens_M.sum()) == len(text_bytes)
        if exact and packed is not None:
            exact = packed.spells(cids_M, lens_M, skip, text_bytes)
        elif exact:
            pieces = [token_bytes[i] for i in cids_M.tolist()]
            pieces[0] = pieces[0][skip:]
            exact = b"".join(pieces) == text_bytes
        if exact:
            ends_M = np.cumsum(lens_M)
            spans_M2 = np.stack([ends_M - lens_M, ends_M], axis=1)
        else:
            if callable(offsets_N2):
                offsets_N2 = offsets_N2()
            offs_M2 = np.asarray(offsets_N2, dtype=np.int64).reshape(-1, 2)[content_M]
            if offsets_are_chars:
                offs_M2 = char_to_byte_offsets(text)[offs_M2]
            offs_M2 = _widen_to_composed_units(offs_M2, text)
            pieces_M = [token_bytes[i] for i in cids_M.tolist()]
            pieces_M[0] = pieces_M[0][skip:]
            spans_M2 = _spans_from_offsets(offs_M2, lens_M, pieces_M, text_bytes)
        spans_N2[content_M] = spans_M2
    # Specials: empty span at the end of the previous content token (0 before any).
    if len(content_M) < n:
        ends_N = np.zeros(n, dtype=np.int64)
        ends_N[content_M] = spans_N2[content_M, 1]
        last_content_N = np.maximum.accumulate(np.where(is_content_N, np.arange(n), -1))
        special_N = ~is_content_N
        pos_N = np.where(last_content_N >= 0, ends_N[np.maximum(last_content_N, 0)], 0)
        spans_N2[special_N, 0] = pos_N[special_N]
        spans_N2[special_N, 1] = pos_N[special_N]
    return spans_N2


def _spans_from_offsets(
    offs_M2: np.ndarray, lens_M: np.ndarray, pieces_M: list[bytes], text_bytes: bytes
) -> np.ndarray:
    """Slow path: spans from byte offsets in the original text, grouped where offsets overlap.

    Args:
        offs_M2: int64 [M, 2] byte offsets of content tokens in the original text.
        lens_M: int64 [M] decoded byte length of each token.
        pieces_M: the bytes each content token decodes to (``len(pieces_M[m]) == lens_M[m]``).
        text_bytes: the original text as UTF-8.

    Returns:
        int64 [M, 2] tiling spans.
    """
    m = len(lens_M)
    offs = offs_M2.tolist()
    lens = lens_M.tolist()
    # groups: [first token, last token + 1, start, end, decoded length]
    groups: list[list[int]] = []
    for i in range(m):
        a, b = offs[i]
        if b < a:
            b = a
        if groups:
            g = groups[-1]
            if a < g[3] or g[3] == g[2]:
                g[1] = i + 1
                g[2] = min(g[2], a)
                g[3] = max(g[3], b)
                g[4] += lens[i]
                continue
        groups.append([i, i + 1, a, b, lens[i]])
    # Make groups tile: no overlap, interior gaps go to the group that decoded extra bytes.
    for k in range(1, len(groups)):
        prev, g = groups[k - 1], groups[k]
        if g[2] < prev[3]:
            g[2] = prev[3]
            g[3] = max(g[3], g[2])
        gap = g[2] - prev[3]
        if gap > 0 and _is_whitespace(text_bytes[prev[3] : g[2]]):
            continue  # whitespace the tokenizer dropped stays uncovered
        if gap > 0:
            if g[4] - (g[3] - g[2]) >= gap:
                g[2] -= gap
            else:
                prev[3] += gap
    # Characters after the last group that a normalizer merged into it (e.g. a trailing
    # combining mark under NFC) belong to that group, as they would mid-text; characters before
    # the first group that the tokenizer dropped (a byte its vocab has no token for) go to the
    # first group. Whitespace stays uncovered.
    tail = text_bytes[groups[-1][3] :]
    if tail and not _is_whitespace(tail):
        groups[-1][3] = len(text_bytes)
    head = text_bytes[: groups[0][2]]
    if head and not _is_whitespace(head):
        groups[0][2] = 0
    out = np.zeros((m, 2), dtype=np.int64)
    for first, stop, gs, ge, total in groups:
        # Split by token length only where the tokens spell the group's bytes exactly; where a
        # normalizer changed them (composed, reordered or case-mapped characters), a length
        # split would hand a token bytes it does not stand for.
        if total == ge - gs and b"".join(pieces_M[first:stop]) == text_bytes[gs:ge]:
            ends = gs + np.cumsum(lens_M[first:stop])
            out[first:stop, 1] = ends
            out[first:stop, 0] = ends - lens_M[first:stop]
        else:
            out[first:stop] = ge
            out[first, 0] = gs
    return out


def _widen_to_composed_units(offs_M2: np.ndarray, text: str) -> np.ndarray:
    """Widen offsets that touch a character sequence NFC rewrites to that whole sequence.

    A starter followed by characters that attach to it (combining marks, Hangul vowel and final
    jamo, other second halves of canonical compositions) is one unit for NFC/NFKC: it composes
    and reorders inside it, and the tokenizer's offsets then point its tokens at the wrong part
    of the unit (e.g. at the starter alone, or at another mark). Every token touching such a
    unit gets the whole unit, so those tokens form one group (which the first token takes unless
    they spell the unit's bytes exactly).

    Args:
        offs_M2: int64 [M, 2] byte offsets of content tokens in the original text.
        text: the original text.

    Returns:
        int64 [M, 2] offsets (the input itself where NFC would not change the text).
    """
    if unicodedata.is_normalized("NFC", text):
        return offs_M2
    attaches = _attaches_to_previous()
    starts = [i for i, c in enumerate(text) if c in attaches or _leading_ccc(c)]
    if not starts:
        return offs_M2
    char_to_byte = char_to_byte_offsets(text)
    offs_M2 = offs_M2.copy()
    k = 0
    while k < len(starts):
        lo = max(starts[k] - 1, 0)  # the starter the run attaches to
        hi = starts[k] + 1
        while k + 1 < len(starts) and starts[k + 1] == hi:
            k += 1
            hi += 1
        k += 1
        unit = text[lo:hi]
        if len(unit) < 2 or unicodedata.normalize("NFC", unit) == unit:
            continue
        r0, r1 = int(char_to_byte[lo]), int(char_to_byte[hi])
        a_M, b_M = offs_M2[:, 0], offs_M2[:, 1]
        touches_M = ((a_M < r1) & (b_M > r0)) | ((a_M == b_M) & (a_M >= r0) & (a_M < r1))
        offs_M2[touches_M, 0] = np.minimum(a_M[touches_M], r0)
        offs_M2[touches_M, 1] = np.maximum(b_M[touches_M], r1)
    return offs_M2


@functools.lru_cache(maxsize=8192)
def _leading_ccc(char: str) -> int:
    """Canonical combining class of the first character of ``char``'s NFD form."""
    return unicodedata.combining(unicodedata.normalize("NFD", char)[0])


@functools.cache
def _attaches_to_previous() -> frozenset[str]:
    """Characters with combining class 0 that compose with the character before them (the
    second half of a two-character canonical decomposition, e.g. Hangul vowel jamo)."""
    out = {chr(cp) for cp in range(0x1161, 0x1176)} | {chr(cp) for cp in range(0x11A8, 0x11C3)}
    for cp in range(0x30000):
        parts = unicodedata.decomposition(chr(cp)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            second = chr(int(parts[1], 16))
            if not unicodedata.combining(second):
                out.add(second)
    return frozenset(out)


def _is_whitespace(raw: bytes) -> bool:
    """True if the bytes decode to whitespace only (a gap the tokenizer dropped on purpose)."""
    return raw.decode("utf-8", "replace").isspace()
