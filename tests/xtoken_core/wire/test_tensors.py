"""JaggedColumn: construction checks, rows, and conversion to/from torch.jagged nested tensors."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.wire import JaggedColumn, is_jagged


def test_from_rows_concatenates_and_offsets_mark_row_bounds():
    col = JaggedColumn.from_rows([torch.arange(2), torch.arange(0), torch.arange(3)])
    assert col.offsets.tolist() == [0, 2, 2, 5]
    assert col.values.tolist() == [0, 1, 0, 1, 2]
    assert col.num_rows == 3 and col.lengths().tolist() == [2, 0, 3]
    assert col.row(2).tolist() == [0, 1, 2]


def test_nested_conversion_shares_storage_both_ways():
    col = JaggedColumn.from_rows([torch.randn(2, 3), torch.randn(4, 3)])
    nested = col.to_nested()
    assert is_jagged(nested) and nested.size(0) == 2
    back = JaggedColumn.from_nested(nested)
    assert back.values.data_ptr() == col.values.data_ptr()
    assert torch.equal(back.offsets, col.offsets)


def test_empty_column_has_zero_rows():
    col = JaggedColumn.from_rows([], dtype=torch.int64)
    assert col.num_rows == 0 and col.values.dtype == torch.int64 and col.rows() == []


@pytest.mark.parametrize(
    "values, offsets, match",
    [
        (torch.arange(3), torch.tensor([0, 2]), "run from 0 to"),
        (torch.arange(3), torch.tensor([0, 3, 2, 3]), "decrease"),
        (torch.arange(3), torch.tensor([1, 3]), "run from 1"),
        (torch.arange(3), torch.tensor([0, 3], dtype=torch.int32), "int64"),
        (torch.tensor(3), torch.tensor([0, 1]), ">= 1 dim"),
    ],
)
def test_inconsistent_columns_are_refused(values, offsets, match):
    with pytest.raises(ValueError, match=match):
        JaggedColumn(values, offsets)


def test_rows_of_different_inner_shape_are_refused():
    with pytest.raises(ValueError, match="row 1"):
        JaggedColumn.from_rows([torch.zeros(2, 3), torch.zeros(2, 4)])


def test_only_ragged_dim_one_is_accepted():
    nested = JaggedColumn.from_rows([torch.zeros(2, 3), torch.zeros(1, 3)]).to_nested()
    with pytest.raises(ValueError, match="ragged dim"):
        JaggedColumn.from_nested(nested.transpose(1, 2))
