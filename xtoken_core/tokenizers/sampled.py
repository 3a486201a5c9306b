"""Token ids a model sampled, placed on the bytes of the text they spell (encode's inverse).

A model samples ids, not text: its sequence may end inside a UTF-8 character (a byte-level BPE
token or a ``<0xHH>`` byte-fallback piece that holds part of one), or hold bytes that are no
UTF-8 at all. :func:`decode_sampled` keeps the ids as sampled and cuts the sequence to its
longest prefix of whole tokens whose bytes are valid UTF-8: at an incomplete last character
that is the last whole character at a token boundary; an invalid byte anywhere cuts there too
(and further back where the token holding it also held the end of the character before it), so
that the text is always valid and both tokenizers see exactly the same bytes.

The spans are the ones :meth:`XTokenizer.encode` gives where the token bytes spell the text:
each content token covers its own bytes in order (the first one without SentencePiece's dummy
prefix space), each special token an empty span at the end of the previous content token. So
for ids that are the tokenizer's own tokenization of a text, the result equals ``encode(text)``
(``test_sampled.py`` holds both to equality).

Legend: N tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xtoken_core.tokenizers.base import ROLE_CONTENT, TokenizedText, XTokenizer


def decode_sampled(tokenizer: XTokenizer, ids: Sequence[int] | np.ndarray) -> TokenizedText:
    """The text that sampled ids spell, with each token's byte span in it.

    Args:
        tokenizer: the tokenizer whose vocabulary the ids are of.
        ids: N token ids as sampled (any int sequence or array).

    Returns:
        A TokenizedText of the longest prefix of ``ids`` whose bytes are valid UTF-8 (all N
        when they are), its ``text`` the decoded bytes.

    Raises:
        ValueError: an id outside the tokenizer's vocabulary (names the id).
    """
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    for token_id in ids_N[(ids_N < 0) | (ids_N >= tokenizer.vocab_size)][:1].tolist():
        tokenizer.token_bytes(token_id)  # raises, naming the id and the vocabulary
    roles_N = tokenizer.roles_table[ids_N].astype(np.int8)
    is_content_N = roles_N == ROLE_CONTENT
    pieces = [tokenizer.token_bytes(int(i)) if c else b"" for i, c in zip(ids_N, is_content_N)]
    content = np.flatnonzero(is_content_N)
    # SentencePiece puts a dummy "▁" before the text: no byte of it (as encode's spans say)
    dummy = getattr(tokenizer, "_dummy_prefix", False)
    if dummy and len(content) and pieces[content[0]][:1] == b" ":
        pieces[content[0]] = pieces[content[0]][1:]
    lens_N = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    ends_N = np.cumsum(lens_N)
    data = b"".join(pieces)
    keep = len(ids_N)
    while True:
        try:
            text = data.decode("utf-8")
            break
        except UnicodeDecodeError as e:
            # tokens reaching past the valid prefix go, with everything after them; the cut may
            # itself end inside a character whose last bytes were in the first token cut (a
            # token of a character's tail and an invalid byte), so decode again
            keep = int(np.argmax(ends_N[:keep] > e.start))
            data = data[: int(ends_N[keep - 1]) if keep else 0]
    ends_N = ends_N[:keep]
    spans_N2 = np.stack([ends_N - lens_N[:keep], ends_N], axis=1)
    return TokenizedText(ids_N[:keep].copy(), spans_N2, roles_N[:keep].copy(), text)
