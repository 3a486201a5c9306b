"""Jagged -> padded: claimed columns split into row views, rows padded once, and their errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.data_plane.codec import columns_to_samples, pad_rows
from xtoken_core.wire import JaggedColumn, decode_message, encode_message

# -- columns -> samples -----------------------------------------------------------------------


def test_columns_become_samples_of_row_views():
    columns = {
        "ids": JaggedColumn.from_rows([torch.arange(3), torch.arange(0)]),
        "nested": JaggedColumn.from_rows([torch.ones(1, 2), torch.zeros(2, 2)]).to_nested(),
        "label": torch.tensor([1, 0]),
    }
    back = columns_to_samples(columns)
    assert [s["ids"].tolist() for s in back] == [[0, 1, 2], []]
    assert [int(s["label"]) for s in back] == [1, 0]
    assert [tuple(s["nested"].shape) for s in back] == [(1, 2), (2, 2)]
    values = columns["ids"].values
    assert back[0]["ids"].untyped_storage().data_ptr() == values.untyped_storage().data_ptr()


def test_a_decoded_claim_splits_into_views_of_the_received_frames():
    rows = [torch.arange(k) for k in (4, 0, 2)]
    frames = encode_message(
        "reply", {"fields": {"ids": JaggedColumn.from_rows(rows)}}, inline_max_bytes=0
    )
    frames = [bytes(f) for f in frames]
    fields = decode_message(frames, jagged="column").body["fields"]
    back = columns_to_samples(fields)
    assert [s["ids"].tolist() for s in back] == [r.tolist() for r in rows]
    frame_ptrs = {torch.frombuffer(f, dtype=torch.uint8).data_ptr() for f in frames[2:] if f}
    assert back[0]["ids"].untyped_storage().data_ptr() in frame_ptrs


def test_columns_with_different_row_counts_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        columns_to_samples({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_a_column_without_rows_is_refused_naming_it():
    with pytest.raises(TypeError, match="'x'"):
        columns_to_samples({"x": [1, 2]})


# -- pad_rows ---------------------------------------------------------------------------------


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


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(0, 2))
def test_padded_rows_keep_each_row_as_its_prefix(lengths, extra):
    rows = [torch.randn(k, 2) for k in lengths]
    width = max(lengths) + extra
    padded = pad_rows(rows, 7.0, width if extra else 0)
    assert padded.shape == (len(lengths), width, 2)
    for i, row in enumerate(rows):
        assert torch.equal(padded[i, : len(row)], row)
        assert bool((padded[i, len(row) :] == 7.0).all())


def test_pad_rows_refuses_no_rows_and_a_row_past_the_width():
    with pytest.raises(ValueError, match="at least one row"):
        pad_rows([], 0)
    with pytest.raises(ValueError, match="5 positions > width=4"):
        pad_rows([torch.zeros(5)], 0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [0, 128])
def test_pad_rows_on_cuda_matches_cpu(width):
    rows = [torch.randn(k, 2) for k in (100, 0, 70)]
    padded = pad_rows([r.cuda() for r in rows], -1.0, width)
    assert padded.is_cuda and torch.equal(padded.cpu(), pad_rows(rows, -1.0, width))
