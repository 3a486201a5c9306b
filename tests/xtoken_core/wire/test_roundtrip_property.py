"""Property: any body built from wire values decodes to an equal body; odd frame carriers work."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtoken_core.wire import WIRE_DTYPES, JaggedColumn, decode_message, encode_message

_DTYPES = sorted(WIRE_DTYPES)


@st.composite
def tensors(draw):
    dtype = WIRE_DTYPES[draw(st.sampled_from(_DTYPES))]
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2 if dtype == torch.bool else 100, tuple(shape), generator=g).to(dtype)
    if x.ndim >= 2 and draw(st.booleans()):
        x = x.transpose(0, 1)  # non-contiguous
    return x


@st.composite
def jagged(draw):
    dtype = WIRE_DTYPES[draw(st.sampled_from(_DTYPES))]
    inner = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    lengths = draw(st.lists(st.integers(0, 6), max_size=5))
    rows = [torch.ones(k, *inner).to(dtype) for k in lengths]
    if not rows:
        return JaggedColumn(torch.empty(0, *inner, dtype=dtype), torch.zeros(1, dtype=torch.int64))
    return JaggedColumn.from_rows(rows)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_values = st.recursive(
    st.one_of(_scalars, tensors(), jagged()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _equal(a, b) -> bool:
    if isinstance(b, JaggedColumn):
        return (
            isinstance(a, JaggedColumn)
            and a.values.dtype == b.values.dtype
            and a.values.shape == b.values.shape
            and torch.equal(a.values, b.values)
            and torch.equal(a.offsets, b.offsets)
        )
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), _values, max_size=4), st.sampled_from([0, 16, 1024]))
@pytest.mark.timeout(120)
def test_any_wire_body_round_trips(body, inline_max_bytes):
    frames = encode_message("reply", body, request_id=3, inline_max_bytes=inline_max_bytes)
    msg = decode_message([bytes(f) for f in frames], jagged="column")
    assert _equal(msg.body, body)


class _FrameLike:
    """Mimics zmq.Frame: no buffer protocol of its own, a ``.buffer`` memoryview."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_frame_objects_with_a_buffer_attribute_decode():
    x = torch.arange(1000)
    frames = [_FrameLike(bytes(f)) for f in encode_message("reply", {"x": x})]
    assert torch.equal(decode_message(frames).body["x"], x)


def test_misaligned_frames_decode_to_correct_values():
    x = torch.arange(1000, dtype=torch.float64)
    frames = encode_message("reply", {"x": x})
    shifted = memoryview(b"\0" + bytes(frames[2]))[1:]  # odd address
    assert torch.equal(decode_message([frames[0], frames[1], shifted]).body["x"], x)


def test_read_only_frames_decode_without_warnings():
    frames = [bytes(f) for f in encode_message("reply", {"x": torch.arange(1000)})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode_message(frames)


@pytest.mark.gpu
def test_cuda_tensors_travel_as_cpu_copies():
    x = torch.arange(1000, device="cuda")
    nested = JaggedColumn.from_rows([torch.arange(3), torch.arange(400)])
    nested_cuda = torch.nested.nested_tensor_from_jagged(
        nested.values.cuda(), nested.offsets.cuda()
    )
    body = decode_message(encode_message("reply", {"x": x, "j": nested_cuda}), jagged="column").body
    assert body["x"].device.type == "cpu" and torch.equal(body["x"], x.cpu())
    assert torch.equal(body["j"].values, nested.values)
