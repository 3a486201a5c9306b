"""Shared-memory ext types 3/4: encode as references, adopt on decode, bad references are bad_body."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

from xtoken_core.ipc import SHM_DIR
from xtoken_core.wire import JaggedColumn, WireError, decode_message, encode_message
from xtoken_core.wire.shm import EXT_SHM_JAGGED, EXT_SHM_TENSOR, fields_nbytes, fields_to_shm


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
