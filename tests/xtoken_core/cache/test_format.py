"""The teacher cache's shards: every codec reads back what was written (fp32 exactly, the
quantized ones within their step), and targets read back decode to the topk transport's
dense logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xtoken_core.cache.format import Codec, decode_positions, encode_positions
from xtoken_core.cache.manifest import (
    FORMAT_NAME,
    key_shard,
    parse_shard,
    update_manifest,
    write_json_atomic,
)
from xtoken_core.cache.reader import CacheReader, missing_line
from xtoken_core.cache.writer import ShardWriter, entry_of_file
from xtoken_core.wire.topk import TopK, decode_topk, encode_topk

W, K = 70_000, 8  # a vocab past uint16: the ids take 4 bytes


def _cache(tmp_path, codec: Codec, rows: dict, row_group_rows: int = 2):
    write_json_atomic(
        tmp_path / "manifest.json",
        {
            "format": FORMAT_NAME,
            "format_version": 1,
            "codec": codec.as_dict(),
            "k": K,
            "width": W,
            "shards": [],
            "builders": {},
        },
    )
    writer = ShardWriter(tmp_path, codec, W, K, (0, 1), row_group_rows=row_group_rows)
    for key, (teacher_ids, targets) in rows.items():
        writer.add(key, teacher_ids, *(t.numpy() for t in targets))
    entry = writer.flush()
    update_manifest(tmp_path, lambda m: m["shards"].append(entry))
    return entry


def _rows(seed: int = 0, n: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        U = int(torch.randint(1, 17, (1,), generator=g))
        logits = torch.randn(U, W, generator=g) * 3
        out[f"file:{i + 1}"] = (
            torch.randint(0, W, (U,), generator=g).int().numpy(),
            encode_topk(logits, K),
        )
    return out


@pytest.mark.parametrize("ids", ["delta", "plain"])
def test_fp32_targets_read_back_decode_to_the_transports_dense_logits_bit_for_bit(tmp_path, ids):
    rows = _rows()
    _cache(tmp_path, Codec(ids, "fp32"), rows)
    reader = CacheReader(tmp_path)
    for key, (teacher_ids, sent) in rows.items():
        got = reader.get(key)
        assert (got.teacher_ids_U == teacher_ids).all()
        read = TopK(
            *(torch.from_numpy(a) for a in (got.ids_UK, got.logprobs_UK, got.rest_U, got.lse_U))
        )
        assert torch.equal(decode_topk(read, W), decode_topk(sent, W))


@pytest.mark.parametrize("codec, step", [("bf16", 2**-7), ("u8", 1 / 510)])
def test_quantized_log_probs_stay_within_half_a_step_and_the_top_one_is_exact(codec, step):
    rng = np.random.default_rng(1)
    ids_UK = np.stack([rng.choice(W, K, replace=False) for _ in range(6)])
    lp_UK = -np.sort(rng.random((6, K)).astype(np.float32) * 20, axis=1)
    cols = encode_positions(ids_UK, lp_UK, Codec("delta", codec), W)
    cols = {k: v.tobytes() if k.startswith("topk") else v for k, v in cols.items()}
    got_ids, got_lp = decode_positions(cols, 6, K, Codec("delta", codec), W)
    order = np.argsort(ids_UK, axis=1)
    assert (got_ids == np.take_along_axis(ids_UK, order, 1)).all()
    want = np.take_along_axis(lp_UK, order, 1)
    span = (lp_UK.max(1) - lp_UK.min(1))[:, None] if codec == "u8" else np.abs(want)
    assert (np.abs(got_lp - want) <= span * step + 1e-6).all()
    if codec == "u8":
        assert (got_lp.max(1) == lp_UK.max(1)).all()


def test_rows_are_found_by_key_across_row_groups_and_a_missing_key_raises(tmp_path):
    rows = _rows(n=7)
    _cache(tmp_path, Codec(), rows, row_group_rows=3)
    reader = CacheReader(tmp_path)
    assert len(reader) == 7
    for key in reversed(list(rows)):  # out of order: each row group read again as needed
        assert reader.get(key).key == key
    with pytest.raises(KeyError):
        reader.get("file:99")
    assert reader.missing(["file:1", "file:99"]) == ["file:99"]


def test_a_shard_on_disk_gives_the_entry_the_writer_recorded(tmp_path):
    entry = _cache(tmp_path, Codec(), _rows())
    assert entry_of_file(tmp_path, tmp_path / entry["path"]) == entry


def test_keys_spread_over_builder_shards_the_same_way_every_time():
    keys = [f"abc/data.jsonl:{i}" for i in range(1000)]
    owners = [key_shard(k, 4) for k in keys]
    assert owners == [key_shard(k, 4) for k in keys]
    assert all(150 < owners.count(i) < 350 for i in range(4))
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_the_missing_line_names_the_count_some_keys_and_their_builder_shards():
    line = missing_line("c", ["a:1", "a:2", "a:3", "a:4"], 2)
    assert "lacks 4 sample(s)" in line and "'a:1'" in line and "..." in line
    assert "builder shard(s)" in line and "/2" in line


def test_an_unknown_codec_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="u8, u4, bf16, fp32"):
        Codec("delta", "int4")
    with pytest.raises(ValueError, match="fp32, fp16"):
        Codec("delta", "u8", "bf8")


@pytest.mark.parametrize("logprobs, steps", [("u8", 255), ("u4", 15)])
@pytest.mark.parametrize("scalars", ["fp32", "fp16"])
@pytest.mark.parametrize("k", [7, 8])  # U x K odd and even: the 4-bit codes' last byte
def test_stepped_log_probs_decode_within_half_a_stored_step(logprobs, steps, scalars, k):
    rng = np.random.default_rng(2)
    U = 5
    ids_UK = np.stack([rng.choice(W, k, replace=False) for _ in range(U)])
    lp_UK = -np.sort(rng.random((U, k)).astype(np.float32) * 20, axis=1)
    codec = Codec("delta", logprobs, scalars)
    cols = encode_positions(ids_UK, lp_UK, codec, W)
    assert cols["topk_logprobs"].size == (U * k if logprobs == "u8" else (U * k + 1) // 2)
    cols = {n: v.tobytes() if n.startswith("topk") else v for n, v in cols.items()}
    got_ids, got_lp = decode_positions(cols, U, k, codec, W)
    order = np.argsort(ids_UK, axis=1)
    assert (got_ids == np.take_along_axis(ids_UK, order, 1)).all()
    want = np.take_along_axis(lp_UK, order, 1)
    scale_U = np.asarray(cols["lp_scale"], np.float32)
    assert (scale_U * steps >= lp_UK.max(1) - lp_UK.min(1)).all()  # a step never too small
    max_U = np.asarray(cols["lp_max"], np.float32)
    half = scale_U[:, None] / 2 + np.abs(max_U - lp_UK.max(1))[:, None]
    assert (np.abs(got_lp - want) <= half + 1e-5).all()
    assert (got_lp.max(1) == max_U).all()


def test_fp16_floats_shard_reads_back_within_their_rounding(tmp_path):
    rows = _rows()
    _cache(tmp_path, Codec("delta", "u4", "fp16"), rows)
    reader = CacheReader(tmp_path)
    for key, (teacher_ids, sent) in rows.items():
        got = reader.get(key)
        assert (got.teacher_ids_U == teacher_ids).all()
        assert got.rest_U.dtype == np.float32 and got.lse_U.dtype == np.float32
        for read, want in ((got.rest_U, sent[2]), (got.lse_U, sent[3])):
            want = want.numpy()
            assert np.allclose(read, want, rtol=2**-11, atol=2**-24)
        lp = sent[1].numpy()
        span = lp.max(1) - lp.min(1)
        top = np.sort(got.logprobs_UK, axis=1)[:, ::-1]
        assert (np.abs(top[:, 0] - lp.max(1)) <= np.abs(lp.max(1)) * 2**-11 + 1e-6).all()
        assert np.allclose(np.sort(got.logprobs_UK, 1), np.sort(lp, 1), atol=span.max() / 30 + 0.01)


def test_stored_ids_outside_the_vocab_are_refused_where_they_are_read():
    ids_UK = np.array([[1, 5, W - 1]])
    lp_UK = np.array([[-0.5, -1.0, -2.0]], dtype=np.float32)
    for codec in (Codec("delta", "fp32"), Codec("plain", "fp32")):
        cols = encode_positions(ids_UK, lp_UK, codec, W)
        got, _ = decode_positions(cols, 1, 3, codec, W)
        assert sorted(got[0].tolist()) == [1, 5, W - 1]
        with pytest.raises(ValueError, match=rf"^top-k ids outside \[0, {W - 1}\)"):
            decode_positions(cols, 1, 3, codec, W - 1)  # read as a narrower teacher's
