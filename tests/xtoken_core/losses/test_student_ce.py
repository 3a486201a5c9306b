"""The student CE inside CrossTokenizerLoss: the kernel backend's CE (kernels.row_ce) against the
reference backend, in every mode."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_batch, make_logits, make_projection
from xtoken_core.kernels import row_ce
from xtoken_core.losses import METRIC_KEYS, CrossTokenizerLoss, CrossTokenizerLossConfig

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter_without_cuda(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def ce_calls(monkeypatch):
    """The ``lse_R`` of every call of the CE kernels (None: the kernels made their own)."""
    calls = []
    kernel = row_ce.row_cross_entropy

    def spy(*args, lse_R=None, **kw):
        calls.append(lse_R)
        return kernel(*args, lse_R=lse_R, **kw)

    monkeypatch.setattr(row_ce, "row_cross_entropy", spy)
    return calls


def _run(zs, zt, batch, backend, **cfg):
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=make_projection(), backend=backend, **cfg)
    )
    x = zs.detach().clone().requires_grad_()
    loss, metrics = loss_fn(x, zt, batch)
    loss.backward()
    return loss.detach(), x.grad, metrics


def _case(seed, dtype):
    zs, zt = make_logits(seed)
    batch = make_batch(seed)
    batch["sample_mask"][1] = False  # a masked sample: its tokens count nowhere
    on = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}
    return zs.detach().to(dtype).to(DEVICE), zt.to(dtype).to(DEVICE), on


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kernel_ce_gives_the_reference_loss_gradient_and_metrics(mode, temperature, ce_calls):
    zs, zt, batch = _case(40, torch.float32)
    cfg = dict(mode=mode, vocab_topk=6, temperature=temperature, kl_weight=0.6, ce_weight=0.4)
    ref = _run(zs, zt, batch, "reference", **cfg)
    assert ce_calls == []  # the reference backend takes the reference CE
    got = _run(zs, zt, batch, "kernel", **cfg)
    assert len(ce_calls) == 1
    # gold made the rows' logsumexps at temperature 1 already: the CE takes them
    assert (ce_calls[0] is not None) == (mode != "pkl" and temperature == 1.0)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-6)
    for key in METRIC_KEYS:
        torch.testing.assert_close(got[2][key], ref[2][key], rtol=1e-5, atol=1e-6)
    assert got[2]["ce_loss"].item() > 0 and got[2]["accuracy"].item() >= 0


def test_kernel_ce_of_bf16_logits_is_close_to_the_fp64_reference():
    """ce_loss relative error <= 1e-3 against the fp64 reference of the same bf16 logits."""
    zs, zt, batch = _case(41, torch.float64)
    zs16, zt16 = zs.to(torch.bfloat16), zt.to(torch.bfloat16)
    cfg = dict(mode="gold", kl_weight=0.0, ce_weight=1.0)
    _, _, ref = _run(zs16.double(), zt16.double(), batch, "reference", **cfg)
    loss, grad, got = _run(zs16, zt16, batch, "kernel", **cfg)
    assert grad.dtype == torch.bfloat16
    rel = abs(got["ce_loss"].item() - ref["ce_loss"].item()) / ref["ce_loss"].item()
    assert rel <= 1e-3, rel
    assert got["accuracy"].item() == pytest.approx(ref["accuracy"].item(), abs=1e-7)


def test_ce_only_gradient_of_the_kernel_backend_is_the_softmax_minus_onehot():
    zs, zt, batch = _case(42, torch.float32)
    cfg = dict(mode="gold", kl_weight=0.0, ce_weight=1.0)
    _, grad, metrics = _run(zs, zt, batch, "kernel", **cfg)
    counted = torch.zeros(zs.shape[:2], dtype=torch.bool, device=DEVICE)
    counted[:, :-1] = batch["token_mask"][:, 1:] & batch["sample_mask"].view(-1, 1)
    want = torch.softmax(zs.double(), -1)
    want[:, :-1].scatter_add_(
        -1, batch["input_ids"][:, 1:, None], -torch.ones_like(want[:, :-1, :1])
    )
    want = want * counted[..., None] / counted.sum()
    torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-7)
