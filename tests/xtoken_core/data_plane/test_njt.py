"""The fast nested-tensor helpers give what torch's public calls give (a torch upgrade that
moves the private attributes fails here, not in a claim)."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.data_plane.njt import is_njt, njt_from_parts, njt_parts


def _public(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


@pytest.mark.parametrize("inner", [(), (3,)])
def test_parts_are_the_public_values_and_offsets(inner):
    nested = _public([torch.randn(k, *inner) for k in (4, 0, 2)])
    values, offsets = njt_parts(nested)
    assert values.data_ptr() == nested.values().data_ptr()
    assert offsets.dtype == torch.int64 and torch.equal(offsets, nested.offsets())


def test_parts_of_a_view_with_holes_are_its_live_rows():
    holes = torch.nested.nested_tensor_from_jagged(
        torch.arange(10), torch.tensor([0, 5, 10]), lengths=torch.tensor([2, 3])
    )
    values, offsets = njt_parts(holes)
    assert values.tolist() == [0, 1, 5, 6, 7] and offsets.tolist() == [0, 2, 5]


def test_a_nested_tensor_built_from_parts_equals_the_public_one_and_shares_the_values():
    values, offsets = torch.arange(6.0), torch.tensor([0, 1, 1, 6])
    fast = njt_from_parts(values, offsets)
    public = torch.nested.nested_tensor_from_jagged(values, offsets)
    assert is_njt(fast) and fast.layout == torch.jagged and fast.shape[0] == 3
    assert fast.values().data_ptr() == values.data_ptr()
    for a, b in zip(fast.unbind(0), public.unbind(0), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        torch.nested.to_padded_tensor(fast, -1.0),
        torch.tensor([[0.0, -1, -1, -1, -1], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 5]]),
    )


def test_values_that_need_gradients_get_the_public_constructor():
    values = torch.randn(4, requires_grad=True)
    nested = njt_from_parts(values, torch.tensor([0, 1, 4]))
    nested.values().sum().backward()
    assert torch.equal(values.grad, torch.ones(4))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_only_jagged_nested_tensors_count():
    assert not is_njt(torch.zeros(2, 3))
    assert not is_njt(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]))
    assert not is_njt([1, 2])
