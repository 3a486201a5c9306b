"""The reference backend's shared pieces: Fp32SparseMM, the student CE, and the small fp64 case
the modes' reference tests share."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.losses.backends import reference
from xtoken_core.losses.backends.reference import Fp32SparseMM


def test_fp32_sparse_mm_stays_fp32_under_bf16_autocast_and_gives_no_gradient_to_the_matrix():
    g = torch.Generator().manual_seed(1)
    dense_M = torch.rand(6, 4, generator=g) * (torch.rand(6, 4, generator=g) > 0.5)
    sparse_M = dense_M.to_sparse().coalesce()
    x = torch.randn(6, 3, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Fp32SparseMM.apply(sparse_M, x.to(torch.bfloat16))
        assert out.dtype == torch.float32
        out.pow(2).sum().backward()
    torch.testing.assert_close(out, dense_M.t() @ x.to(torch.bfloat16).float())
    expected = dense_M @ (2 * (dense_M.t() @ x.to(torch.bfloat16).float()))
    torch.testing.assert_close(x.grad, expected, rtol=1e-2, atol=1e-2)
    assert not sparse_M.requires_grad


def test_fp32_sparse_mm_gradcheck_in_float64():
    g = torch.Generator().manual_seed(2)
    M = torch.rand(5, 3, generator=g, dtype=torch.float64) * (torch.rand(5, 3, generator=g) > 0.4)
    x = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d: Fp32SparseMM.apply(M.to_sparse(), d), (x,))


def tiny_case(seed):
    """A small fp64 case: ``(zs, zt, s_ids, t_ids, valid, M, exact)``."""
    g = torch.Generator().manual_seed(seed)
    Bn, Tn, Un, Vn, Wn, Cn = 2, 5, 4, 6, 5, 3
    s_ids = torch.tensor([[0, 0, 1, 2, -1], [0, 1, 1, 2, 2]])
    t_ids = torch.tensor([[0, 1, 1, 2], [0, 1, 2, -1]])
    valid = torch.ones(Bn, Cn, dtype=torch.bool)
    zs = torch.randn(Bn, Tn, Vn, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(Bn, Un, Wn, generator=g, dtype=torch.float64)
    dense = torch.rand(Vn, Wn, generator=g, dtype=torch.float64) + 0.05
    exact = {
        "common_student": torch.tensor([0, 2]),
        "common_teacher": torch.tensor([1, 0]),
        "uncommon_student": torch.tensor([1, 3, 4, 5]),
        "uncommon_teacher": torch.tensor([2, 3, 4]),
    }
    return zs, zt, s_ids, t_ids, valid, dense.to_sparse().coalesce(), exact


def test_student_ce_reference_gradcheck_and_counts():
    zs, *_ = tiny_case(5)
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]])
    token_mask = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
    sample_mask = torch.tensor([1, 0])
    nll, correct, n = reference.student_ce_loss(zs, ids, token_mask, sample_mask)
    assert n.item() == 3
    expected = -sum(torch.log_softmax(zs[0, p].detach(), 0)[ids[0, p + 1]] for p in (0, 1, 3))
    assert nll.item() == pytest.approx(expected.item())
    assert torch.autograd.gradcheck(
        lambda z: reference.student_ce_loss(z, ids, token_mask, sample_mask)[0], (zs,)
    )
