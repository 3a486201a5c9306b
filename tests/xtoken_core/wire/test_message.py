"""Round trips of encode_message / decode_message: dtypes, shapes, jagged fields, zero copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xtoken_core.wire import (
    HEADER_SIZE,
    INLINE_MAX_BYTES,
    MESSAGE_TYPES,
    WIRE_DTYPES,
    JaggedColumn,
    WireError,
    WireLimits,
    decode_message,
    encode_message,
)


def _rand(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def _roundtrip(body, **kw):
    frames = encode_message("reply", body, request_id=5, **kw)
    msg = decode_message([bytes(f) for f in frames])
    assert msg.msg_type == "reply" and msg.request_id == 5
    return msg.body, frames


def _nested(rows):
    return JaggedColumn.from_rows(rows, dtype=rows[0].dtype if rows else None).to_nested()


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 3), (4, 3, 2, 65)])
@pytest.mark.parametrize("inline_max_bytes", [0, INLINE_MAX_BYTES])
def test_every_dtype_and_shape_round_trips_bit_exactly(dtype_name, shape, inline_max_bytes):
    x = _rand(shape, WIRE_DTYPES[dtype_name])
    body, _ = _roundtrip({"x": x}, inline_max_bytes=inline_max_bytes)
    y = body["x"]
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.T,
        lambda t: t[1:, ::2],
        lambda t: t[:, 3],
        lambda t: t.expand(2, 6, 8)[1],
        lambda t: t.unsqueeze(0).transpose(0, 2),
    ],
    ids=["transpose", "step-slice", "column", "expanded", "permuted"],
)
def test_non_contiguous_and_sliced_tensors_arrive_equal_and_contiguous(make):
    x = make(torch.arange(48, dtype=torch.float32).reshape(6, 8))
    body, _ = _roundtrip({"x": x}, inline_max_bytes=0)
    assert body["x"].is_contiguous()
    assert torch.equal(body["x"], x)


def test_plain_values_containers_and_tuples_round_trip():
    body = {
        "n": None,
        "b": True,
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 1.5,
        "s": "héllo",
        "by": b"\x00\xff",
        "l": [1, [2, {"k": "v"}]],
        "t": (1, 2),
        "d": {},
    }
    got, _ = _roundtrip(body)
    assert got == dict(body, t=[1, 2])


def test_empty_body_is_two_frames():
    frames = encode_message("stats", {})
    assert len(frames) == 2 and len(frames[0]) == HEADER_SIZE
    assert decode_message(frames).body == {}


def test_tensors_nested_in_lists_and_dicts_round_trip():
    x, y = torch.arange(300), torch.ones(2, 2)
    got, _ = _roundtrip({"a": [x, {"y": y}]}, inline_max_bytes=0)
    assert torch.equal(got["a"][0], x) and torch.equal(got["a"][1]["y"], y)


def test_small_tensors_travel_inline_and_large_ones_as_frames():
    _, frames = _roundtrip({"small": torch.zeros(10), "large": torch.zeros(1000)})
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == 4000


@pytest.mark.parametrize("n", [1, 10, 1000])
def test_a_jagged_field_of_n_samples_is_exactly_two_frames(n):
    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, 20, (n,), generator=g).tolist()
    body = {
        "ids": _nested([torch.arange(k) for k in lengths]),
        "align": _nested([torch.randn(k, 3) for k in lengths]),
        "mask": torch.ones(n, dtype=torch.bool),
    }
    frames = encode_message("reply", body, inline_max_bytes=0)
    assert len(frames) == 2 + 2 * 2 + 1


@pytest.mark.parametrize(
    "lengths", [[3, 0, 2], [0, 0, 0], [0], [5], [0, 4], []], ids=lambda x: str(x)
)
@pytest.mark.parametrize("inner", [(), (2,), (2, 3)])
@pytest.mark.parametrize("jagged", ["nested", "column"])
def test_jagged_rows_round_trip_including_empty_rows_and_zero_rows(lengths, inner, jagged):
    rows = [torch.randn(k, *inner) for k in lengths]
    column = (
        JaggedColumn.from_rows(rows, dtype=torch.float32)
        if rows
        else JaggedColumn(torch.empty(0, *inner), torch.zeros(1, dtype=torch.int64))
    )
    frames = encode_message("reply", {"j": column.to_nested()}, inline_max_bytes=0)
    got = decode_message(frames, jagged=jagged).body["j"]
    if jagged == "nested":
        assert got.is_nested and got.layout == torch.jagged and got.size(0) == len(lengths)
        got = JaggedColumn.from_nested(got)
    assert isinstance(got, JaggedColumn)
    assert got.lengths().tolist() == lengths
    assert tuple(got.values.shape[1:]) == inner
    for a, b in zip(got.rows(), rows):
        assert torch.equal(a, b)


def test_jagged_column_and_nested_tensor_encode_to_the_same_frames():
    rows = [torch.arange(4), torch.arange(0), torch.arange(300)]
    column = JaggedColumn.from_rows(rows)
    a = encode_message("reply", {"j": column})
    b = encode_message("reply", {"j": column.to_nested()})
    assert [bytes(f) for f in a] == [bytes(f) for f in b]


def test_a_narrowed_nested_tensor_with_holes_sends_only_its_live_rows():
    base = torch.arange(12).reshape(3, 4)
    narrowed = torch.nested.narrow(
        base, 1, torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1]), layout=torch.jagged
    )
    got = decode_message(encode_message("reply", {"j": narrowed}), jagged="column").body["j"]
    assert [r.tolist() for r in got.rows()] == [[0, 1], [], [10]]


def test_bfloat16_jagged_values_round_trip():
    rows = [torch.randn(k, 8).bfloat16() for k in (5, 0, 70)]
    got = decode_message(encode_message("reply", {"j": _nested(rows)}), jagged="column")
    assert got.body["j"].values.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got.body["j"].rows(), rows))


def test_encode_aliases_tensor_memory_and_decode_aliases_frame_memory():
    x = torch.arange(100_000, dtype=torch.float32)
    frames = encode_message("reply", {"x": x})
    frame = np.frombuffer(frames[2], dtype=np.uint8)
    assert frame.ctypes.data == x.data_ptr()  # zero copy on encode
    received = [bytearray(f) for f in frames]
    y = decode_message(received).body["x"]
    assert y.data_ptr() == np.frombuffer(received[2], np.uint8).ctypes.data  # zero copy
    y_copy = decode_message(received, copy=True).body["x"]
    assert y_copy.data_ptr() != y.data_ptr() and torch.equal(y_copy, x)


def test_large_message_round_trips_as_one_frame_per_tensor():
    x = torch.randn(50 * 1024 * 1024 // 4)
    frames = encode_message("reply", {"x": x, "m": "big"})
    assert len(frames) == 3
    got = decode_message(frames).body
    assert got["m"] == "big" and torch.equal(got["x"], x)


def test_numpy_arrays_and_scalars_decode_as_torch():
    got, _ = _roundtrip({"a": np.arange(6, dtype=">i4").reshape(2, 3), "s": np.float32(2.5)})
    assert got["a"].dtype == torch.int32 and got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["s"] == 2.5


def _strided_nested():
    return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


@pytest.mark.parametrize(
    "value, path",
    [
        ({1, 2}, "body.v"),
        (object(), "body.v"),
        ({"ok": [1, {3: 4}]}, "body.v.ok[1]"),
        (torch.zeros(3, dtype=torch.complex64), "body.v"),
        (np.array(["a"], dtype=object), "body.v"),
        (2**64, "body.v"),
        (_strided_nested, "body.v"),
    ],
    ids=["set", "object", "int-key", "complex", "np-object", "int-overflow", "strided-nested"],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_unsupported_values_raise_type_error_naming_their_path(value, path):
    value = value() if value is _strided_nested else value
    with pytest.raises(TypeError, match=path.replace("[", r"\[").replace(".", r"\.")):
        encode_message("reply", {"v": value})


def test_body_must_be_a_dict():
    with pytest.raises(TypeError, match="dict"):
        encode_message("reply", [1, 2])


def test_unknown_message_type_is_refused_on_encode():
    with pytest.raises(WireError) as e:
        encode_message("launch_missiles", {})
    assert e.value.code == "unknown_type"


@pytest.mark.parametrize("request_id", [-1, 2**64, True, 1.0])
def test_bad_request_ids_are_refused(request_id):
    with pytest.raises(WireError) as e:
        encode_message("hello", {}, request_id=request_id)
    assert e.value.code == "bad_header"


def test_request_id_and_type_survive_for_every_message_type():
    for i, name in enumerate(MESSAGE_TYPES):
        msg = decode_message(encode_message(name, {"k": i}, request_id=2**64 - 1 - i))
        assert (msg.msg_type, msg.request_id, msg.body) == (name, 2**64 - 1 - i, {"k": i})


@pytest.mark.parametrize(
    "limits, body",
    [
        (WireLimits(max_frames=3), {"a": torch.zeros(1000), "b": torch.zeros(1000)}),
        (WireLimits(max_body_bytes=100), {"s": "x" * 200}),
        (WireLimits(max_message_bytes=1000), {"a": torch.zeros(1000)}),
        (WireLimits(max_ndim=2), {"a": torch.zeros(1, 1, 1)}),
    ],
    ids=["frames", "body", "message", "ndim"],
)
def test_limits_are_enforced_on_encode_and_decode(limits, body):
    with pytest.raises(WireError) as e:
        encode_message("reply", body, limits=limits)
    assert e.value.code in ("too_large", "bad_body")
    frames = encode_message("reply", body)
    with pytest.raises(WireError) as e:
        decode_message(frames, limits=limits)
    assert e.value.code in ("too_large", "bad_body")


def test_deep_nesting_is_refused():
    body: dict = {}
    inner = body
    for _ in range(100):
        inner["d"] = {}
        inner = inner["d"]
    with pytest.raises(WireError, match="deeper"):
        encode_message("reply", body)


def test_wire_limits_reject_nonsense():
    with pytest.raises(ValueError, match="max_frames"):
        WireLimits(max_frames=1)
    with pytest.raises(ValueError, match="max_body_bytes"):
        WireLimits(max_body_bytes=0)


def test_bad_jagged_option_is_a_caller_error():
    with pytest.raises(ValueError, match="jagged"):
        decode_message(encode_message("stats", {}), jagged="padded")
