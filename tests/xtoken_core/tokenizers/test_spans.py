"""Exact byte spans: token bytes, tiling, split multi-byte characters, SentencePiece, normalizers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.tokenizers import load_tokenizer
from xtoken_core.tokenizers.hf import HFTokenizer
from xtoken_core.tokenizers.spans import char_to_byte_offsets

NAMES = ["qwen3", "deepseek", "mistral", "llama3", "smollm2"]
BYTE_LEVEL = ["qwen3", "deepseek", "llama3", "smollm2"]
FRAGMENTS = [
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "🇺🇸",
    "👨‍👩‍👧",
    "你好世界",
    "é",
    "e\u0301",
    "שלום",
    "مرحبا",
    "1234567890",
    "def f(x):\n    return x",
    "ﬁ",
    "Ａ",
    "\u212b",
    "<|endoftext|>",
    "<s>",
    "▁",
]


def smollm2_drops(text):
    """Whether SmolLM2's BPE drops a character of the text: its vocab has no token for six ASCII
    control bytes nor for the UTF-8 lead bytes 0xF1/0xF2 (code points U+40000..U+BFFFF). A
    neighbouring token's span takes the dropped bytes, except whitespace (0x1D), which stays
    uncovered."""
    return any(c in "\x04\x06\x13\x14\x16\x1d" or 0x40000 <= ord(c) < 0xC0000 for c in text)


texts = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
    ),
    max_size=8,
).map("".join)


def content_pieces(tok, enc):
    text_bytes = enc.text.encode("utf-8")
    content = enc.roles == 0
    del tok
    return text_bytes, enc.spans[content], enc.ids[content]


def assert_tiles(spans_M2, total, dropped_whitespace_in=None):
    """Spans tile [0, total); with ``dropped_whitespace_in`` (the text's bytes), gaps are allowed
    where they hold only whitespace the tokenizer dropped (see the rules in spans.py)."""
    assert (spans_M2[:, 1] >= spans_M2[:, 0]).all()
    if not len(spans_M2):
        return
    if dropped_whitespace_in is None:
        assert spans_M2[0, 0] == 0 and spans_M2[-1, 1] == total
        assert (spans_M2[1:, 0] == spans_M2[:-1, 1]).all()
        return
    bounds = [0] + spans_M2.ravel().tolist() + [total]
    for end, start in zip(bounds[::2], bounds[1::2]):
        assert start >= end
        assert dropped_whitespace_in[end:start].decode().isspace() or start == end


@pytest.mark.parametrize("name", BYTE_LEVEL)
@settings(max_examples=30, deadline=None)
@given(text=texts)
def test_byte_level_token_bytes_concatenate_to_text_and_spans_tile(name, text):
    tok = load_tokenizer(name)
    enc = tok.encode(text)
    text_bytes, spans, ids = content_pieces(tok, enc)
    if name == "smollm2" and smollm2_drops(text):
        pass  # a dropped byte is no token's byte
    elif name != "qwen3":  # Qwen NFC-normalizes, so only non-normalizing families round-trip
        assert b"".join(tok.token_bytes(i) for i in ids.tolist()) == text_bytes
    drops = name == "smollm2" and smollm2_drops(text)
    assert_tiles(spans, len(text_bytes), text_bytes if drops else None)
    # Specials get empty spans.
    assert (enc.spans[enc.roles != 0, 0] == enc.spans[enc.roles != 0, 1]).all()


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=30, deadline=None)
@given(text=texts)
def test_spans_hold_exactly_the_token_bytes_where_text_is_not_normalized(name, text):
    tok = load_tokenizer(name)
    enc = tok.encode(text)
    text_bytes, spans, ids = content_pieces(tok, enc)
    drops = name == "smollm2" and smollm2_drops(text)
    assert_tiles(spans, len(text_bytes), text_bytes if drops else None)
    import unicodedata

    if name == "qwen3" and unicodedata.normalize("NFC", text) != text:
        return
    if name == "mistral" and "\u2581" in text:
        return  # SentencePiece reads a literal "▁" as a space: spans come from its offsets
    if drops:
        return  # a dropped byte is no token's byte
    for k, (tid, (a, b)) in enumerate(zip(ids.tolist(), spans.tolist())):
        piece = tok.token_bytes(tid)
        if name == "mistral" and k == 0 and piece.startswith(b" "):
            piece = piece[1:]  # the dummy prefix covers no byte of the text
        assert text_bytes[a:b] == piece


def test_qwen_flag_emoji_split_tokens_get_exact_disjoint_spans():
    tok = load_tokenizer("qwen3")
    enc = tok.encode("Hi 🇺🇸 there")
    # HF offsets overlap here ((2,4),(3,4),(3,4)); byte spans must not.
    assert enc.spans.tolist() == [[0, 2], [2, 5], [5, 6], [6, 7], [7, 11], [11, 17]]


def test_mistral_dummy_prefix_piece_gets_empty_span_at_start():
    tok = load_tokenizer("mistral")
    enc = tok.encode("123")
    assert tok.token_bytes(int(enc.ids[1])) == b" "
    assert enc.spans.tolist() == [[0, 0], [0, 0], [0, 1], [1, 2], [2, 3]]  # BOS, ▁, 1, 2, 3


def test_mistral_byte_fallback_pieces_cover_one_byte_each():
    tok = load_tokenizer("mistral")
    enc = tok.encode("x Ａ", add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in enc.ids.tolist()]
    assert pieces[-3:] == [b"\xef", b"\xbc", b"\xa1"]
    assert enc.spans.tolist()[-3:] == [[2, 3], [3, 4], [4, 5]]


def test_mistral_leading_spaces_span_only_the_real_space():
    enc = load_tokenizer("mistral").encode("  a", add_special_tokens=False)
    assert enc.spans.tolist() == [[0, 1], [1, 3]]  # "▁▁" holds the dummy and one real space


def test_qwen_nfc_composition_spans_refer_to_original_bytes():
    tok = load_tokenizer("qwen3")
    text = "e\u0301 x"  # NFC composes e + combining acute into one character
    enc = tok.encode(text)
    assert_tiles(enc.spans, len(text.encode()))
    assert enc.spans[0].tolist() == [0, 3]


def test_qwen_nfc_combining_mark_at_the_end_goes_to_its_group_like_mid_text():
    # " n\u0303" -> NFC " ñ" -> tokens " \xc3" + "\xb1": one group for all 4 bytes (the first
    # token takes it, the second gets an empty span at its end), wherever the group stands.
    tok = load_tokenizer("qwen3")
    assert tok.encode(" n\u0303 x").spans.tolist() == [[0, 4], [4, 4], [4, 6]]
    assert tok.encode(" n\u0303").spans.tolist() == [[0, 4], [4, 4]]
    assert tok.encode("\u0303n").spans[0, 0] == 0  # a leading mark goes to the first group


def _tiny_hf(tmp_path, normalizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "fi": 3, "x": 4, "f": 5, "i": 6, "é": 7, "a": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, name="tiny")


def test_lowercase_normalizer_spans_refer_to_original_text(tmp_path):
    from tokenizers import normalizers

    tok = _tiny_hf(tmp_path, normalizers.Lowercase())
    text = "HELLO  World"
    enc = tok.encode(text)
    assert [text.encode()[a:b] for a, b in enc.spans.tolist()] == [b"HELLO", b"World"]


def test_nfkc_normalizer_spans_refer_to_original_text(tmp_path):
    from tokenizers import normalizers

    tok = _tiny_hf(tmp_path, normalizers.NFKC())
    text = "ｈello ﬁ x"  # fullwidth h (3 bytes) and the fi ligature (3 bytes) change under NFKC
    enc = tok.encode(text)
    tb = text.encode()
    assert enc.ids.tolist() == [1, 3, 4]
    assert [tb[a:b] for a, b in enc.spans.tolist()] == ["ｈello".encode(), "ﬁ".encode(), b"x"]


def test_char_to_byte_offsets_counts_utf8_lengths():
    assert char_to_byte_offsets("aé你🙂").tolist() == [0, 1, 3, 6, 10]
    assert char_to_byte_offsets("").tolist() == [0]


def test_truncated_keeps_first_tokens_and_rejects_negative():
    enc = load_tokenizer("llama3").encode("one two three four")
    short = enc.truncated(2)
    assert len(short) == 2 and np.array_equal(short.ids, enc.ids[:2])
    assert enc.truncated(None) is enc
    with pytest.raises(ValueError):
        enc.truncated(-1)


@pytest.mark.parametrize("name", NAMES)
def test_encode_batch_matches_encode_and_handles_empty_text(name):
    tok = load_tokenizer(name)
    batch = tok.encode_batch(["", "a b", "   "])
    assert [x.ids.tolist() for x in batch] == [
        tok.encode(t).ids.tolist() for t in ["", "a b", "   "]
    ]
    assert (batch[0].roles != 0).all()  # empty text: only specials, if any


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_lone_surrogate_text_is_rejected_with_a_value_error(name):
    with pytest.raises(ValueError):
        load_tokenizer(name).encode("a\ud800b")


def _spans_both_ways(tok, text):
    """Spans from the packed (vectorized) spelling check and from the bytes.join check."""
    from xtoken_core.tokenizers.spans import compute_byte_spans

    ids, offsets, chars = tok._raw_encode(text, True)
    content = tok._roles[ids] == 0
    common = dict(
        offsets_are_chars=chars,
        token_bytes=tok._token_bytes,
        token_len=tok._token_len,
        is_content_N=content,
        dummy_prefix=tok._dummy_prefix,
    )
    raw = text.encode("utf-8")
    packed = compute_byte_spans(text, raw, ids, offsets, packed=tok._packed, **common)
    joined = compute_byte_spans(text, raw, ids, offsets, packed=None, **common)
    return packed, joined


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(text=texts)
def test_packed_spelling_check_gives_the_same_spans_as_joining_bytes(name, text):
    packed, joined = _spans_both_ways(load_tokenizer(name), text)
    assert np.array_equal(packed, joined)


@pytest.mark.parametrize("name", NAMES)
def test_offsets_are_read_only_when_the_tokens_do_not_spell_the_text(name):
    from xtoken_core.tokenizers.spans import compute_byte_spans

    tok = load_tokenizer(name)
    calls = []
    # Qwen3 normalizes to NFC: the Angstrom sign U+212B becomes U+00C5, other bytes than the text.
    for text, spelled in (("plain words here", True), ("ﬁ Ａ \u212b", name != "qwen3")):
        ids, offsets, chars = tok._raw_encode(text, True)

        def lazy(offsets=offsets, text=text):
            calls.append(text)
            return offsets() if callable(offsets) else offsets

        got = compute_byte_spans(
            text,
            text.encode("utf-8"),
            ids,
            lazy,
            offsets_are_chars=chars,
            token_bytes=tok._token_bytes,
            token_len=tok._token_len,
            is_content_N=tok._roles[ids] == 0,
            dummy_prefix=tok._dummy_prefix,
            packed=tok._packed,
        )
        assert np.array_equal(got, tok.encode(text).spans)
        assert (text in calls) != spelled


def test_smollm2_digits_are_single_tokens_with_one_byte_spans():
    tok = load_tokenizer("smollm2")
    enc = tok.encode("x 2024 ok")
    assert [tok.token_bytes(i) for i in enc.ids.tolist()] == [
        b"x",
        b" ",
        b"2",
        b"0",
        b"2",
        b"4",
        b" ok",
    ]
    assert enc.spans.tolist() == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 9]]


def test_smollm2_bytes_without_a_token_are_dropped_and_spans_take_them_unless_whitespace():
    tok = load_tokenizer("smollm2")
    cases = (("ab\x06cd", b"abcd"), ("\x06ab", b"ab"), ("x\U00040000y", b"x\x80\x80\x80y"))
    for text, kept in cases:
        enc = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in enc.ids.tolist()) == kept
        assert_tiles(enc.spans, len(text.encode("utf-8")))
    enc = tok.encode("0\x1d0")  # U+001D is whitespace to Python: it stays uncovered
    assert enc.spans.tolist() == [[0, 1], [2, 3]]
