"""pkl_chunk_kl chunk-KL kernels vs the reference chunk terms (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE
from xtoken_core.kernels import logit_rows, pkl_chunk_kl
from xtoken_core.losses.modes import pkl

pytest.importorskip("triton")

# Rows of 4 valid chunks: chunk 0 is not contiguous, rows 3 and 8 belong to no chunk.
NIDX = [0, 1, 1, -1, 2, 2, 2, 3, -1, 0, 3]
N, K, TEMP = 4, 37, 1.7


def _rows():
    nidx = torch.tensor(NIDX)
    key = torch.where(nidx >= 0, nidx, N)
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(N + 1))
    return nidx, order, offsets


def _inputs(seed):
    """q rows with exact ties at the max (chunk 1 across blocks, chunk 2 inside one), zeros
    (u < eps) and a chunk whose total is below eps (chunk 3), plus teacher log-probs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(len(NIDX), K, generator=gen, dtype=torch.float64) * 0.05
    q[q < 0.01] = 0.0
    q[1:3, 5] = q[1:3, 20] = 0.9  # chunk 1: tie between columns 5 and 20
    q[4:7, 2] = q[4:7, 7] = 0.8  # chunk 2: tie between columns 2 and 7
    q[[7, 10]] = 1e-13  # chunk 3: tot < eps
    lp = torch.log_softmax(torch.randn(N, K, generator=gen, dtype=torch.float64) * 2, -1)
    lp[1, 5] = lp[1].max() + 1.0  # teacher argmax of chunk 1 is the first tied student column
    lp[2, 7] = lp[2].max() + 1.0  # chunk 2: the second tied one (no agreement)
    return q.float(), lp.float()


def _reference(q_RK, lp_NK, reverse_kl):
    """Reference chunk terms in float64 with autograd: (kd, correct, dq)."""
    nidx = torch.tensor(NIDX)
    q64 = q_RK.double().cpu().requires_grad_()
    used = nidx >= 0
    q_NK = torch.zeros(N, K, dtype=torch.float64).index_add(0, nidx[used], q64[used])
    q_NK = q_NK / torch.bincount(nidx[used], minlength=N).double().unsqueeze(-1)
    terms = pkl.terms_from_chunks(
        lp_NK.double().cpu(),
        q_NK,
        torch.ones(1, N, dtype=torch.bool),
        temperature=TEMP,
        reverse_kl=reverse_kl,
    )
    terms.kd.backward()
    return terms.kd.detach(), terms.correct, q64.grad


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 columns and 4 rows: several K blocks and row blocks at these sizes."""
    for key, value in (("klf_block_k", 16), ("klb_block_k", 16), ("klb_block_r", 4)):
        monkeypatch.setitem(logit_rows.KERNEL_CONFIG, key, value)


@pytest.mark.parametrize("reverse_kl", [False, True], ids=["fwd-kl", "rev-kl"])
def test_chunk_terms_and_row_gradients_match_the_reference(reverse_kl, small_blocks):
    q_RK, lp_NK = _inputs(seed=1)
    nidx, order, offsets = _rows()
    kd_ref, correct_ref, dq_ref = _reference(q_RK, lp_NK, reverse_kl)
    q_RK, lp_NK, nidx, order, offsets = (x.to(DEVICE) for x in (q_RK, lp_NK, nidx, order, offsets))
    out_N4, qc_NK, stats_N2 = pkl_chunk_kl.chunk_kl_forward(
        q_RK, order, offsets, lp_NK, TEMP, reverse_kl, pkl.PROB_EPS
    )
    kd, l1, correct, num_valid = out_N4.sum(0).tolist()
    assert kd == pytest.approx(kd_ref.item(), rel=1e-5)
    assert (l1, correct, num_valid) == (0.0, correct_ref.item(), N)
    # chunk 1 agrees on the first of its tied columns, chunk 2 (teacher on the second) does not
    assert out_N4[1:3, 2].tolist() == [1.0, 0.0]
    grad = torch.tensor([0.5, 7.0, 7.0, 7.0], device=DEVICE)  # only the kd slot counts
    dq, dot = pkl_chunk_kl.chunk_kl_backward(
        grad, q_RK, nidx, offsets, lp_NK, qc_NK, stats_N2, TEMP, reverse_kl, pkl.PROB_EPS
    )
    assert dq.shape == (len(NIDX), K) and dq.stride(0) == 1  # column-major: [K, R] memory
    torch.testing.assert_close(dq.double().cpu(), 0.5 * dq_ref, rtol=1e-4, atol=1e-6)
    assert bool((dq[nidx < 0] == 0).all())
    torch.testing.assert_close(dot, (dq * q_RK).sum(-1), rtol=1e-5, atol=1e-7)


def test_no_valid_chunk_gives_empty_terms_and_zero_row_gradients():
    q_RK = torch.rand(5, K, device=DEVICE)
    nidx = torch.full((5,), -1, device=DEVICE)
    offsets = torch.zeros(1, dtype=torch.long, device=DEVICE)
    lp_NK = torch.zeros(0, K, device=DEVICE)
    out_N4, qc_NK, stats_N2 = pkl_chunk_kl.chunk_kl_forward(
        q_RK, torch.arange(5, device=DEVICE), offsets, lp_NK, TEMP, False, pkl.PROB_EPS
    )
    assert out_N4.shape == (0, 4) and out_N4.sum(0).tolist() == [0.0] * 4
    dq, dot = pkl_chunk_kl.chunk_kl_backward(
        torch.ones(4, device=DEVICE),
        q_RK,
        nidx,
        offsets,
        lp_NK,
        qc_NK,
        stats_N2,
        TEMP,
        False,
        pkl.PROB_EPS,
    )
    assert bool((dq == 0).all()) and bool((dot == 0).all())


def test_device_n_covers_extra_slots_with_zero_rows_and_the_same_terms(small_blocks):
    q_RK, lp_NK = _inputs(seed=2)
    nidx, order, offsets = _rows()
    extra = 3  # slots past N: garbage offsets and teacher rows that must not be read
    offsets_S1 = torch.cat([offsets, torch.tensor([-5, 10**6, 7])])
    lp_SK = torch.cat([lp_NK, torch.full((extra, K), float("nan"))])
    args = [x.to(DEVICE) for x in (q_RK, order, offsets, lp_NK)]
    want, _, _ = pkl_chunk_kl.chunk_kl_forward(*args, TEMP, False, pkl.PROB_EPS)
    num_valid = torch.tensor([N], device=DEVICE)
    got, _, _ = pkl_chunk_kl.chunk_kl_forward(
        args[0],
        args[1],
        offsets_S1.to(DEVICE),
        lp_SK.to(DEVICE),
        TEMP,
        False,
        pkl.PROB_EPS,
        num_valid,
    )
    assert torch.equal(got[:N], want)
    assert got[N:].tolist() == [[0.0] * 4] * extra
