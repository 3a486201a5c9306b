"""Every bundled tokenizer saved in Hugging Face format loads with ``AutoTokenizer`` offline and
gives the xtoken tokenizer's ids (BOS/EOS insertion included), its specials and chat template."""

from __future__ import annotations

import json
import pathlib

import pytest
from transformers import AutoTokenizer

from xtoken_core.tokenizers import load_tokenizer
from xtoken_core.tokenizers.hf_export import save_hf_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space, trailing space ",
    "  two  spaces\n\n\nthree newlines\ttab\r\nCRLF",
    "Über-naïve café prices: 12,50 € each; 3.14159 and 2718281828.",
    "日本語のテキストと中文文本，한국어 텍스트 🤖🇺🇸",
    "def add(a, b):\n    return a + b  # sum\n",
    "control\x04bytes\x1d and a lone ▁ mark",
    "",
    "x",
]
CHAT = [{"role": "user", "content": "Hello there"}]


def _corpus() -> list[str]:
    """The texts above and slices of a Python source file (code, docstrings, odd spacing)."""
    source = pathlib.Path(json.__file__).read_text(encoding="utf-8")
    return TEXTS + [source[i : i + 400] for i in range(0, 8000, 400)]


@pytest.mark.parametrize("name", ["qwen3", "deepseek", "mistral", "llama3", "smollm2"])
def test_the_saved_tokenizer_encodes_every_text_as_the_xtoken_tokenizer(name, tmp_path):
    save_hf_tokenizer(name, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    tok = load_tokenizer(name)
    for text in _corpus():
        assert hf(text)["input_ids"] == tok.encode(text).ids.tolist(), repr(text)
    assert hf.bos_token_id == tok.bos_id
    assert hf.eos_token_id == tok.eos_id
    if tok.pad_id is not None:
        assert hf.pad_token_id == tok.pad_id


@pytest.mark.parametrize("name", ["qwen3", "smollm2"])
def test_a_chat_template_of_the_source_comes_along(name, tmp_path):
    save_hf_tokenizer(load_tokenizer(name), tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_sentencepiece_tokenizer_keeps_its_control_pieces_special(tmp_path):
    save_hf_tokenizer("mistral", tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert hf.chat_template is None  # the package ships none: nothing is made up
    ids = hf("Hello world")["input_ids"]
    assert ids[0] == hf.bos_token_id == 1
    assert hf.decode(ids, skip_special_tokens=True) == "Hello world"
    inst = hf.convert_tokens_to_ids("[INST]")  # a control piece: never text to SentencePiece
    assert inst != hf.unk_token_id and hf.added_tokens_decoder[inst].special
    chat = hf("[INST] Hi [/INST]")["input_ids"]
    assert hf.decode(chat, skip_special_tokens=True).strip() == "Hi"


def test_a_tokenizer_json_file_alone_saves_with_the_specials_xtoken_found(tmp_path):
    source = tmp_path / "src"
    save_hf_tokenizer("qwen3", source)
    alone = tmp_path / "alone" / "tokenizer.json"
    alone.parent.mkdir()
    alone.write_bytes((source / "tokenizer.json").read_bytes())  # no tokenizer_config.json
    out = tmp_path / "out"
    save_hf_tokenizer(str(alone), out)
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (
        hf("Hello world")["input_ids"] == load_tokenizer("qwen3").encode("Hello world").ids.tolist()
    )
    assert hf.eos_token == "<|endoftext|>"  # found by name, as HFTokenizer does without a config
