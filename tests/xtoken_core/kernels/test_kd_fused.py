"""kd_fused kernels vs plain PyTorch formulas (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from xtoken_core.kernels import kd_fused as kf

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(B, T, V, dtype, seed, pad=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, T, V + pad, generator=gen) * 3).to(dtype).to(DEVICE)
    return z[..., :V]  # a vocab-sliced view when pad > 0 (row stride != V)


def _rows(B, T, N, seed):
    """nidx [B*T] with runs of 1-3 rows per chunk, some rows in no chunk, and the order/offsets."""
    gen = torch.Generator().manual_seed(seed)
    nidx = torch.randint(0, N, (B * T,), generator=gen)
    nidx[torch.rand(B * T, generator=gen) < 0.2] = -1
    key = torch.where(nidx >= 0, nidx, N)
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(N + 1))
    return nidx.to(DEVICE), order.to(DEVICE), offsets.to(DEVICE)


def _ref_logp(z, nidx, temperature):
    logp = torch.log_softmax(z.double() / temperature, -1).reshape(-1, z.shape[-1])
    return logp, nidx.cpu() >= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pad", [0, 5])
def test_row_logsumexp_matches_torch_and_is_inf_on_unused_rows(dtype, pad):
    z = _logits(2, 9, 77, dtype, seed=1, pad=pad)
    nidx, _, _ = _rows(2, 9, 4, seed=2)
    lse = kf.row_logsumexp(z, nidx, 1.3)
    ref = torch.logsumexp(z.double() / 1.3, -1).reshape(-1)
    used = nidx >= 0
    torch.testing.assert_close(lse[used].double(), ref[used], rtol=1e-6, atol=1e-5)
    assert bool(torch.isinf(lse[~used]).all()) and bool((lse[~used] > 0).all())


@pytest.mark.parametrize("with_cols", [False, True])
def test_chunk_mean_columns_matches_the_mean_of_gathered_log_probs(with_cols):
    B, T, V, N = 2, 11, 53, 6
    z = _logits(B, T, V, torch.bfloat16, seed=3, pad=3)
    nidx, order, offsets = _rows(B, T, N, seed=4)
    cols = torch.tensor([50, 3, 17, 0, 44, 29, 8], device=DEVICE) if with_cols else None
    lse = kf.row_logsumexp(z, nidx, 0.7)
    out = kf.chunk_mean_columns(z, lse, order, offsets, 0.7, cols)
    logp = torch.log_softmax(z.double() / 0.7, -1).reshape(B * T, V)
    if cols is not None:
        logp = logp[:, cols]
    ref = torch.zeros(N, logp.shape[1], dtype=torch.float64, device=DEVICE)
    for n in range(N):
        rows = (nidx == n).nonzero().flatten()
        if rows.numel():
            ref[n] = logp[rows].mean(0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=2e-5)


def test_column_max_equals_masked_amax_exactly():
    B, T, W = 2, 13, 301
    z = _logits(B, T, W, torch.bfloat16, seed=5, pad=2)
    used = torch.where(torch.rand(B * T) < 0.6, 0, -1).to(DEVICE)
    got = kf.column_max(z, used)
    mask = (used >= 0).view(B, T, 1)
    ref = z.masked_fill(~mask, float("-inf")).amax(dim=(0, 1)).float()
    assert torch.equal(got, ref)


def test_column_max_of_no_used_row_is_minus_inf():
    z = _logits(1, 5, 40, torch.float32, seed=6)
    got = kf.column_max(z, torch.full((5,), -1, device=DEVICE))
    assert bool(torch.isneginf(got).all())


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
    z = _logits(B, T, V, dtype, seed=8)
    nidx, _, _ = _rows(B, T, 5, seed=9)
    temp = 1.6
    lse = kf.row_logsumexp(z, nidx, temp)
    q = kf.project_rows_forward(z, lse, *csc, temp)
    used = (nidx >= 0).view(-1, 1)
    z64 = z.detach().double().reshape(B * T, V).requires_grad_()
    q_ref = (torch.softmax(z64 / temp, -1)[:, :S] @ dense) * used
    torch.testing.assert_close(q.double(), q_ref.detach(), rtol=1e-5, atol=1e-7)
    assert bool((q[~used.flatten()] == 0).all())

    dq = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE) * used
    dot = (dq * q).sum(-1)
    dz = kf.project_rows_backward(z, lse, dq, dot, *ell, temp)
    (q_ref * dq.double()).sum().backward()
    assert dz.dtype == dtype and dz.shape == (B, T, V)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(dz.reshape(B * T, V).double(), z64.grad, **tol)


@pytest.mark.parametrize("parts", ["both", "common-only", "uncommon-only"])
def test_gold_backward_matches_autograd_of_the_weighted_chunk_means(parts):
    B, T, V, N, temp = 2, 9, 45, 5, 1.4
    z = _logits(B, T, V, torch.float32, seed=11)
    nidx, order, offsets = _rows(B, T, N, seed=12)
    gen = torch.Generator().manual_seed(13)
    perm = torch.randperm(V, generator=gen).to(DEVICE)
    common, uncommon = perm[:20], perm[20:40]  # ids perm[40:] get no gradient
    g_common = torch.randn(N, common.numel(), generator=gen).to(DEVICE)
    g_unc = torch.randn(N, uncommon.numel(), generator=gen).to(DEVICE)
    gscale = torch.tensor([0.7, -1.3], device=DEVICE)
    cpos = torch.full((V,), -1, dtype=torch.int32, device=DEVICE)
    G = torch.zeros(N, V, device=DEVICE)  # the dense chunk gradient the compact blocks encode
    if parts != "uncommon-only":
        cpos[common] = torch.arange(common.numel(), dtype=torch.int32, device=DEVICE)
        G[:, common] = gscale[0] * g_common
    if parts != "common-only":
        cpos[uncommon] = -2 - torch.arange(uncommon.numel(), dtype=torch.int32, device=DEVICE)
        G[:, uncommon] = gscale[1] * g_unc
    sizes = (offsets[1:] - offsets[:-1]).float()
    lse = kf.row_logsumexp(z, nidx, temp)
    dz = kf.gold_backward(
        z, lse, nidx, g_common if parts != "uncommon-only" else None,
        g_unc if parts != "common-only" else None, cpos, G.sum(-1),
        1.0 / (temp * sizes.clamp_min(1)), gscale, temp,
    )  # fmt: skip
    z64 = z.detach().double().requires_grad_()
    logp = torch.log_softmax(z64 / temp, -1).reshape(B * T, V)
    onehot = (nidx.view(1, -1) == torch.arange(N, device=DEVICE).view(-1, 1)).double()
    means = onehot @ logp / sizes.clamp_min(1).double().view(-1, 1)
    (means * G.double()).sum().backward()
    torch.testing.assert_close(dz.double(), z64.grad, rtol=1e-5, atol=1e-7)
