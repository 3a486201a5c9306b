"""Golden wire vectors in proto/golden: encode(body) == golden frames and decode(golden) == body."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from xtoken_core.wire import WIRE_DTYPES, JaggedColumn, decode_message, encode_message

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "proto" / "golden"
REGEN = os.environ.get("XTOKEN_REGEN_PROTO") == "1"


def _tensor(dtype: str, values) -> dict:
    t = torch.tensor(values, dtype=WIRE_DTYPES[dtype])
    return {"$tensor": {"dtype": dtype, "shape": list(t.shape), "values": values}}


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


def _assert_same(got, want, path="body"):
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
            _assert_same(got[k], want[k], f"{path}.{k}")
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
    msg = decode_message([bytes.fromhex(h) for h in golden["frames_hex"]])
    assert msg.msg_type == golden["msg_type"]
    assert msg.request_id == golden["request_id"]
    _assert_same(msg.body, _from_json(golden["body"]))


def test_golden_put_sends_each_jagged_field_as_at_most_two_frames():
    golden = _load("put")
    # 2 jagged fields x (values + offsets) over 16 bytes each; the bf16 tensor (12 B) is inline.
    assert len(golden["frames_hex"]) == 2 + 4
