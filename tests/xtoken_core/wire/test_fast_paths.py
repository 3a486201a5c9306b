"""The encoder's fast path and the raw (pre-encoded) carriers produce the exact wire bytes of
the checked path; the decoder's small-tensor shortcuts decode what the general path decodes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.wire import (
    DEFAULT_LIMITS,
    INLINE_MAX_BYTES,
    WIRE_DTYPES,
    JaggedColumn,
    RawJagged,
    RawTensor,
    WireError,
    decode_message,
    encode_message,
)
from xtoken_core.wire.message import _Encoder
from xtoken_core.wire.tensors import tensor_bytes


def _checked_path_frames(body, inline_max_bytes=INLINE_MAX_BYTES):
    """Frames 1.. as the path-naming encoder (the fast path's fallback) builds them."""
    enc = _Encoder(DEFAULT_LIMITS, inline_max_bytes)
    packed = msgpack.packb(enc.value(body, "body", 0), use_bin_type=True)
    return [packed, *[bytes(b) for b in enc.buffers]]


def _frames(body, inline_max_bytes=INLINE_MAX_BYTES):
    frames = encode_message("reply", body, request_id=9, inline_max_bytes=inline_max_bytes)
    return [bytes(f) for f in frames[1:]]


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(sorted(WIRE_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    t = torch.arange(int(np.prod(shape, dtype=np.int64)), dtype=torch.float64) % 2
    t = t.reshape(shape).to(WIRE_DTYPES[dtype])
    if draw(st.booleans()) and t.ndim == 2:
        t = t.t()  # non-contiguous: only the checked path copies it
    return t


_values = st.recursive(
    st.one_of(_scalars, _tensors()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(
    body=st.dictionaries(st.text(max_size=6), _values, max_size=5),
    inline=st.sampled_from([0, 64, INLINE_MAX_BYTES]),
)
def test_fast_encoder_writes_the_same_bytes_as_the_checked_encoder(body, inline):
    assert _frames(body, inline) == _checked_path_frames(body, inline)


def test_fast_encoder_errors_still_name_the_path():
    with pytest.raises(TypeError, match=r"body\.a\.b\[1\]"):
        encode_message("reply", {"a": {"b": [1, {2: 3}]}})
    with pytest.raises(TypeError, match=r"body\.x"):
        encode_message("reply", {"x": 2**64})


def test_tensors_needing_grad_or_views_of_other_dtypes_take_the_checked_path_and_arrive_equal():
    w = torch.randn(3, 4, requires_grad=True)
    body = {"w": w, "t": torch.arange(12).reshape(3, 4)[:, 1:3]}
    got = decode_message(encode_message("reply", body)).body
    assert torch.equal(got["w"], w.detach())
    assert torch.equal(got["t"], body["t"])


@pytest.mark.parametrize("inline_max_bytes", [0, 64, INLINE_MAX_BYTES])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_raw_jagged_encodes_to_the_frames_of_the_column_it_stands_for(inline_max_bytes, dtype):
    column = JaggedColumn.from_rows([torch.ones(n, 3).to(dtype) for n in (2, 0, 5)])
    raw = RawJagged(
        dtype, (3,), 3, 7, tensor_bytes(column.values), tensor_bytes(column.offsets).tobytes()
    )
    assert _frames({"f": raw}, inline_max_bytes) == _frames({"f": column}, inline_max_bytes)
    back = decode_message(encode_message("reply", {"f": raw}), jagged="column").body["f"]
    assert torch.equal(back.values, column.values) and torch.equal(back.offsets, column.offsets)
    assert torch.equal(raw.to_column().values, column.values)


@pytest.mark.parametrize("inline_max_bytes", [0, INLINE_MAX_BYTES])
def test_raw_tensor_encodes_to_the_frames_of_the_tensor_it_stands_for(inline_max_bytes):
    t = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    raw = RawTensor(torch.int32, (4, 10), tensor_bytes(t))
    assert _frames({"t": raw}, inline_max_bytes) == _frames({"t": t}, inline_max_bytes)


def test_raw_carriers_with_the_wrong_byte_count_are_refused_naming_the_path():
    raw = RawJagged(torch.int64, (), 1, 3, b"\x00" * 16, b"\x00" * 16)
    with pytest.raises(ValueError, match=r"body\.fields\.f"):
        encode_message("reply", {"fields": {"f": raw}})
    with pytest.raises(ValueError, match="RawTensor"):
        encode_message("reply", {"t": RawTensor(torch.int16, (5,), b"\x00" * 4)})


@pytest.mark.parametrize("offsets", [[0, 3, 2, 4], [1, 2, 4], [0, 2, 3]])
def test_small_inline_offsets_are_checked_like_large_ones(offsets):
    raw = RawJagged(
        torch.int8, (), len(offsets) - 1, 4, b"\x01" * 4, np.array(offsets, np.int64).tobytes()
    )
    frames = encode_message("reply", {"f": raw})  # the producer's promise is not trusted
    with pytest.raises(WireError, match="offsets") as info:
        decode_message(frames)
    assert info.value.code == "bad_body"


def test_decoded_inline_tensors_are_writable_and_do_not_alias_the_body():
    frames = encode_message("reply", {"t": torch.arange(6).reshape(2, 3)})
    body = bytes(frames[1])
    t = decode_message([frames[0], body]).body["t"]
    t += 1
    assert t.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert decode_message([frames[0], body]).body["t"].tolist() == [[0, 1, 2], [3, 4, 5]]
