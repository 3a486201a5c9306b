"""Every mode's CPU path (``KDMode.cpu``; P-KL's ``cpu_kd_loss``) against its reference, on odd
shapes: the KD sums, the metrics and the logits' gradient."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.modes import test_kernel_paths
from xtoken_core.data.projection import Projection
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.losses.backends import cpu
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes import MODES, pkl


def _case(*args, **kwargs):
    """The kernel tests' odd-shaped case, on the CPU (the CPU path's device, CUDA or not)."""
    return tuple(x.cpu() for x in test_kernel_paths._case(*args, **kwargs))


def _pkl(path, case, **kw):
    zs, zt, s_ids, t_ids, valid, indices, likelihoods = case
    projection = Projection.from_topk(indices, likelihoods, indices.device)
    M = projection.sparse(zs.shape[-1], zt.shape[-1])
    x = zs.detach().clone().requires_grad_()
    opts = dict(temperature=1.7, reverse_kl=False, vocab_topk=17)
    opts.update(kw)
    config = CrossTokenizerLossConfig(**opts)
    inputs = LossInputs(x, zt, s_ids, t_ids, valid)
    terms = getattr(pkl, f"{path}_kd_loss")(inputs, M, config)
    (3.0 * terms.kd).backward()
    return terms, x.grad


def _assert_same(case, grad_tol=None, **kw):
    ref, g_ref = _pkl("reference", case, **kw)
    got, g_got = _pkl("cpu", case, **kw)
    for name in ("kd", "kl", "l1", "num_valid"):
        torch.testing.assert_close(
            getattr(got, name).float(), getattr(ref, name).float(), rtol=2e-5, atol=1e-6
        )
    assert got.correct.item() == ref.correct.item()
    assert g_got.dtype == case[0].dtype and g_got.shape == case[0].shape
    torch.testing.assert_close(g_got.float(), g_ref.float(), **(grad_tol or {}))
    return g_got


@pytest.mark.parametrize("reverse_kl", [False, True], ids=["fwd-kl", "rev-kl"])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_pkl_cpu_path_equals_the_reference_forward_and_gradient(reverse_kl, temperature):
    case = _case(11, torch.float32)
    _assert_same(case, reverse_kl=reverse_kl, temperature=temperature)


@pytest.mark.parametrize("vocab_topk,topk_columns", [(None, "valid"), (5, "all"), (1000, "valid")])
def test_pkl_cpu_path_equals_the_reference_for_every_column_rule(vocab_topk, topk_columns):
    case = _case(12, torch.float32, Bn=3, Tn=17, Un=13, Vn=47, Wn=29, Cn=9)
    _assert_same(case, vocab_topk=vocab_topk, topk_columns=topk_columns)


def test_pkl_cpu_path_with_bf16_logits_is_within_bf16_rounding_of_the_reference():
    case = _case(13, torch.bfloat16)
    ref, g_ref = _pkl("reference", case, temperature=2.0)
    got, g_got = _pkl("cpu", case, temperature=2.0)
    torch.testing.assert_close(got.kd, ref.kd, rtol=1e-4, atol=1e-6)
    assert g_got.dtype == torch.bfloat16
    rel = (g_got.float() - g_ref.float()).norm() / g_ref.float().norm()
    assert rel < 1e-2, rel


def test_pkl_cpu_path_over_several_row_blocks_equals_the_reference(monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK_ELEMENTS", 150)  # about 2 rows of V=61 per block
    _assert_same(_case(14, torch.float32), reverse_kl=True)


def test_pkl_cpu_path_without_a_valid_chunk_is_zero_with_a_zero_gradient():
    case = list(_case(15, torch.float32))
    case[4] = torch.zeros_like(case[4])
    terms, grad = _pkl("cpu", case)
    assert terms.kd.item() == 0.0 and terms.num_valid.item() == 0
    assert bool((grad == 0).all())
    empty = [x[:0] for x in case[:5]] + case[5:]
    terms, grad = _pkl("cpu", empty)
    assert terms.kd.item() == 0.0 and grad.shape == empty[0].shape


@pytest.mark.parametrize("mode", ["gold", "xtoken"])
def test_a_mode_without_a_cpu_path_runs_its_reference(mode):
    zs, zt, s_ids, t_ids, valid, indices, likelihoods = _case(16, torch.float32)
    config = CrossTokenizerLossConfig(mode=mode, projection=(indices, likelihoods))
    m = MODES[mode](config)
    projection = Projection.from_topk(indices, likelihoods, torch.device("cpu"))
    inputs = LossInputs(zs, zt, s_ids, t_ids, valid)
    got, ref = m.cpu(inputs, projection), m.reference(inputs, projection)
    assert got.kd.item() == ref.kd.item() and got.l1.item() == ref.l1.item()
