"""decode_message on garbage and on mutated valid messages: WireError, never anything else."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtoken_core.wire import (
    EXT_JAGGED,
    EXT_TENSOR,
    PROTOCOL_VERSION,
    WIRE_ERROR_CODES,
    JaggedColumn,
    WireError,
    WireLimits,
    decode_message,
    encode_message,
)
from xtoken_core.wire.header import HEADER_STRUCT, MAGIC, MESSAGE_TYPES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = WireLimits(max_message_bytes=1 << 20, max_frames=16, max_body_bytes=1 << 16)


def _decode_or_wire_error(frames, **kw):
    try:
        return decode_message(frames, **kw)
    except WireError as e:
        assert e.code in WIRE_ERROR_CODES
        assert str(e)
        return None


def _header(type_code=1, version=PROTOCOL_VERSION, flags=0, magic=MAGIC, request_id=9):
    return HEADER_STRUCT.pack(magic, version, flags, type_code, request_id)


def _valid_frames() -> list[bytes]:
    rows = [torch.arange(k) for k in (3, 0, 200)]
    body = {
        "partition": "p",
        "keys": ["a", "b", "c"],
        "fields": {
            "ids": JaggedColumn.from_rows(rows),
            "x": torch.randn(3, 100),
            "m": torch.ones(3, dtype=torch.bool),
        },
    }
    return [bytes(f) for f in encode_message("put", body, inline_max_bytes=64)]


VALID = _valid_frames()


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
@pytest.mark.timeout(120)
def test_arbitrary_frame_lists_raise_wire_error(frames):
    assert _decode_or_wire_error(frames, limits=SMALL) is None or len(frames) >= 2


@FUZZ
@given(
    st.sampled_from(sorted(MESSAGE_TYPES.values())),
    st.binary(max_size=256),
    st.lists(st.binary(max_size=64), max_size=3),
)
@pytest.mark.timeout(120)
def test_valid_header_with_arbitrary_body_raises_wire_error_or_decodes_a_dict(code, body, extra):
    msg = _decode_or_wire_error([_header(code), body, *extra], limits=SMALL)
    assert msg is None or isinstance(msg.body, dict)


_DESC_VALUES = st.one_of(
    st.integers(-3, 2**50),
    st.binary(max_size=40),
    st.sampled_from(["float32", "bool", "int64", "bfloat16", "nope", ""]),
    st.lists(st.integers(-2, 2**49), max_size=5),
    st.none(),
)


@FUZZ
@given(
    st.sampled_from([EXT_TENSOR, EXT_JAGGED, 3, 127]),
    st.lists(_DESC_VALUES, max_size=7),
    st.lists(st.binary(max_size=96), max_size=3),
)
@pytest.mark.timeout(120)
def test_arbitrary_tensor_descriptors_raise_wire_error_or_decode_consistently(code, desc, extra):
    body = msgpack.packb({"t": msgpack.ExtType(code, msgpack.packb(desc))})
    msg = _decode_or_wire_error([_header(2), body, *extra], limits=SMALL)
    if msg is not None:  # a descriptor that happens to be valid must describe its buffer
        t = msg.body["t"]
        assert isinstance(t, torch.Tensor)


@FUZZ
@given(st.data())
@pytest.mark.timeout(120)
def test_mutated_valid_messages_raise_wire_error_or_decode(data):
    frames = [bytearray(f) for f in VALID]
    op = data.draw(st.sampled_from(["flip", "truncate", "drop", "add", "swap", "extend"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if op == "flip" and frames[i]:
        j = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][j] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif op == "drop":
        del frames[i]
    elif op == "add":
        frames.insert(i, bytearray(data.draw(st.binary(max_size=64))))
    elif op == "swap":
        j = data.draw(st.integers(0, len(frames) - 1))
        frames[i], frames[j] = frames[j], frames[i]
    elif op == "extend":
        frames[i] += data.draw(st.binary(min_size=1, max_size=16))
    _decode_or_wire_error(frames, limits=SMALL)


def _code(frames, **kw) -> str:
    with pytest.raises(WireError) as e:
        decode_message(frames, **kw)
    return e.value.code


def test_wrong_version_is_bad_version():
    assert _code([_header(version=PROTOCOL_VERSION + 1), *VALID[1:]]) == "bad_version"


def test_unknown_type_code_is_unknown_type():
    assert _code([_header(type_code=999), *VALID[1:]]) == "unknown_type"


@pytest.mark.parametrize(
    "header",
    [_header(magic=b"HTTP"), _header(flags=1), _header()[:-1], _header() + b"\0", b""],
    ids=["magic", "flags", "short", "long", "empty"],
)
def test_malformed_headers_are_bad_header(header):
    assert _code([header, *VALID[1:]]) == "bad_header"


def test_a_missing_buffer_frame_is_bad_frames():
    assert _code(VALID[:-1]) == "bad_frames"


def test_an_unreferenced_extra_frame_is_bad_frames():
    assert _code([*VALID, b"\0" * 8]) == "bad_frames"


def test_a_frame_referenced_twice_is_bad_frames():
    desc = msgpack.packb(["int64", [1], 2])
    body = msgpack.packb(
        {"a": msgpack.ExtType(EXT_TENSOR, desc), "b": msgpack.ExtType(EXT_TENSOR, desc)}
    )
    assert _code([_header(2), body, b"\0" * 8]) == "bad_frames"


def test_a_buffer_whose_length_contradicts_the_shape_is_bad_frames():
    desc = msgpack.packb(["float32", [3, 3], 2])
    body = msgpack.packb({"a": msgpack.ExtType(EXT_TENSOR, desc)})
    assert _code([_header(2), body, b"\0" * 35]) == "bad_frames"


def test_a_huge_declared_shape_never_allocates():
    desc = msgpack.packb(["float64", [2**40, 2**40], b""])
    body = msgpack.packb({"a": msgpack.ExtType(EXT_TENSOR, desc)})
    assert _code([_header(2), body]) == "bad_body"


@pytest.mark.parametrize(
    "offsets, r",
    [([0, 5, 3], 3), ([1, 3], 2), ([0, 2], 3), ([], 0)],
    ids=["decreasing", "not-from-zero", "not-to-r", "empty"],
)
def test_inconsistent_jagged_offsets_are_refused(offsets, r):
    n = max(len(offsets) - 1, 0)
    desc = msgpack.packb(
        [
            "int64",
            [],
            n,
            r,
            struct.pack(f"<{r}q", *range(r)),
            struct.pack(f"<{len(offsets)}q", *offsets),
        ]
    )
    body = msgpack.packb({"j": msgpack.ExtType(EXT_JAGGED, desc)})
    assert _code([_header(2), body]) in ("bad_body", "bad_frames")


def test_bool_tensors_must_hold_only_zero_and_one():
    desc = msgpack.packb(["bool", [2], b"\x01\x07"])
    assert (
        _code([_header(2), msgpack.packb({"a": msgpack.ExtType(EXT_TENSOR, desc)})]) == "bad_body"
    )


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2]),
        msgpack.packb({1: 2}),
        msgpack.packb({"t": msgpack.Timestamp(1)}),
        b"\xc1",
    ],
    ids=["not-a-map", "int-key", "timestamp", "reserved-byte"],
)
def test_bodies_that_are_not_maps_of_wire_values_are_bad_body(body):
    assert _code([_header(2), body]) == "bad_body"


@pytest.mark.parametrize("frames", ["abc", b"abc", None, 3, [object(), b""]])
def test_things_that_are_not_frame_lists_are_bad_frames(frames):
    assert _code(frames) == "bad_frames"


def test_oversized_messages_are_too_large_before_parsing():
    assert _code(VALID, limits=WireLimits(max_message_bytes=100)) == "too_large"
    assert _code([b""] * 20, limits=WireLimits(max_frames=16)) == "too_large"
