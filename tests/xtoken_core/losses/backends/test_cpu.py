"""The CPU backend (xtoken_core/losses/backends/cpu.py): its pieces and the whole loss on CPU
logits against the PyTorch reference, forward, gradient and metrics."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_batch, make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.backends import cpu, reference
from xtoken_core.losses.backends.cpu import CpuBackend
from xtoken_core.losses.backends.reference import ReferenceBackend


def _odd_logits(seed, B=3, T=7, V=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, T, V, generator=g)).to(dtype)


def test_row_slices_cover_the_rows_as_runs_of_consecutive_rows(monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 20)  # 2 rows of 10 per block
    rows = torch.tensor([0, 1, 2, 5, 6, 9])
    slices = cpu.row_slices(rows, 10)
    assert slices == [(0, 2, 0), (2, 3, 2), (5, 7, 3), (9, 10, 5)]
    covered = torch.cat([torch.arange(r0, r1) for r0, r1, _ in slices])
    assert covered.tolist() == rows.tolist()
    assert cpu.row_slices(torch.zeros(0, dtype=torch.long), 10) == []


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_stats_are_the_logsumexp_and_max_of_the_rows(monkeypatch, temperature, dtype):
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 64)  # several blocks per call
    z_RV = _odd_logits(1, dtype=dtype).reshape(-1, 37)
    z_RV[4, :] = float("-inf")  # a row with no finite logit: -inf, like torch.logsumexp
    rows = torch.tensor([0, 1, 2, 4, 8, 9, 20])
    lse, top = cpu.row_stats(z_RV, rows, temperature)
    want = torch.logsumexp(z_RV[rows].float() / temperature, dim=-1)
    torch.testing.assert_close(lse, want)
    torch.testing.assert_close(top, z_RV[rows].float().amax(-1))


def test_argmax_is_takes_the_first_maximal_index_on_ties():
    z_RV = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 5.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    rows = torch.tensor([0, 0, 1, 1, 2])
    ids = torch.tensor([1, 2, 0, 2, 3])
    _, max_A = cpu.row_stats(z_RV, rows.unique(), 1.0)
    got = cpu.argmax_is(z_RV, rows, ids, max_A[rows])
    assert (
        got.tolist() == (z_RV[rows].argmax(-1) == ids).tolist() == [True, False, True, False, True]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_student_ce_equals_the_reference_with_its_gradient(dtype):
    zs = _odd_logits(2, B=3, T=9, V=41, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 41, (3, 9), generator=g)
    ids[0, 4] = int(zs[0, 3].float().argmax())  # at least one correct prediction
    token_mask = torch.rand(3, 9, generator=g) > 0.25
    token_mask[0, 4] = True
    sample_mask = torch.tensor([True, True, False])
    out = {}
    for name, fn in (("ref", reference.student_ce_loss), ("cpu", cpu.student_ce)):
        x = zs.clone().requires_grad_()
        nll, correct, n = fn(x, ids, token_mask, sample_mask)
        (2.5 * nll).backward()
        out[name] = (nll.detach(), correct, n, x.grad)
    (nll_r, c_r, n_r, g_r), (nll_c, c_c, n_c, g_c) = out["ref"], out["cpu"]
    torch.testing.assert_close(nll_c, nll_r)
    assert c_c.item() == c_r.item() >= 1 and n_c.item() == n_r.item()
    assert g_c.dtype == dtype and bool((g_c[2] == 0).all())  # the masked sample: no gradient
    tol = {} if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(g_c.float(), g_r.float(), **tol)


def _loss_and_grad(zs, zt, batch, backend, **cfg):
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=make_projection(), backend=backend, **cfg)
    )
    x = zs.clone().requires_grad_()
    loss, metrics = loss_fn(x, zt, batch)
    loss.backward()
    return loss_fn, loss.detach(), x.grad, metrics


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_the_cpu_backend_gives_the_reference_loss_gradient_and_metrics(mode, temperature):
    if torch.cuda.is_available():
        pytest.skip("auto takes the kernels where CUDA is available")
    zs, zt = make_logits(7)
    zs, zt = zs.detach().float(), zt.float()
    batch = make_batch(7)
    batch["sample_mask"][1] = False
    cfg = dict(mode=mode, vocab_topk=5, temperature=temperature, kl_weight=0.6, ce_weight=0.4)
    fn, loss_c, grad_c, m_c = _loss_and_grad(zs, zt, batch, "auto", **cfg)
    _, loss_r, grad_r, m_r = _loss_and_grad(zs, zt, batch, "reference", **cfg)
    assert isinstance(fn.backend, CpuBackend) and fn.backend_for(zs, [zt]) is fn.backend
    torch.testing.assert_close(loss_c, loss_r)
    torch.testing.assert_close(grad_c, grad_r, rtol=1e-4, atol=1e-7)
    for key in m_r:
        torch.testing.assert_close(m_c[key], m_r[key], msg=key)


def test_fp64_logits_take_the_reference_backend_under_auto():
    zs, zt = make_logits(0)
    fn = CrossTokenizerLoss(CrossTokenizerLossConfig(projection=make_projection()))
    backend = fn.backend_for(zs.detach(), [zt])
    assert isinstance(backend, ReferenceBackend) and not isinstance(backend, CpuBackend)
