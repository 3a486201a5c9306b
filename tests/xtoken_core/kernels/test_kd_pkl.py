"""kd_pkl projection kernels vs the dense formula (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, kd_logits, kd_rows
from xtoken_core.kernels import kd_fused as kf
from xtoken_core.kernels import kd_pkl

pytest.importorskip("triton")


def _restricted_projection(S, W, idx, seed, P=3):
    """CSC lists of M[:, idx] and its ELL table, plus the dense [S, K] matrix."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, W, (S, P), generator=gen)
    w = torch.rand(S, P, generator=gen)
    w[torch.rand(S, P, generator=gen) < 0.3] = 0.0
    pos = torch.full((W,), -1, dtype=torch.long)
    pos[idx] = torch.arange(idx.numel())
    j = torch.where(w != 0, pos[t], -1)
    dense = torch.zeros(S, idx.numel(), dtype=torch.float64)
    s_E, k_E = (j >= 0).nonzero(as_tuple=True)
    j_E, w_E = j[s_E, k_E], w[s_E, k_E]
    dense.index_put_((s_E, j_E), w_E.double(), accumulate=True)
    order = torch.argsort(j_E * S + s_E)
    ptr = torch.searchsorted(j_E[order], torch.arange(idx.numel() + 1))
    csc = (ptr, s_E[order].int(), j_E[order].int(), w_E[order].float())
    front = torch.argsort((j < 0).to(torch.int8), dim=1, stable=True)  # entries in low slots
    j, w = j.gather(1, front), w.gather(1, front)
    ell = (j.t().contiguous().int(), torch.where(j >= 0, w, 0.0).t().contiguous().float())
    return [x.to(DEVICE) for x in csc], [x.to(DEVICE) for x in ell], dense.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_projection_forward_and_backward_match_the_dense_formula(dtype):
    B, T, V, W, S = 2, 7, 67, 41, 60  # S < V: the last student ids have no row in M
    idx = torch.tensor([1, 4, 5, 9, 13, 20, 22, 30, 33, 40])
    csc, ell, dense = _restricted_projection(S, W, idx, seed=7)
    z = kd_logits(B, T, V, dtype, seed=8)
    nidx, _, _ = kd_rows(B, T, 5, seed=9)
    temp = 1.6
    lse = kf.row_logsumexp(z, nidx, temp)
    q = kd_pkl.project_rows_forward(z, lse, *csc, temp)
    used = (nidx >= 0).view(-1, 1)
    z64 = z.detach().double().reshape(B * T, V).requires_grad_()
    q_ref = (torch.softmax(z64 / temp, -1)[:, :S] @ dense) * used
    torch.testing.assert_close(q.double(), q_ref.detach(), rtol=1e-5, atol=1e-7)
    assert bool((q[~used.flatten()] == 0).all())

    dq = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE) * used
    dot = (dq * q).sum(-1)
    dz = kd_pkl.project_rows_backward(z, lse, dq, dot, *ell, temp)
    (q_ref * dq.double()).sum().backward()
    assert dz.dtype == dtype and dz.shape == (B, T, V)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(dz.reshape(B * T, V).double(), z64.grad, **tol)
