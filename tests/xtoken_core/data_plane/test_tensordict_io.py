"""TensorDict <-> queue fields: round trips, zero copy, non-tensor fields, errors, padding."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from xtoken_core.data_plane.tensordict_io import (
    OBJECT_ROW_EXT,
    fields_to_tensordict,
    materialize,
    tensordict_to_fields,
)
from xtoken_core.jagged import JaggedColumn
from xtoken_core.wire import decode_message, encode_message


def _nested(rows, inner=()):
    if not rows:  # nested_tensor() refuses an empty list
        return JaggedColumn(torch.empty(0, *inner), torch.zeros(1, dtype=torch.int64)).to_nested()
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _td(lengths, *, seed=0, text=True):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    fields = {
        "ids": _nested([torch.randint(0, 1000, (k,), generator=g) for k in lengths], ()),
        "hidden": _nested([torch.randn(k, 3, generator=g) for k in lengths], (3,)),
        "score": torch.randn(n, generator=g),
    }
    td = TensorDict(fields, batch_size=[n])
    if text:
        td["text"] = NonTensorStack.from_list([f"row {i} ü" for i in range(n)])
    return td


def _assert_same(got: TensorDict, want: TensorDict) -> None:
    assert got.batch_size == want.batch_size
    assert list(got.keys()) == list(want.keys())
    for name in want.keys():
        a, b = got.get(name), want.get(name)
        if isinstance(b, NonTensorStack | NonTensorData):
            assert type(a) is type(b), name
            assert a.tolist() == b.tolist(), name
        elif b.is_nested:
            assert a.is_nested and a.layout == torch.jagged, name
            assert torch.equal(a.offsets(), b.offsets()), name
            assert torch.equal(a.values(), b.values()), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [0, 0, 0], [7], [0]], ids=str)
def test_round_trip_preserves_fields_lengths_and_non_tensor_fields(lengths):
    td = _td(lengths)
    td["const"] = "same for the batch"
    fields = tensordict_to_fields(td, [f"k{i}" for i in range(len(lengths))])
    assert isinstance(fields["ids"], JaggedColumn) and isinstance(fields["text"], JaggedColumn)
    back = fields_to_tensordict(fields)
    _assert_same(back, td)
    assert back.get("ids").offsets().diff().tolist() == lengths
    assert isinstance(back.get("const"), NonTensorData) and back["const"] == "same for the batch"


def test_round_trip_through_the_wire_views_the_received_frames():
    td = _td([300, 0, 200])
    frames = encode_message("put", {"fields": tensordict_to_fields(td)}, inline_max_bytes=0)
    frames = [bytes(f) for f in frames]  # what a receiver holds
    fields = decode_message(frames, jagged="column").body["fields"]
    back = fields_to_tensordict(fields, ["a", "b", "c"])
    _assert_same(back, td)
    for name in ("ids", "hidden"):
        assert back.get(name).values().data_ptr() == fields[name].values.data_ptr()
        assert back.get(name).offsets().data_ptr() == fields[name].offsets.data_ptr()
    starts = [np.frombuffer(f, np.uint8).ctypes.data for f in frames[2:]]
    assert back.get("hidden").values().data_ptr() in starts


def test_put_fields_are_views_of_the_tensordict():
    td = _td([4, 2])
    fields = tensordict_to_fields(td)
    assert fields["ids"].values.data_ptr() == td.get("ids").values().data_ptr()
    assert fields["score"] is td.get("score")


def test_wire_carries_one_values_and_one_offsets_frame_per_jagged_field():
    for n in (1, 10, 500):
        td = _td(list(range(n)), seed=n)
        td["const"] = NonTensorData({"teacher": "qwen", "t": 1.0}, batch_size=[n])
        fields = tensordict_to_fields(td, [str(i) for i in range(n)])
        frames = encode_message("put", {"fields": fields}, inline_max_bytes=0)
        jagged = 4  # ids, hidden, text, const
        assert len(frames) == 2 + 2 * jagged + 1, n  # + score, one dense frame


def test_an_empty_batch_round_trips_its_tensor_fields():
    td = _td([], text=False)
    back = fields_to_tensordict(tensordict_to_fields(td, []), [])
    _assert_same(back, td)
    assert fields_to_tensordict({}, []).batch_size == torch.Size([0])


def test_objects_are_msgpack_values():
    objs = [None, 3, -1.5, True, "x", b"\x00\xff", [1, [2, {"a": None}]], {"k": [1, 2]}, ""]
    meta = NonTensorStack(*(NonTensorData(o) for o in objs))
    td = TensorDict({"meta": meta}, batch_size=[len(objs)])
    back = fields_to_tensordict(tensordict_to_fields(td))
    assert back.get("meta").tolist() == objs
    td = TensorDict({"t": NonTensorStack(NonTensorData((1, 2)))}, batch_size=[1])
    assert fields_to_tensordict(tensordict_to_fields(td)).get("t").tolist() == [[1, 2]]


def test_a_stack_of_equal_objects_stays_a_stack():
    td = TensorDict({"t": NonTensorStack.from_list(["a", "a"])}, batch_size=[2])
    assert isinstance(fields_to_tensordict(tensordict_to_fields(td)).get("t"), NonTensorStack)


def test_uint8_tensor_fields_are_not_taken_for_objects():
    g = torch.Generator().manual_seed(0)
    raw = JaggedColumn.from_rows(
        [torch.randint(0, 256, (k,), generator=g, dtype=torch.uint8) for k in (5, 0, 9)]
    )
    # one row an object ext value, the other not: still bytes
    obj = msgpack.packb(msgpack.ExtType(OBJECT_ROW_EXT, msgpack.packb("x")))
    mixed = JaggedColumn.from_rows(
        [torch.frombuffer(bytearray(obj), dtype=torch.uint8), torch.arange(4, dtype=torch.uint8)]
    )
    for col in (raw, mixed):
        back = fields_to_tensordict({"b": col})
        assert back.get("b").is_nested and torch.equal(back.get("b").values(), col.values)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_unsupported_fields_raise_naming_the_field():
    strided = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)])
    with pytest.raises(TypeError, match="'s'.*torch.jagged"):
        tensordict_to_fields(TensorDict({"s": strided}, batch_size=[2]))
    with pytest.raises(TypeError, match="'obj'.*msgpack"):
        tensordict_to_fields(
            TensorDict({"obj": NonTensorStack.from_list([object(), 1])}, batch_size=[2])
        )
    with pytest.raises(TypeError, match="'sub'.*flatten_keys"):
        tensordict_to_fields(TensorDict({"sub": {"x": torch.ones(2)}}, batch_size=[2]))
    with pytest.raises(ValueError, match=r"batch_size=\[3\] but 2 keys"):
        tensordict_to_fields(_td([1, 2, 3]), ["a", "b"])
    with pytest.raises(ValueError, match="1-D batch"):
        tensordict_to_fields(TensorDict({"x": torch.ones(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(TypeError, match="expected a TensorDict"):
        tensordict_to_fields({"x": torch.ones(2)})


def test_a_jagged_field_ragged_in_another_dim_raises_naming_it():
    t = _nested([torch.randn(2, 3), torch.randn(4, 3)]).transpose(1, 2)
    td = TensorDict({"tr": t}, batch_size=[2])
    with pytest.raises(ValueError, match="'tr'.*ragged dim"):
        tensordict_to_fields(td)


def test_fields_that_disagree_on_rows_raise():
    with pytest.raises(ValueError, match="disagree"):
        fields_to_tensordict({"a": torch.ones(2)}, ["k"])
    with pytest.raises(TypeError, match="'x'"):
        fields_to_tensordict({"x": "text"})


def _collated(lengths, chunks):
    n = len(lengths)
    return TensorDict(
        {
            "input_ids": _nested([torch.arange(1, k + 1) for k in lengths]),
            "token_mask": _nested([torch.ones(k, dtype=torch.bool) for k in lengths]),
            "alignment_student_chunk_id": _nested([torch.arange(k) // 2 for k in lengths]),
            "alignment_pair_valid": _nested([torch.ones(c, dtype=torch.bool) for c in chunks]),
            "input_lengths": torch.tensor(lengths),
            "text": NonTensorStack.from_list([f"t{i}" for i in range(n)]),
        },
        batch_size=[n],
    )


def test_materialize_padded_pads_by_the_sample_schema():
    td = _collated([3, 0, 5], [2, 0, 3])
    batch = materialize(td, "padded", student_pad_id=7, make_seq_div_by_student=4)
    assert list(batch) == list(td.keys())
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 7, 7, 7, 7, 7],
        [7] * 8,
        [1, 2, 3, 4, 5, 7, 7, 7],
    ]
    assert batch["alignment_student_chunk_id"][0].tolist() == [0, 0, 1, -1, -1, -1, -1, -1]
    assert batch["alignment_student_chunk_id"][1].tolist() == [-1] * 8
    assert batch["token_mask"].sum(1).tolist() == [3, 0, 5]
    assert batch["alignment_pair_valid"].shape == (3, 3)
    assert batch["input_lengths"].tolist() == [3, 0, 5]
    assert batch["text"].dtype == object and batch["text"].tolist() == ["t0", "t1", "t2"]


def test_materialize_padded_needs_the_pad_id_of_a_present_id_field():
    with pytest.raises(ValueError, match="'input_ids'.*student_pad_id"):
        materialize(_collated([1], [1]), "padded")
    with pytest.raises(ValueError, match="layout"):
        materialize(_collated([1], [1]), "ragged")


def test_materialize_jagged_returns_the_nested_tensors():
    td = _collated([2, 1], [1, 1])
    out = materialize(td, "jagged")
    assert out["input_ids"] is td.get("input_ids")
    assert out["text"].tolist() == ["t0", "t1"]
