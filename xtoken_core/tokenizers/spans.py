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
  Tokens whose offsets overlap (one character split over several tokens) form a group; inside a
  group whose decoded length equals its original length the bytes are split by token length,
  otherwise the first token takes the whole group and the others get an empty span at its end.
  Bytes no token claims between two groups (e.g. a combining mark merged by NFC) go to the group
  that decoded more bytes than it covers, else to the previous group; bytes after the last token
  go to it, and bytes before the first token to that one. Whitespace the tokenizer dropped (e.g.
  a Whitespace pre-tokenizer, a Strip normalizer) stays uncovered, so spans tile except across
  such whitespace.
* SentencePiece's dummy-prefix ``▁`` covers no byte of the text: a leading ``▁`` piece alone gets
  the empty span [0, 0); ``▁Hi`` at the start covers only ``Hi``.
* Special tokens get an empty span at the end of the previous content token (0 at the start).
"""

from __future__ import annotations

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
            spans_M2 = _spans_from_offsets(offs_M2, lens_M, text_bytes)
            # Characters after the last token that a normalizer merged into it (e.g. a
            # trailing combining mark under NFC) belong to it; stripped whitespace does not.
            tail = text_bytes[spans_M2[-1, 1] :]
            if tail and not _is_whitespace(tail):
                spans_M2[-1, 1] = len(text_bytes)
            # Likewise characters before the first token that the tokenizer dropped (a byte
            # its vocab has no token for, e.g. some control bytes for SmolLM2) go to it.
            head = text_bytes[: spans_M2[0, 0]]
            if head and not _is_whitespace(head):
                spans_M2[0, 0] = 0
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


def _spans_from_offsets(offs_M2: np.ndarray, lens_M: np.ndarray, text_bytes: bytes) -> np.ndarray:
    """Slow path: spans from byte offsets in the original text, grouped where offsets overlap.

    Args:
        offs_M2: int64 [M, 2] byte offsets of content tokens in the original text.
        lens_M: int64 [M] decoded byte length of each token.
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
    out = np.zeros((m, 2), dtype=np.int64)
    for first, stop, gs, ge, total in groups:
        if total == ge - gs:
            ends = gs + np.cumsum(lens_M[first:stop])
            out[first:stop, 1] = ends
            out[first:stop, 0] = ends - lens_M[first:stop]
        else:
            out[first:stop] = ge
            out[first, 0] = gs
    return out


def _is_whitespace(raw: bytes) -> bool:
    """True if the bytes decode to whitespace only (a gap the tokenizer dropped on purpose)."""
    return raw.decode("utf-8", "replace").isspace()
