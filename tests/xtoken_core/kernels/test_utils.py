"""Kernel helpers: the tiled transpose copy (interpreted on CPU) and lazy per-mode JIT."""

import pytest
import torch

from xtoken_core.kernels import _utils

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 1), (37, 5), (70, 129)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transpose_into_copies_every_element_transposed(shape, dtype):
    R, C = shape
    src = torch.randn(R, C + 3, generator=torch.Generator().manual_seed(R)).to(dtype)
    src = src.to(DEVICE)[:, 1 : C + 1]  # strided rows, offset start
    dst = torch.full((C, R), float("nan"), device=DEVICE)  # poisoned; fp32 output casts
    _utils.transpose_into(src, dst)
    assert torch.equal(dst, src.t().float())


def test_transpose_into_writes_a_strided_destination_only_in_its_window():
    src = torch.arange(12.0, device=DEVICE).view(3, 4)
    buf = torch.full((4, 6), -1.0, device=DEVICE)
    _utils.transpose_into(src, buf[:, 2:5])
    assert torch.equal(buf[:, 2:5], src.t())
    assert bool((buf[:, :2] == -1).all()) and bool((buf[:, 5:] == -1).all())


def test_transpose_into_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="transpose"):
        _utils.transpose_into(torch.zeros(3, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE))
