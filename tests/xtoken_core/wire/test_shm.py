"""Shared-memory ext types 3/4: encode as references, adopt on decode, bad references are bad_body."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

from xtoken_core.ipc import SHM_DIR, ShmReader, ShmSegment, ShmTensorHandle
from xtoken_core.ipc.shm import ShmRegion
from xtoken_core.wire import JaggedColumn, WireError, decode_message, encode_message
from xtoken_core.wire.shm import (
    EXT_SHM_JAGGED,
    EXT_SHM_TENSOR,
    ShmField,
    fields_into_region,
    fields_layout_bytes,
    fields_nbytes,
    fields_to_shm,
)


def _put_fields():
    return {
        "ids": JaggedColumn.from_rows([torch.arange(5), torch.arange(3)]),
        "logits": torch.nested.nested_tensor(
            [torch.randn(2, 4), torch.randn(6, 4)], layout=torch.jagged
        ),
        "mask": torch.tensor([True, False]),
    }


def test_shm_fields_travel_without_frames_and_decode_as_views_of_the_adopted_segment():
    fields = _put_fields()
    segment, shm_fields = fields_to_shm(fields)
    frames = encode_message("put", {"partition": "p", "keys": ["a", "b"], "fields": shm_fields})
    assert len(frames) == 2  # header + body: the bytes stay in shared memory
    msg = decode_message(frames, jagged="column", shm=True)
    got = msg.body["fields"]
    assert not os.path.exists(os.path.join(SHM_DIR, segment.name))  # adopted
    assert torch.equal(got["ids"].values, fields["ids"].values)
    assert torch.equal(got["ids"].offsets, fields["ids"].offsets)
    assert torch.equal(got["logits"].values, fields["logits"].values())
    assert torch.equal(got["mask"], fields["mask"])
    storages = {got[k].untyped_storage().data_ptr() for k in ("mask",)} | {
        got[k].values.untyped_storage().data_ptr() for k in ("ids", "logits")
    }
    assert len(storages) == 1  # one mapping for the whole message
    segment.unlink()


def test_nested_decode_gives_jagged_nested_tensors():
    segment, shm_fields = fields_to_shm({"x": JaggedColumn.from_rows([torch.ones(2, 3)])})
    msg = decode_message(encode_message("put", {"fields": shm_fields}), shm=True)
    assert msg.body["fields"]["x"].is_nested
    segment.unlink()


def test_a_receiver_that_does_not_opt_in_refuses_shm_references_and_leaves_them():
    segment, shm_fields = fields_to_shm({"x": torch.arange(4)})
    frames = encode_message("put", {"fields": shm_fields})
    with pytest.raises(WireError) as e:
        decode_message(frames)
    assert e.value.code == "bad_body"
    assert os.path.exists(os.path.join(SHM_DIR, segment.name))
    segment.unlink()


@pytest.mark.parametrize(
    "code, payload, match",
    [
        (EXT_SHM_TENSOR, ["int64", [4], "xtk_1_0123456789abcdef", 64, 0], "does not exist"),
        (EXT_SHM_TENSOR, ["int64", [4], "/etc/passwd", 64, 0], "not an xtoken segment"),
        (EXT_SHM_TENSOR, ["int64", [4], "xtk_1_0123456789abcdef", 64], "must be"),
        (EXT_SHM_TENSOR, ["object", [4], "xtk_1_0123456789abcdef", 64, 0], "dtype"),
        (EXT_SHM_TENSOR, ["int64", [-4], "xtk_1_0123456789abcdef", 64, 0], "shape"),
        (EXT_SHM_TENSOR, ["int64", [100], "xtk_1_0123456789abcdef", 64, 0], "outside"),
        (EXT_SHM_JAGGED, ["int64", [], 2, 4, "xtk_1_0123456789abcdef", 64, 0], "must be"),
        (EXT_SHM_JAGGED, ["int64", [], 2, -1, "x", 64, 0, 32], "R="),
        (EXT_SHM_TENSOR, "garbage", "must be"),
    ],
)
def test_bad_shm_references_are_bad_body(code, payload, match):
    body = msgpack.packb(
        {"x": msgpack.ExtType(code, msgpack.packb(payload, use_bin_type=True))},
        use_bin_type=True,
    )
    header = encode_message("put", {})[0]
    with pytest.raises(WireError, match=match) as e:
        decode_message([header, body], shm=True)
    assert e.value.code == "bad_body"


def test_fields_nbytes_counts_values_and_offsets():
    fields = _put_fields()
    assert fields_nbytes(fields) == (8 * 8 + 3 * 8) + (8 * 4 * 4 + 3 * 8) + 2


def _pool_segment(size: int = 1 << 16):
    """A segment this process owns, as a server's pool holds it: (segment, its uint8 view)."""
    segment = ShmSegment.create(size)
    return segment, segment.base()


def test_fields_built_in_a_region_travel_by_reference_and_the_others_are_copied_in():
    segment, base_S = _pool_segment()
    try:
        region = ShmRegion(segment.name, segment.size, base_S, 0, segment.size, "t")
        built = region.empty((3, 4), torch.float32)
        built.copy_(torch.arange(12.0).view(3, 4))
        ids = JaggedColumn.from_rows([torch.arange(5), torch.arange(2)])
        fields = {"built": built, "ids": ids, "note": "kept"}
        need = fields_layout_bytes({"built": built, "ids": ids})
        assert need == 64 + 64 + 64  # 48 B, 56 B of values, 24 B of offsets: 64-aligned each
        refs = fields_into_region(fields, region)
        assert refs["note"] == "kept"
        assert refs["built"].handle.offset == built.data_ptr() - base_S.data_ptr()  # not copied
        frames = encode_message("put", {"fields": refs})
        assert len(frames) == 2
        reader = ShmReader(segments={segment.name: base_S})
        got = decode_message(frames, jagged="column", shm=reader).body["fields"]
        assert got["built"].data_ptr() == built.data_ptr()
        assert torch.equal(got["ids"].values, ids.values)
        assert torch.equal(got["ids"].offsets, ids.offsets)
        assert os.path.exists(os.path.join(SHM_DIR, segment.name))  # known: never unlinked
        assert [r[0] for r in reader.refs] == [segment.name] * 3
        with pytest.raises(ValueError, match="no room"):
            fields_into_region({"big": torch.zeros(1 << 15)}, region)
    finally:
        segment.unlink()


def test_jagged_references_with_inline_offsets_decode_and_bad_inline_offsets_are_bad_body():
    segment, base_S = _pool_segment()
    try:
        base_S[:40].view(torch.int64).copy_(torch.arange(5))
        handle = ShmTensorHandle(segment.name, segment.size, 0, 40, torch.int64, (5,))
        field = ShmField(handle, torch.tensor([0, 2, 2, 5]).numpy().tobytes())
        reader = ShmReader(segments={segment.name: base_S})
        frames = encode_message("reply", {"fields": {"x": field}})
        got = decode_message(frames, jagged="column", shm=reader).body["fields"]["x"]
        assert [r.tolist() for r in got.rows()] == [[0, 1], [], [2, 3, 4]]
        for bad in ([0, 3, 2, 5], [1, 2, 2, 5], [0, 2, 2, 6]):
            field = ShmField(handle, torch.tensor(bad).numpy().tobytes())
            frames = encode_message("reply", {"fields": {"x": field}})
            with pytest.raises(WireError, match="shm") as e:
                decode_message(frames, jagged="column", shm=reader)
            assert e.value.code == "bad_body"
        payload = ["int64", [], 3, 5, segment.name, segment.size, 0, b"\x00" * 7]
        body = msgpack.packb({"x": msgpack.ExtType(EXT_SHM_JAGGED, msgpack.packb(payload))})
        with pytest.raises(WireError, match="inline offsets"):
            decode_message([frames[0], body], shm=reader)
    finally:
        segment.unlink()
