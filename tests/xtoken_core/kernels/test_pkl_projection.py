"""pkl_projection projection kernels vs the dense formula (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, kd_logits, kd_rows
from xtoken_core.kernels import logit_rows as kf
from xtoken_core.kernels import pkl_projection

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
    ell = (
        j.t().contiguous().int(),
        torch.where(j >= 0, w, 0.0).t().contiguous().float(),
        (j >= 0).sum(1).int(),
    )
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
    q = pkl_projection.project_rows_forward(z, lse, *csc, temp)
    used = (nidx >= 0).view(-1, 1)
    z64 = z.detach().double().reshape(B * T, V).requires_grad_()
    q_ref = (torch.softmax(z64 / temp, -1)[:, :S] @ dense) * used
    torch.testing.assert_close(q.double(), q_ref.detach(), rtol=1e-5, atol=1e-7)
    assert bool((q[~used.flatten()] == 0).all())

    dq = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE) * used
    dot = (dq * q).sum(-1)
    dz = pkl_projection.project_rows_backward(z, lse, dq, dot, *ell, temp)
    (q_ref * dq.double()).sum().backward()
    assert dz.dtype == dtype and dz.shape == (B, T, V)
    dq_column_major = dq.t().contiguous().t()  # the layout pkl_chunk_kl writes
    dz_cm = pkl_projection.project_rows_backward(z, lse, dq_column_major, dot, *ell, temp)
    assert torch.equal(dz_cm, dz)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(dz.reshape(B * T, V).double(), z64.grad, **tol)


@pytest.mark.parametrize("temp", [1.0, 1.6], ids=["T=1", "T=1.6"])
def test_the_backward_with_the_ce_adds_the_ce_gradient_in_the_same_pass(temp):
    from xtoken_core.kernels import row_ce

    B, T, V, W, S = 2, 7, 67, 41, 60
    idx = torch.tensor([1, 4, 5, 9, 13, 20, 22, 30, 33, 40])
    _, ell, _ = _restricted_projection(S, W, idx, seed=11)
    z = kd_logits(B, T, V, torch.float32, seed=12)
    nidx, _, _ = kd_rows(B, T, 5, seed=13)
    lse = kf.row_logsumexp(z, nidx, temp)
    gen = torch.Generator().manual_seed(14)
    dq = torch.randn(B * T, idx.numel(), generator=gen).to(DEVICE)
    dot = torch.randn(B * T, generator=gen).to(DEVICE)
    ids = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    token_mask = (torch.rand(B, T, generator=gen) < 0.7).to(DEVICE)
    _, ce_lse, target = row_ce.row_ce_forward(z, ids, token_mask, None)
    assert bool((target < 0).any()) and bool((target >= 0).any())  # both kinds of rows
    g = torch.tensor([0.37], device=DEVICE)
    both = pkl_projection.project_rows_backward(z, lse, dq, dot, *ell, temp, ce=(ce_lse, target, g))
    apart = pkl_projection.project_rows_backward(z, lse, dq, dot, *ell, temp)
    apart = apart + row_ce.row_ce_backward(g, z, ce_lse, target)
    torch.testing.assert_close(both, apart, rtol=1e-5, atol=1e-7)


def test_restricted_tables_hold_exactly_the_selected_columns_of_m_packed_low():
    S, W, P = 50, 37, 4
    gen = torch.Generator().manual_seed(3)
    t = torch.randint(0, W, (S, P), generator=gen)
    w = torch.rand(S, P, generator=gen) + 0.1
    w[torch.rand(S, P, generator=gen) < 0.3] = 0.0
    rows = torch.arange(S).view(-1, 1).expand(S, P)
    M = torch.sparse_coo_tensor(
        torch.stack([rows.flatten(), t.flatten()]), w.flatten(), (S, W), check_invariants=True
    )
    M = M.coalesce().to(DEVICE)
    dense_SW = M.to_dense().double().cpu()
    idx = torch.tensor([0, 3, 4, 8, 11, 20, 21, 30, 36], device=DEVICE)
    ptr, rows_E, cols_E, w_E, ell_j, ell_w, ell_n = pkl_projection.restrict_tables(
        pkl_projection.build_projection_tables(M), idx
    )
    want_SK = dense_SW[:, idx.cpu()]
    E = int(ptr[-1])
    assert E == int((want_SK != 0).sum())
    ptr, rows_E, cols_E, w_E = (
        x.cpu().long() if x.dtype != torch.float32 else x.cpu()
        for x in (ptr, rows_E[:E], cols_E[:E], w_E[:E])
    )
    assert torch.equal(torch.repeat_interleave(torch.arange(idx.numel()), ptr.diff()), cols_E)
    csc_SK = torch.zeros_like(want_SK).index_put_((rows_E, cols_E), w_E.double(), accumulate=True)
    torch.testing.assert_close(csc_SK, want_SK)
    ell_j, ell_w = ell_j.cpu().long(), ell_w.cpu()
    assert ell_j.shape == (P, S)
    kept = ell_j >= 0
    assert bool((kept[1:] <= kept[:-1]).all())  # entries packed to the low slots
    assert torch.equal(ell_n.cpu().long(), kept.sum(0))  # each row's count of entries
    assert bool((ell_w[~kept] == 0).all())
    s_idx = torch.arange(S).view(1, -1).expand(P, S)
    ell_SK = torch.zeros_like(want_SK).index_put_(
        (s_idx[kept], ell_j[kept]), ell_w[kept].double(), accumulate=True
    )
    torch.testing.assert_close(ell_SK, want_SK)
