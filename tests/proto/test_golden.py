"""Golden wire vectors in proto/golden: encode(body) == golden frames and decode(golden) == body."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from xtoken_core.ipc.shm import ShmReader, ShmTensorHandle
from xtoken_core.wire import WIRE_DTYPES, JaggedColumn, decode_message, encode_message
from xtoken_core.wire.shm import ShmField

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "proto" / "golden"
REGEN = os.environ.get("XTOKEN_REGEN_PROTO") == "1"


def _tensor(dtype: str, values) -> dict:
    t = torch.tensor(values, dtype=WIRE_DTYPES[dtype])
    return {"$tensor": {"dtype": dtype, "shape": list(t.shape), "values": values}}


# The pool segment the shared-memory golden messages reference (decoded against a stand-in).
SHM_NAME, SHM_SIZE = "xtk_4242_00112233445566ff", 4096

# The golden messages, as JSON. Regenerating writes their frames; the tests read the files only.
CASES = {
    "hello": {
        "msg_type": "hello",
        "request_id": 1,
        "inline_max_bytes": 1024,
        "body": {"protocol_version": 1, "client": "golden-client"},
    },
    "put": {
        "msg_type": "put",
        "request_id": 2,
        # Small, so that some buffers travel as frames and some inline.
        "inline_max_bytes": 16,
        "body": {
            "partition": "train",
            "keys": ["s0", "s1", "s2"],
            "fields": {
                "input_ids": {
                    "$jagged": {
                        "dtype": "int64",
                        "inner_shape": [],
                        "rows": [[1, 2, 3], [], [4, 5]],
                    }
                },
                "alignment": {
                    "$jagged": {
                        "dtype": "float32",
                        "inner_shape": [2],
                        "rows": [[[0.5, 1.0]], [], [[-2.0, 3.25], [0.0, -0.125]]],
                    }
                },
                "scale": _tensor("bfloat16", [[1.0, -0.5], [0.25, 2.0], [-3.0, 0.0]]),
            },
            "timeout_ms": 5000,
        },
    },
    "claim": {
        "msg_type": "claim",
        "request_id": 3,
        "inline_max_bytes": 1024,
        "body": {
            "partition": "train",
            "task": "trainer",
            "required_fields": ["input_ids", "teacher_handle"],
            "fields": None,
            "batch_size": 8,
            "timeout_ms": 1000,
            "lease_ms": 60000,
        },
    },
    "reserve": {
        "msg_type": "reserve",
        "request_id": 4,
        "inline_max_bytes": 1024,
        "body": {"nbytes": 41943040, "timeout_ms": 30000},
    },
    "put_shm": {
        "msg_type": "put",
        "request_id": 5,
        "inline_max_bytes": 1024,
        # A put by reference into a reserved pool region: no buffer frames at all.
        "body": {
            "partition": "train",
            "keys": ["s0", "s1"],
            "fields": {
                "hidden": {
                    "$shm": {
                        "dtype": "float32",
                        "shape": [5, 2],
                        "name": SHM_NAME,
                        "size": SHM_SIZE,
                        "offset": 0,
                        "offsets_at": 64,
                        "num_rows": 2,
                    }
                },
                "score": {
                    "$shm": {
                        "dtype": "bfloat16",
                        "shape": [2],
                        "name": SHM_NAME,
                        "size": SHM_SIZE,
                        "offset": 128,
                    }
                },
            },
            "timeout_ms": 30000,
            "reservation": "0123456789abcdef0123456789abcdef",
        },
    },
    "claim_shm_reply": {
        "msg_type": "reply",
        "request_id": 6,
        "inline_max_bytes": 1024,
        # A claim with shm: true answered by reference; jagged offsets rebased and inline.
        "body": {
            "keys": ["s1"],
            "fields": {
                "hidden": {
                    "$shm": {
                        "dtype": "float32",
                        "shape": [3, 2],
                        "name": SHM_NAME,
                        "size": SHM_SIZE,
                        "offset": 16,
                        "offsets": [0, 3],
                    }
                },
            },
            "lease_id": 7,
        },
    },
    "error": {
        "msg_type": "error",
        "request_id": 2,
        "inline_max_bytes": 1024,
        "body": {
            "code": "queue_full",
            "message": "capacity_bytes=1024 reached; raise --capacity-bytes or consume faster",
            "retryable": True,
            "request_type": "put",
        },
    },
}


def _from_json(x):
    if isinstance(x, dict) and "$shm" in x:
        spec = x["$shm"]
        dtype, shape = WIRE_DTYPES[spec["dtype"]], tuple(spec["shape"])
        nbytes = dtype.itemsize * int(torch.tensor(shape).prod()) if shape else dtype.itemsize
        handle = ShmTensorHandle(
            spec["name"],
            spec["size"],
            spec["offset"],
            nbytes,
            dtype,
            shape,
            spec.get("offsets_at"),
            spec.get("num_rows", 0),
        )
        offsets = spec.get("offsets")
        return ShmField(
            handle, None if offsets is None else torch.tensor(offsets).numpy().tobytes()
        )
    if isinstance(x, dict) and "$tensor" in x:
        spec = x["$tensor"]
        t = torch.tensor(spec["values"], dtype=WIRE_DTYPES[spec["dtype"]])
        return t.reshape(spec["shape"])
    if isinstance(x, dict) and "$jagged" in x:
        spec = x["$jagged"]
        dtype = WIRE_DTYPES[spec["dtype"]]
        rows = [
            torch.tensor(r, dtype=dtype).reshape(len(r), *spec["inner_shape"]) for r in spec["rows"]
        ]
        return JaggedColumn.from_rows(rows, dtype=dtype).to_nested()
    if isinstance(x, dict):
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


def _assert_same(got, want, path="body", base=None):
    if isinstance(want, ShmField):  # a view of the stand-in segment at the declared place
        h = want.handle
        values = got.values if isinstance(got, JaggedColumn) else got
        assert values.dtype == h.dtype and tuple(values.shape) == h.shape, path
        assert values.data_ptr() - base.data_ptr() == h.offset, path
        if want.offsets is not None:
            assert got.offsets.numpy().tobytes() == want.offsets, path
        elif h.offsets_at is not None:
            assert got.offsets.data_ptr() - base.data_ptr() == h.offsets_at, path
        return
    if isinstance(got, JaggedColumn):
        got = got.to_nested()
    if isinstance(want, torch.Tensor) and want.is_nested:
        assert isinstance(got, torch.Tensor) and got.is_nested, path
        assert torch.equal(got.offsets(), want.offsets()), path
        assert got.values().dtype == want.values().dtype, path
        assert torch.equal(got.values(), want.values()), path
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}", base)
    else:
        assert type(got) is type(want) and got == want, path


def _encode(case: dict) -> list[bytes]:
    frames = encode_message(
        case["msg_type"],
        _from_json(case["body"]),
        request_id=case["request_id"],
        inline_max_bytes=case["inline_max_bytes"],
    )
    return [bytes(f) for f in frames]


@pytest.mark.skipif(not REGEN, reason="set XTOKEN_REGEN_PROTO=1 to rewrite golden vectors")
def test_regenerate_golden_vectors():
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, case in CASES.items():
        out = dict(case, frames_hex=[f.hex() for f in _encode(case)])
        (GOLDEN / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")


def _load(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_file_describes_the_message_the_test_knows(name):
    golden = _load(name)
    assert {k: golden[k] for k in CASES[name]} == json.loads(json.dumps(CASES[name]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoding_the_golden_body_gives_the_golden_bytes(name):
    golden = _load(name)
    assert [f.hex() for f in _encode(golden)] == golden["frames_hex"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoding_the_golden_bytes_gives_the_golden_body(name):
    golden = _load(name)
    # the shm messages are decoded against a stand-in segment: jagged offsets [0, 3, 5] at 64
    base_S = torch.zeros(SHM_SIZE, dtype=torch.uint8)
    base_S[64:88].view(torch.int64).copy_(torch.tensor([0, 3, 5]))
    reader = ShmReader(segments={SHM_NAME: base_S})
    msg = decode_message(
        [bytes.fromhex(h) for h in golden["frames_hex"]], shm=reader, jagged="column"
    )
    assert msg.msg_type == golden["msg_type"]
    assert msg.request_id == golden["request_id"]
    _assert_same(msg.body, _from_json(golden["body"]), base=base_S)


def test_golden_shm_messages_carry_no_buffer_frame_and_reference_the_segment():
    for name in ("put_shm", "claim_shm_reply"):
        assert len(_load(name)["frames_hex"]) == 2, name
    assert SHM_NAME.encode() in bytes.fromhex(_load("put_shm")["frames_hex"][1])


def test_golden_put_sends_each_jagged_field_as_at_most_two_frames():
    golden = _load("put")
    # 2 jagged fields x (values + offsets) over 16 bytes each; the bf16 tensor (12 B) is inline.
    assert len(golden["frames_hex"]) == 2 + 4
