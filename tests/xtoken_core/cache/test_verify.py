"""Verifying a teacher cache: a whole cache passes; a changed byte, a cut file, a missing shard
or a count that disagrees is named with its path and byte offset."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.cache.format import Codec
from xtoken_core.cache.manifest import FORMAT_NAME, update_manifest, write_json_atomic
from xtoken_core.cache.verify import verify_cache
from xtoken_core.cache.writer import ShardWriter
from xtoken_core.errors import SettingsError
from xtoken_core.wire.topk import encode_topk

W, K = 1000, 4


@pytest.fixture
def cache(tmp_path):
    write_json_atomic(
        tmp_path / "manifest.json",
        {"format": FORMAT_NAME, "format_version": 1, "codec": Codec().as_dict(), "k": K,
         "width": W, "shards": [], "builders": {"0/1": {"done": True}}},
    )  # fmt: skip
    writer = ShardWriter(tmp_path, Codec(), W, K, (0, 1), row_group_rows=2)
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        t = encode_topk(torch.randn(5, W, generator=g), K)
        writer.add(f"k{i}", torch.arange(5).int().numpy(), *(x.numpy() for x in t))
    entry = writer.flush()
    update_manifest(tmp_path, lambda m: m["shards"].append(entry))
    return tmp_path, entry


def test_a_whole_cache_verifies(cache):
    report = verify_cache(cache[0])
    assert report.ok and report.samples == 6 and report.teacher_tokens == 30


def test_a_changed_byte_is_named_by_its_row_group_and_offset(cache):
    d, entry = cache
    path = d / entry["path"]
    data = bytearray(path.read_bytes())
    rg = entry["row_groups"][2]
    data[rg["offset"] + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    (problem,) = verify_cache(d).problems
    assert problem.path == str(path) and problem.offset == rg["offset"]
    assert "row group 2" in problem.line() and f"byte offset {rg['offset']}" in problem.line()


def test_a_truncated_shard_is_named_with_where_it_ends(cache):
    d, entry = cache
    path = d / entry["path"]
    path.write_bytes(path.read_bytes()[:300])
    (problem,) = verify_cache(d).problems
    assert problem.offset == 300 and "truncated" in problem.message


def test_a_missing_shard_and_an_unlisted_one_are_told_apart(cache):
    d, entry = cache
    (d / entry["path"]).rename(d / "shards" / "b0of1-000009.parquet")
    report = verify_cache(d)
    assert "missing" in report.problems[0].message
    assert report.unlisted == ["b0of1-000009.parquet"]


def test_a_folder_without_a_manifest_is_no_cache(tmp_path):
    with pytest.raises(SettingsError, match="no teacher cache"):
        verify_cache(tmp_path)
