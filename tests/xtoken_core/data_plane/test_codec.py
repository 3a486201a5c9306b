"""The jagged <-> padded codec: every documented contract of reference/codec.md and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from xtoken_core.data_plane.codec import (
    columns_to_samples,
    materialize,
    pad_jagged,
    pad_rows,
    samples_to_columns,
    stack_or_nest,
    to_nested_by_length,
)
from xtoken_core.wire import JaggedColumn, decode_message, encode_message, is_jagged


def _rows(nested: torch.Tensor) -> list[list]:
    return [r.tolist() for r in JaggedColumn.from_nested(nested).rows()]


# -- to_nested_by_length -------------------------------------------------------------------


def test_to_nested_by_length_keeps_each_rows_prefix():
    padded = torch.arange(12).reshape(3, 4)
    nested = to_nested_by_length(padded, torch.tensor([2, 0, 4]))
    assert is_jagged(nested)
    assert _rows(nested) == [[0, 1], [], [8, 9, 10, 11]]


def test_to_nested_by_length_keeps_trailing_dims():
    padded = torch.randn(2, 5, 3)
    nested = to_nested_by_length(padded, torch.tensor([1, 5]))
    col = JaggedColumn.from_nested(nested)
    assert torch.equal(col.row(0), padded[0, :1]) and torch.equal(col.row(1), padded[1])


def test_to_nested_by_length_handles_zero_rows():
    nested = to_nested_by_length(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))
    assert nested.size(0) == 0


@pytest.mark.parametrize(
    "padded, lengths, match",
    [
        (torch.zeros(3), torch.tensor([1, 1, 1]), r"\[N, S"),
        (torch.zeros(2, 3), torch.tensor([1, 1, 1]), "3 entries for 2 rows"),
        (torch.zeros(2, 3), torch.tensor([1, 4]), "exceeds"),
        (torch.zeros(2, 3), torch.tensor([1, -1]), "negative"),
        (torch.zeros(2, 3), torch.tensor([1.0, 2.0]), "integer"),
        (torch.zeros(2, 3), torch.tensor([[1, 2]]), "1-D"),
    ],
)
def test_to_nested_by_length_refuses_bad_input(padded, lengths, match):
    with pytest.raises(ValueError, match=match):
        to_nested_by_length(padded, lengths)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=6), st.integers(0, 2))
def test_padding_then_stripping_is_the_identity(lengths, extra):
    rows = [torch.randn(k, 2) for k in lengths]
    col = (
        JaggedColumn.from_rows(rows)
        if rows
        else JaggedColumn(torch.empty(0, 2), torch.zeros(1, dtype=torch.int64))
    )
    padded = pad_jagged(col, 7.0, seqlen=max(lengths, default=0) + extra)
    assert padded.shape == (len(lengths), max(lengths, default=0) + extra, 2)
    lengths_N = torch.tensor(lengths, dtype=torch.int64)
    back = JaggedColumn.from_nested(to_nested_by_length(padded, lengths_N))
    assert torch.equal(back.offsets, col.offsets) and torch.equal(back.values, col.values)


# -- stack_or_nest ----------------------------------------------------------------------------


def test_stack_or_nest_stacks_equal_shapes():
    out = stack_or_nest([torch.ones(2, 3), torch.zeros(2, 3)])
    assert not out.is_nested and out.shape == (2, 2, 3)


def test_stack_or_nest_nests_ragged_rows():
    out = stack_or_nest([torch.arange(3), torch.arange(1)])
    assert is_jagged(out) and _rows(out) == [[0, 1, 2], [0]]


def test_stack_or_nest_of_nothing_is_an_empty_tensor():
    out = stack_or_nest([])
    assert out.shape == (0,)


def test_stack_or_nest_refuses_rows_ragged_beyond_dim_zero():
    with pytest.raises(ValueError, match="ragged in dim 0"):
        stack_or_nest([torch.zeros(2, 3), torch.zeros(2, 4)])


# -- materialize -----------------------------------------------------------------------------


def _wire_td() -> TensorDict:
    lengths = torch.tensor([3, 0, 1])
    return TensorDict(
        {
            "ids": to_nested_by_length(torch.arange(9).reshape(3, 3), lengths),
            "mask": to_nested_by_length(torch.ones(3, 3, dtype=torch.bool), lengths),
            "probs": to_nested_by_length(torch.ones(3, 3, 2, dtype=torch.bfloat16), lengths),
            "score": torch.tensor([1.0, 2.0, 3.0]),
            "text": NonTensorStack.from_list(["a", "b", "c"]),
        },
        batch_size=[3],
    )


def test_materialize_pads_each_field_with_its_own_pad_value():
    out = materialize(_wire_td(), pad_value_dict={"ids": -100})
    assert isinstance(out, dict)
    assert out["ids"].tolist() == [[0, 1, 2], [-100, -100, -100], [6, -100, -100]]
    assert out["mask"].tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    assert out["probs"].dtype == torch.bfloat16 and out["probs"].shape == (3, 3, 2)
    assert torch.equal(out["score"], torch.tensor([1.0, 2.0, 3.0]))


def test_materialize_turns_non_tensor_leaves_into_object_arrays():
    text = materialize(_wire_td())["text"]
    assert isinstance(text, np.ndarray) and text.dtype == object and text.shape == (3,)
    assert text.tolist() == ["a", "b", "c"]


def test_materialize_pads_to_an_absolute_seqlen():
    out = materialize(_wire_td(), pad_to_seqlen=8)
    assert out["ids"].shape == (3, 8) and out["probs"].shape == (3, 8, 2)
    assert out["score"].shape == (3,)


def test_materialize_refuses_a_seqlen_shorter_than_a_row():
    with pytest.raises(ValueError, match="pad_to_seqlen=2"):
        materialize(_wire_td(), pad_to_seqlen=2)


def test_materialize_jagged_layout_passes_nested_leaves_through():
    td = _wire_td()
    out = materialize(td, layout="jagged")
    assert out["ids"] is td["ids"]


def test_materialize_accepts_a_decoded_wire_body_with_jagged_columns():
    td = _wire_td()
    fields = {k: td[k] for k in ("ids", "mask", "probs", "score")}
    decoded = decode_message(encode_message("reply", {"fields": fields}), jagged="column")
    out = materialize(decoded.body["fields"], pad_value_dict={"ids": -1})
    assert torch.equal(out["ids"], materialize(td, pad_value_dict={"ids": -1})["ids"])


def test_materialize_of_zero_rows_gives_empty_rectangles():
    empty = JaggedColumn(torch.empty(0, 2), torch.zeros(1, dtype=torch.int64))
    out = materialize({"x": empty}, pad_to_seqlen=4)
    assert out["x"].shape == (0, 4, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"layout": "dense"}, "layout"), ({"pad_to_seqlen": -1}, "pad_to_seqlen")],
)
def test_materialize_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        materialize(_wire_td(), **kwargs)


def test_materialize_refuses_unknown_leaves():
    with pytest.raises(TypeError, match="'x'"):
        materialize({"x": [1, 2]})


# -- per-sample <-> columnar ------------------------------------------------------------------


def test_samples_and_columns_convert_both_ways():
    samples = [
        {"ids": torch.arange(3), "label": torch.tensor(1)},
        {"ids": torch.arange(0), "label": torch.tensor(0)},
    ]
    columns = samples_to_columns(samples)
    assert is_jagged(columns["ids"]) and columns["label"].tolist() == [1, 0]
    back = columns_to_samples(columns)
    assert [s["ids"].tolist() for s in back] == [[0, 1, 2], []]
    assert [int(s["label"]) for s in back] == [1, 0]


def test_samples_with_different_keys_are_refused():
    with pytest.raises(ValueError, match="keys"):
        samples_to_columns([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])


def test_columns_with_different_row_counts_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        columns_to_samples({"a": torch.zeros(2), "b": torch.zeros(3)})


@pytest.mark.parametrize(
    "lengths", [[100, 0, 70], [1, 0, 3], [200]], ids=["long-rows", "short-rows", "one-row"]
)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.bfloat16])
def test_pad_jagged_matches_a_row_by_row_reference(lengths, dtype):
    rows = [torch.randint(0, 2, (k, 3)).to(dtype) for k in lengths]
    want = torch.full((len(rows), 210, 3), 1, dtype=dtype)
    for i, r in enumerate(rows):
        want[i, : len(r)] = r
    got = pad_jagged(JaggedColumn.from_rows(rows), pad_value=1, seqlen=210)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[100, 0, 70], [1, 0, 3]], ids=["long-rows", "short-rows"])
def test_codec_on_cuda_matches_cpu(lengths):
    rows = [torch.randn(k, 2) for k in lengths]
    col = JaggedColumn.from_rows(rows)
    cuda = JaggedColumn(col.values.cuda(), col.offsets.cuda())
    padded = pad_jagged(cuda, pad_value=-1.0, seqlen=128)
    assert padded.is_cuda and torch.equal(padded.cpu(), pad_jagged(col, -1.0, 128))
    nested = to_nested_by_length(padded, torch.tensor(lengths, device="cuda"))
    assert nested.is_cuda
    assert torch.equal(JaggedColumn.from_nested(nested).values.cpu(), col.values)


@pytest.mark.parametrize("width", [0, 211])
@pytest.mark.parametrize(
    ("dtype", "pad_value"),
    [
        (torch.bool, True),
        (torch.bool, False),
        (torch.int64, -1),
        (torch.int64, 2**53 + 1),  # beyond float64: still exact
        (torch.bfloat16, -1.5),
    ],
)
def test_pad_rows_matches_a_row_by_row_reference(dtype, pad_value, width):
    rows = [torch.randint(0, 2, (k, 3)).to(dtype) for k in (100, 0, 70, 3)]
    want = torch.full((len(rows), width or 100, 3), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        want[i, : len(r)] = r
    got = pad_rows(rows, pad_value, width)
    assert got.dtype == dtype and torch.equal(got, want)


def test_pad_rows_refuses_no_rows_and_a_row_past_the_width():
    with pytest.raises(ValueError, match="at least one row"):
        pad_rows([], 0)
    with pytest.raises(ValueError, match="5 positions > width=4"):
        pad_rows([torch.zeros(5)], 0, 4)
