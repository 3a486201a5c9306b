"""encode_bytes_to_ids: running-text tokenization without specials or a dummy-prefix space."""

import json
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.tokenizers import load_tokenizer, registry
from xtoken_core.tokenizers.hf import HFTokenizer, without_prefix_space

NAMES = ["qwen3", "deepseek", "mistral", "llama3", "smollm2"]


def smollm2_spellable(text):
    """The text without the characters SmolLM2's BPE drops: its vocab has no token for six ASCII
    control bytes nor for the UTF-8 lead bytes 0xF1/0xF2 (code points U+40000..U+BFFFF)."""
    return "".join(
        c for c in text if c not in "\x04\x06\x13\x14\x16\x1d" and not 0x40000 <= ord(c) < 0xC0000
    )


plain_texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)


def spelled(tok, ids):
    return b"".join(tok.token_bytes(i) for i in ids)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(text=plain_texts)
def test_plain_ids_spell_exactly_the_text(name, text):
    tok = load_tokenizer(name)
    if name == "qwen3":  # Qwen3 normalizes to NFC: only NFC text can be spelled back
        text = unicodedata.normalize("NFC", text)
    if name == "smollm2":
        text = smollm2_spellable(text)
    ids = tok.encode_bytes_to_ids(text)
    assert spelled(tok, ids) == text.encode("utf-8")
    assert not any(tok.is_special(i) for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_plain_encoding_adds_no_leading_space(name):
    tok = load_tokenizer(name)
    for text in ("ing", "Hello", "\n", "é", "  x", "中文"):
        assert spelled(tok, tok.encode_bytes_to_ids(text)) == text.encode("utf-8")
    assert tok.encode_bytes_to_ids("") == []


def test_mistral_plain_encoding_differs_from_encode_only_by_the_dummy_prefix():
    tok = load_tokenizer("mistral")
    encoded = tok.encode("ing", add_special_tokens=False)
    assert spelled(tok, encoded.ids) == b" ing"  # the model's own view: a dummy "▁"
    assert encoded.spans.tolist() == [[0, 3]]  # ... that covers no byte of the text
    assert spelled(tok, tok.encode_bytes_to_ids("ing")) == b"ing"


@pytest.mark.parametrize("name", NAMES)
def test_batch_plain_encoding_equals_one_by_one(name):
    tok = load_tokenizer(name)
    texts = ["ing", "", " Hello world", "你好 🇺🇸", "a\n\tb"]
    assert tok.encode_batch_bytes_to_ids(texts) == [tok.encode_bytes_to_ids(t) for t in texts]
    assert tok.encode_batch_bytes_to_ids([]) == []


def _toy_metaspace_tokenizer(tmp_path, style):
    """A small trained BPE with a prefix space: a Metaspace pre-tokenizer or a Prepend normalizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world, singing the thing"] * 10, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("style", ["metaspace", "prepend"])
def test_hf_prefix_space_is_turned_off_for_plain_encoding(tmp_path, style):
    tok = _toy_metaspace_tokenizer(tmp_path, style)
    native = tok._tok.encode("ing", add_special_tokens=False).ids
    assert spelled(tok, native).startswith(b" ")  # the tokenizer itself adds the space
    for text in ("ing", "hello world", "thing, sing"):
        assert spelled(tok, tok.encode_bytes_to_ids(text)) == text.encode("utf-8")
    spans = tok.encode("hello world").spans.tolist()
    assert spans[0][0] == 0 and spans[-1][1] == len("hello world")  # encode keeps its spans


def test_without_prefix_space_leaves_byte_level_specs_alone():
    spec = json.loads(registry.bundled_path("qwen3").read_text(encoding="utf-8"))
    assert without_prefix_space(spec) is None
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True}
    fixed = without_prefix_space(spec)
    assert fixed["pre_tokenizer"]["add_prefix_space"] is False
    assert spec["pre_tokenizer"]["add_prefix_space"] is True  # the input is not modified
