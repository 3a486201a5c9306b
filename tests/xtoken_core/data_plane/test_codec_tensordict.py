"""The TensorDict codec: padding stripped on the writer's side, restored by materialize on the
reader's, response slices with the left shift, and the seed's edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from xtoken_core.data_plane.codec import (
    columns_to_samples,
    materialize,
    maybe_pack_jagged,
    pack_jagged_fields,
    pack_per_token_field,
    response_from_nested,
    samples_to_columns,
    stack_or_nest,
    to_nested_by_length,
    unwrap_wire_stripped_payload,
)
from xtoken_core.wire import JaggedColumn

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.bfloat16, torch.float32]


def _rows(nested: torch.Tensor) -> list[torch.Tensor]:
    return list(nested.unbind(0))


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return JaggedColumn.from_rows(rows).to_nested()


def _padded(lengths, dtype, inner=(), extra=0, seed=0):
    """[N, max(lengths) + extra, *inner] random contents, and the rows it holds."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths, default=0) + extra
    full = torch.randint(0, 100, (len(lengths), s, *inner), generator=g).to(dtype)
    return full, [full[i, :k] for i, k in enumerate(lengths)]


shapes = st.tuples(
    st.lists(st.integers(0, 9), min_size=1, max_size=7),  # row lengths
    st.sampled_from(DTYPES),
    st.sampled_from([(), (3,), (2, 2)]),  # per-token dims
    st.integers(0, 3),  # padding past the longest row
)


# -- round trips ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_stripping_padding_then_materializing_gives_the_padded_tensor_back(shape):
    lengths, dtype, inner, extra = shape
    full, rows = _padded(lengths, dtype, inner, extra)
    nested = to_nested_by_length(full, torch.tensor(lengths))
    assert nested.offsets().diff().tolist() == lengths
    for got, want in zip(_rows(nested), rows, strict=True):
        assert torch.equal(got, want)
    pad = True if dtype == torch.bool else 7
    back = materialize(TensorDict({"x": nested}, [len(lengths)]), pad_value_dict={"x": pad})["x"]
    want = torch.full((len(lengths), max(lengths), *inner), pad, dtype=dtype)
    for i, row in enumerate(rows):
        want[i, : len(row)] = row
    assert back.dtype == dtype and torch.equal(back, want)


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(0, 4))
def test_pad_to_seqlen_right_pads_every_jagged_field_to_that_length(shape, more):
    lengths, dtype, inner, _ = shape
    _, rows = _padded(lengths, dtype, inner)
    width = max(lengths) + more
    nested = _jagged(rows + [rows[0]])
    td = pack_jagged_fields({"a": nested}, lengths=None)
    got = materialize(td, "padded", {"a": 0}, pad_to_seqlen=width)["a"]
    assert got.shape == (len(rows) + 1, width, *inner)
    for i, row in enumerate(rows + [rows[0]]):
        assert torch.equal(got[i, : len(row)], row)
        assert not got[i, len(row) :].any()


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_pack_jagged_fields_then_materialize_is_the_identity_on_padded_columns(shape):
    lengths, dtype, inner, _ = shape
    full, _ = _padded(lengths, dtype, inner)
    # the padded positions hold the pad value, as a collator's padded batch does
    for i, k in enumerate(lengths):
        full[i, k:] = 0
    labels = torch.arange(len(lengths))
    texts = np.array([f"t{i}" for i in range(len(lengths))], dtype=object)
    td = pack_jagged_fields({"x": full, "y": labels, "text": texts}, lengths=lengths)
    assert td.batch_size == (len(lengths),)
    back = materialize(td)
    assert torch.equal(back["x"], full[:, : max(lengths)]) and torch.equal(back["y"], labels)
    assert back["text"].dtype == object and back["text"].tolist() == texts.tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.sampled_from(DTYPES))
def test_materialize_of_claimed_columns_matches_the_rows_path(lengths, dtype):
    rows = [torch.ones(k, dtype=torch.int64).to(dtype) for k in lengths]
    columns = {"x": JaggedColumn.from_rows(rows)}
    padded = materialize(columns, pad_value_dict={"x": 0})["x"]
    samples = columns_to_samples(columns)
    for i, sample in enumerate(samples):
        assert torch.equal(padded[i, : lengths[i]], sample["x"])
    assert isinstance(materialize(columns, "jagged")["x"], torch.Tensor)


# -- materialize ------------------------------------------------------------------------------


def test_materialize_pads_each_field_with_its_own_value_and_keeps_rectangular_fields():
    ids = torch.nested.nested_tensor([torch.tensor([5, 6]), torch.tensor([7])], layout=torch.jagged)
    chunk = torch.nested.nested_tensor(
        [torch.tensor([0, 0]), torch.tensor([0])], layout=torch.jagged
    )
    td = TensorDict({"ids": ids, "chunk": chunk, "n": torch.tensor([2, 1])}, [2])
    out = materialize(td, "padded", {"ids": 99, "chunk": -1, "other": 3})
    assert out["ids"].tolist() == [[5, 6], [7, 99]]
    assert out["chunk"].tolist() == [[0, 0], [0, -1]]
    assert out["n"] is td["n"]
    assert list(out) == list(td.keys())


def test_the_jagged_layout_passes_nested_fields_through():
    ids = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    out = materialize(TensorDict({"ids": ids}, [2]), "jagged")
    assert out["ids"] is ids


def test_materialize_turns_non_tensor_leaves_into_object_arrays():
    td = TensorDict(
        {"text": NonTensorStack(*(NonTensorData(o) for o in ["a", [1, 2], {"k": None}]))}, [3]
    )
    td["source"] = "corpus"  # NonTensorData: one object for the batch
    out = materialize(td)
    assert out["text"].dtype == object and out["text"].shape == (3,)
    assert out["text"].tolist() == ["a", [1, 2], {"k": None}]
    assert out["source"].tolist() == ["corpus"] * 3


def test_materialize_handles_no_rows_and_rows_that_are_all_empty():
    empty = torch.nested.nested_tensor_from_jagged(
        torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    )
    assert materialize({"x": empty})["x"].shape == (0, 0)
    assert materialize({"x": empty}, pad_to_seqlen=4)["x"].shape == (0, 4)
    hollow = JaggedColumn(torch.empty(0, 3), torch.zeros(3, dtype=torch.int64))
    got = materialize({"x": hollow}, pad_value_dict={"x": -1.0}, pad_to_seqlen=2)["x"]
    assert got.shape == (2, 2, 3) and bool((got == -1).all())


def test_materialize_refuses_what_it_cannot_do_naming_the_field():
    col = JaggedColumn.from_rows([torch.arange(5), torch.arange(2)])
    with pytest.raises(ValueError, match="layout='flat'"):
        materialize({"ids": col}, "flat")
    with pytest.raises(ValueError, match=r"'ids' has a row of 5 positions > pad_to_seqlen=4"):
        materialize({"ids": col}, pad_to_seqlen=4)
    with pytest.raises(ValueError, match=r"'ids' is torch.int64 and cannot be padded with 0.5"):
        materialize({"ids": col}, pad_value_dict={"ids": 0.5})
    with pytest.raises(ValueError, match="pad_to_seqlen=-1"):
        materialize({"ids": col}, pad_to_seqlen=-1)
    with pytest.raises(TypeError, match="'names'"):
        materialize({"names": ["a", "b"]})


# -- writer side ------------------------------------------------------------------------------


def test_to_nested_by_length_views_the_tensor_when_every_row_is_full():
    full = torch.arange(12).reshape(3, 4)
    nested = to_nested_by_length(full, [4, 4, 4])
    assert nested.values().data_ptr() == full.data_ptr()


def test_to_nested_by_length_refuses_bad_lengths():
    with pytest.raises(ValueError, match="exceeds the 4 positions"):
        to_nested_by_length(torch.zeros(2, 4), [5, 1])
    with pytest.raises(ValueError, match="3 lengths for 2 rows"):
        to_nested_by_length(torch.zeros(2, 4), [1, 1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        to_nested_by_length(torch.zeros(2, 4), [-1, 1])
    with pytest.raises(ValueError, match=r"rectangular tensor \[N, S, ...\]"):
        to_nested_by_length(torch.zeros(4), [1])


def test_stack_or_nest_stacks_equal_rows_nests_ragged_ones_and_refuses_other_mismatches():
    assert stack_or_nest([]).shape == (0,)
    assert stack_or_nest([torch.ones(2, 3), torch.zeros(2, 3)]).shape == (2, 2, 3)
    assert stack_or_nest([torch.tensor(1), torch.tensor(2)]).tolist() == [1, 2]
    nested = stack_or_nest([torch.ones(2, 3), torch.zeros(0, 3), torch.ones(5, 3)])
    assert nested.is_nested and nested.offsets().diff().tolist() == [2, 0, 5]
    with pytest.raises(ValueError, match="first \\(sequence\\) dim only"):
        stack_or_nest([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(ValueError, match="one dtype"):
        stack_or_nest([torch.ones(2), torch.ones(3, dtype=torch.int64)])


def test_maybe_pack_jagged_converts_only_tensors_shaped_like_per_token_fields():
    lengths = torch.tensor([3, 1])
    per_token = torch.arange(6).reshape(2, 3)
    assert maybe_pack_jagged(per_token, lengths).is_nested
    features = torch.zeros(2, 5, 4)  # [N, K, H]: K is not the longest row
    assert maybe_pack_jagged(features, lengths) is features
    per_sample = torch.zeros(2)
    assert maybe_pack_jagged(per_sample, lengths) is per_sample
    wider = torch.zeros(2, 4)  # sequence-parallel padding: strict here
    assert maybe_pack_jagged(wider, lengths) is wider
    other_batch = torch.zeros(3, 3)
    assert maybe_pack_jagged(other_batch, lengths) is other_batch
    assert maybe_pack_jagged([1, 2], lengths) == [1, 2]


def test_pack_per_token_field_drops_sequence_parallel_padding():
    lengths = torch.tensor([3, 1])
    sp_padded = torch.arange(8.0).reshape(2, 4)  # seq dim rounded up from 3 to 4
    nested = pack_per_token_field(sp_padded, lengths)
    assert [r.tolist() for r in _rows(nested)] == [[0.0, 1.0, 2.0], [4.0]]
    short = torch.zeros(2, 2)
    assert pack_per_token_field(short, lengths) is short
    flat = torch.zeros(2)
    assert pack_per_token_field(flat, lengths) is flat
    assert pack_per_token_field(nested, lengths) is nested


def test_pack_jagged_fields_without_lengths_keeps_tensors_rectangular():
    td = pack_jagged_fields({"x": torch.zeros(3, 4), "o": ["a", "b", "c"]}, lengths=None)
    assert td.batch_size == (3,) and not td["x"].is_nested
    assert td.get("o").tolist() == ["a", "b", "c"]
    assert pack_jagged_fields({}, lengths=None).batch_size == (0,)


def test_pack_jagged_fields_refuses_other_types_and_row_counts_naming_the_field():
    with pytest.raises(TypeError, match="'x'"):
        pack_jagged_fields({"x": "text"}, lengths=None)
    with pytest.raises(ValueError, match="'y' has 2 rows, the batch 3"):
        pack_jagged_fields({"x": torch.zeros(3, 1), "y": torch.zeros(2)}, lengths=[1, 1, 1])


def test_response_from_nested_takes_the_left_shifted_response_slice():
    # row 0: prompt 3 + response 2 tokens; row 1: prompt 1 + response 2; row 2: no response
    full = stack_or_nest([torch.arange(5.0), torch.arange(10.0, 13.0), torch.arange(20.0, 22.0)])
    mask = stack_or_nest([torch.ones(2), torch.ones(2), torch.ones(0)])
    got = response_from_nested(full, mask)
    assert [r.tolist() for r in _rows(got)] == [[2.0, 3.0], [10.0, 11.0], []]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=6),
    st.sampled_from([(), (2,)]),
)
def test_response_slices_match_a_row_by_row_reference(rows, inner):
    full_rows = [torch.randn(p + a, *inner) for p, a in rows]
    got = response_from_nested(
        _jagged(full_rows + [torch.randn(1, *inner)]),
        _jagged([torch.ones(a) for _, a in rows] + [torch.ones(0)]),
    )
    for (p, a), full, out in zip(rows, full_rows, _rows(got)):
        assert torch.equal(out, full[p - 1 : p + a - 1])


def test_a_response_without_a_prompt_token_is_refused():
    full = stack_or_nest([torch.arange(2.0), torch.arange(3.0)])
    with pytest.raises(ValueError, match="row 0 has 2 tokens for a 2-token response"):
        response_from_nested(full, stack_or_nest([torch.ones(2), torch.ones(1)]))
    with pytest.raises(ValueError, match="torch.jagged"):
        response_from_nested(torch.zeros(2, 3), stack_or_nest([torch.ones(2), torch.ones(1)]))


def test_only_a_stripped_non_tensor_data_unwraps_to_none():
    assert unwrap_wire_stripped_payload(TensorDict({}, batch_size=[])) is None
    kept = NonTensorData("payload")
    assert unwrap_wire_stripped_payload(kept) is kept
    with_batch = TensorDict({}, batch_size=[2])
    assert unwrap_wire_stripped_payload(with_batch) is with_batch
    with_field = TensorDict({"a": torch.zeros(())}, batch_size=[])
    assert unwrap_wire_stripped_payload(with_field) is with_field
    assert unwrap_wire_stripped_payload("text") == "text"
    assert unwrap_wire_stripped_payload(None) is None


# -- samples <-> columns ----------------------------------------------------------------------


def test_samples_become_columns_and_back():
    samples = [
        {"ids": torch.arange(k), "chunk": torch.zeros(k, 2), "n": torch.tensor(k)}
        for k in (3, 0, 3)
    ]
    columns = samples_to_columns(samples)
    assert isinstance(columns["ids"], JaggedColumn) and columns["n"].tolist() == [3, 0, 3]
    for got, want in zip(columns_to_samples(columns), samples, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_samples_to_columns_refuses_mismatched_samples_naming_the_field():
    with pytest.raises(ValueError, match="at least one sample"):
        samples_to_columns([])
    with pytest.raises(ValueError, match="'b'"):
        samples_to_columns([{"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": torch.zeros(1)}])
    with pytest.raises(ValueError, match="'a' is 0-d in some samples"):
        samples_to_columns([{"a": torch.zeros(1)}, {"a": torch.tensor(1.0)}])
