"""TensorDicts cross the wire as ordinary fields and come back equal, as views of the frames."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from xtoken_core.data_plane.tensordict_io import (
    NonTensorLeafError,
    fields_to_tensordict,
    tensordict_to_fields,
)
from xtoken_core.wire import JaggedColumn, decode_message, encode_message

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16]
DTYPES += [torch.bfloat16, torch.float32, torch.float64]

# msgpack values that come back equal (tuples come back as lists, so none are generated)
objects = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _objects(items):
    return NonTensorStack(*(NonTensorData(o) for o in items))


def _through_the_wire(fields, jagged="column"):
    frames = [bytes(f) for f in encode_message("put", {"fields": fields}, inline_max_bytes=0)]
    return frames, decode_message(frames, jagged=jagged).body["fields"]


def _assert_equal(got, want):
    """Same batch, keys, leaf kinds and contents."""
    assert got.batch_size == want.batch_size
    assert sorted(got.keys()) == sorted(want.keys())
    for name in want.keys():
        g, w = got.get(name), want.get(name)
        assert type(g) is type(w), name
        if isinstance(w, NonTensorData | NonTensorStack):
            assert g.tolist() == w.tolist(), name
        elif w.is_nested:
            assert g.is_nested and g.layout == torch.jagged, name
            assert torch.equal(g.offsets(), w.offsets()) and torch.equal(g.values(), w.values())
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), name


def _random_td(lengths, dtype, items, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    rows = [torch.randint(0, 2, (k, 2), generator=g).to(dtype) for k in lengths]
    return TensorDict(
        {
            "jagged": JaggedColumn.from_rows(rows, dtype=dtype).to_nested(),
            "dense": torch.randint(0, 2, (n, 3), generator=g).to(dtype),
            "objects": _objects(items),
        },
        batch_size=[n],
    )


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=6).flatmap(
        lambda lengths: st.tuples(
            st.just(lengths),
            st.sampled_from(DTYPES),
            st.lists(objects, min_size=len(lengths), max_size=len(lengths)),
        )
    )
)
def test_a_tensordict_comes_back_equal_from_the_wire(case):
    lengths, dtype, items = case
    td = _random_td(lengths, dtype, items)
    _, fields = _through_the_wire(tensordict_to_fields(td, [f"k{i}" for i in range(len(lengths))]))
    _assert_equal(fields_to_tensordict(fields), td)


def test_nested_leaves_from_a_nested_decode_come_back_too():
    td = _random_td([3, 0, 5], torch.float32, ["a", "b", "c"])
    _, fields = _through_the_wire(tensordict_to_fields(td), jagged="nested")
    _assert_equal(fields_to_tensordict(fields), td)


def test_jagged_leaves_view_the_received_frames():
    rows = [torch.arange(k, dtype=torch.float32) for k in (700, 0, 900)]
    td = TensorDict({"x": JaggedColumn.from_rows(rows).to_nested()}, batch_size=[3])
    frames, fields = _through_the_wire(tensordict_to_fields(td))
    got = fields_to_tensordict(fields)
    spans = [(torch.frombuffer(f, dtype=torch.uint8).data_ptr(), len(f)) for f in frames[2:]]
    ptr = got.get("x").values().data_ptr()
    assert any(start <= ptr < start + size for start, size in spans)


def test_a_batch_is_a_fixed_number_of_frames_whatever_its_size():
    for n in (1, 64):
        lengths = [300 + i for i in range(n)]
        td = _random_td(lengths, torch.int64, [{"i": i, "pad": "x" * 600} for i in range(n)])
        frames, _ = _through_the_wire(tensordict_to_fields(td))
        # header + body, then values + offsets per jagged leaf (2 of them) and one dense buffer
        assert len(frames) <= 2 + 2 * 2 + 1, n


def test_batch_wide_non_tensor_data_comes_back_as_non_tensor_data():
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    td.set_non_tensor("source", {"corpus": "a", "split": 1})
    _, fields = _through_the_wire(tensordict_to_fields(td))
    got = fields_to_tensordict(fields)
    assert isinstance(got.get("source"), NonTensorData)
    assert got.get_non_tensor("source") == {"corpus": "a", "split": 1}


def test_rows_of_batch_wide_objects_that_differ_come_back_as_a_stack():
    def column(value, n):
        td = TensorDict({}, batch_size=[n])
        td["source"] = value
        return tensordict_to_fields(td)["source"]

    a, b = column("a", 2), column("b", 1)
    mixed = JaggedColumn.from_rows([*a.rows(), *b.rows()])
    got = fields_to_tensordict({"source": mixed})
    assert isinstance(got.get("source"), NonTensorStack)
    assert got.get("source").tolist() == ["a", "a", "b"]


def test_a_non_tensor_leaf_msgpack_cannot_carry_is_refused_in_one_line_naming_it():
    td = TensorDict({"meta": _objects([1, object()])}, batch_size=[2])
    with pytest.raises(NonTensorLeafError) as refused:
        tensordict_to_fields(td)
    message = str(refused.value)
    assert "'meta'" in message and "\n" not in message
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, TypeError)


def test_uint8_leaves_stay_tensors_unless_their_rows_would_read_as_objects():
    raw = JaggedColumn.from_rows([torch.tensor([0xD4, 79, 0], dtype=torch.uint8)[:2]])
    td = TensorDict({"bytes": raw.to_nested()}, batch_size=[1])
    _, fields = _through_the_wire(tensordict_to_fields(td))
    assert fields_to_tensordict(fields).get("bytes").is_nested  # a 2-byte fixext 1 is too short
    row = torch.frombuffer(
        bytearray(msgpack.packb(msgpack.ExtType(79, b"\xc0"))), dtype=torch.uint8
    )
    lookalike = TensorDict({"bytes": JaggedColumn.from_rows([row]).to_nested()}, batch_size=[1])
    with pytest.raises(ValueError, match="'bytes' is uint8 rows that read back as msgpack"):
        tensordict_to_fields(lookalike)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensordicts_the_queue_cannot_hold_are_refused_naming_the_leaf():
    with pytest.raises(ValueError, match=r"batch_size=\[2, 3\]"):
        tensordict_to_fields(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(ValueError, match="2 keys"):
        tensordict_to_fields(TensorDict({"x": torch.zeros(3)}, batch_size=[3]), ["a", "b"])
    inner = TensorDict({"y": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(ValueError, match="'inner' is a nested TensorDict"):
        tensordict_to_fields(TensorDict({"inner": inner}, batch_size=[2]))
    strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="'s' is a nested tensor of layout torch.strided"):
        tensordict_to_fields(TensorDict({"s": strided}, batch_size=[2]))
    with pytest.raises(TypeError, match="expected a TensorDict"):
        tensordict_to_fields({"x": torch.zeros(2)})


def test_fields_that_disagree_on_rows_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        fields_to_tensordict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="disagree"):
        fields_to_tensordict({"a": torch.zeros(2)}, keys=["k"])
    with pytest.raises(TypeError, match="'a'"):
        fields_to_tensordict({"a": [1, 2]})
    assert fields_to_tensordict({}, keys=[]).batch_size == (0,)


def test_received_jagged_leaves_pad_to_their_longest_row_with_torch():
    rows = [torch.arange(k) for k in (3, 0, 2)]
    td = TensorDict({"x": JaggedColumn.from_rows(rows).to_nested()}, batch_size=[3])
    _, fields = _through_the_wire(tensordict_to_fields(td))
    padded = torch.nested.to_padded_tensor(fields_to_tensordict(fields).get("x"), -1)
    assert padded.tolist() == [[0, 1, 2], [-1, -1, -1], [0, 1, -1]]
