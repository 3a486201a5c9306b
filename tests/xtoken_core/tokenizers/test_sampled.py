"""decode_sampled: sampled ids placed on the text they spell, cut at the longest valid UTF-8
prefix; equal to encode() where the ids are the tokenizer's own tokenization."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.tokenizers import ROLE_CONTENT, load_tokenizer
from xtoken_core.tokenizers.sampled import decode_sampled

# a byte-level BPE (tokens may hold part of a character) and a SentencePiece with byte fallback
# (``<0xHH>`` pieces, a dummy prefix space)
NAMES = ["qwen3", "mistral"]


@functools.cache
def tok(name: str):
    return load_tokenizer(name)


@functools.cache
def partial_ids(name: str) -> list[int]:
    """Ids of tokens whose bytes are no valid UTF-8 alone (a single byte >= 0x80, a character's
    head or tail, a tail with the next character's head): a run of them is rarely valid."""
    t = tok(name)
    out = []
    for i in range(t.vocab_size):
        try:
            t.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


def byte_token(t, value: int) -> int:
    """The id of the token that is the one byte ``value``."""
    return next(i for i in range(t.vocab_size) if t.token_bytes(i) == bytes([value]))


def all_bytes(t, ids) -> bytes:
    """The bytes of the content tokens, the first without a dummy-prefix space."""
    pieces = [t.token_bytes(int(i)) for i in ids if t.roles_table[int(i)] == ROLE_CONTENT]
    if pieces and getattr(t, "_dummy_prefix", False) and pieces[0][:1] == b" ":
        pieces[0] = pieces[0][1:]
    return b"".join(pieces)


@st.composite
def sampled(draw, name: str) -> list[int]:
    """What a student might sample: a text's tokens, random ids, pieces of characters (invalid or
    incomplete UTF-8, often at the end)."""
    t = tok(name)
    head = t.encode(draw(st.text(max_size=30))).ids.tolist() if draw(st.booleans()) else []
    pick = st.one_of(st.integers(0, t.vocab_size - 1), st.sampled_from(partial_ids(name)))
    return head + draw(st.lists(pick, max_size=24))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "text", ["", "Hello world", " two  spaces", "Ünïcödé \U0001f600 and 你好", "a\n\tb"]
)
def test_the_tokenizers_own_ids_decode_to_what_encode_gives(name, text):
    t = tok(name)
    encoded = t.encode(text)
    got = decode_sampled(t, encoded.ids)
    assert got.text == text
    assert np.array_equal(got.ids, encoded.ids)
    assert np.array_equal(got.spans, encoded.spans)
    assert np.array_equal(got.roles, encoded.roles)


@pytest.mark.parametrize("name", NAMES)
def test_an_incomplete_last_character_is_cut_at_the_last_whole_one(name):
    t = tok(name)
    ids = t.encode("ab \U0001f600").ids.tolist()
    got = decode_sampled(t, ids[:-1])  # the emoji's last piece never came
    assert got.text in ("ab", "ab ")  # with or without the space before the emoji
    assert got.ids.tolist() == ids[: len(got)]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_sampled_ids_give_the_longest_valid_prefix_of_whole_tokens(name, data):
    t = tok(name)
    ids = data.draw(sampled(name))
    got = decode_sampled(t, ids)
    n = len(got)
    assert got.ids.tolist() == ids[:n]  # as sampled: a prefix, never rewritten
    text_bytes = got.text.encode("utf-8")
    assert text_bytes == all_bytes(t, ids[:n])
    content = got.roles == ROLE_CONTENT
    # spans tile the text in order; specials are empty
    assert (got.spans[:, 1] >= got.spans[:, 0]).all()
    assert (got.spans[~content, 0] == got.spans[~content, 1]).all()
    ends = got.spans[content, 1]
    assert (ends[:-1] == got.spans[content, 0][1:]).all() if len(ends) else True
    assert (int(ends[-1]) if len(ends) else 0) == len(text_bytes)
    for m in range(n + 1, len(ids) + 1):  # the longest: every longer prefix is no valid UTF-8
        with pytest.raises(UnicodeDecodeError):
            all_bytes(t, ids[:m]).decode("utf-8")


def test_a_cut_that_ends_inside_a_character_is_cut_again():
    """F0 9D 90 | 82 AC: the token holding the invalid byte AC also holds the last byte of the
    four-byte character before it, so cutting that token leaves F0 9D 90 (no whole character):
    the cut goes back to the last whole one (what a rollout once died of)."""
    t = tok("qwen3")
    tail = next(i for i in range(t.vocab_size) if t.token_bytes(i) == b"\x82\xac")
    head = t.encode("ab").ids.tolist()
    ids = head + [byte_token(t, b) for b in (0xF0, 0x9D, 0x90)] + [tail]
    got = decode_sampled(t, ids)
    assert got.text == "ab"
    assert got.ids.tolist() == head
