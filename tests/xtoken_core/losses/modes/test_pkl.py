"""P-KL's reference pieces: column pick, restriction, chunk KL, gradcheck, empty batch."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.backends.test_reference import tiny_case
from xtoken_core.data.projection import Projection
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes import pkl


def test_teacher_columns_are_the_topk_by_max_logit_over_chunked_positions():
    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0], [9.0, 0.0, 0.0, 0.0]]])
    # Position 1 has no chunk: its 9.0 on column 0 must not count.
    idx = pkl.select_teacher_columns(logits, torch.tensor([[0, -1]]), 2)
    assert idx.tolist() == [1, 3]
    assert pkl.select_teacher_columns(logits, torch.tensor([[0, -1]]), 10).tolist() == [
        0,
        1,
        2,
        3,
    ]


def test_restricted_projection_keeps_only_the_selected_columns_in_order():
    indices = torch.tensor([[0, 2], [3, -1], [1, 2]])
    likelihoods = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    M = Projection.from_topk(indices, likelihoods, "cpu").sparse(4, 4)
    sub = pkl.restrict_columns(M, torch.tensor([2, 3]))
    assert sub.to_dense().tolist() == [[0.5, 0.0], [0.0, 1.0], [0.75, 0.0], [0.0, 0.0]]


def test_pkl_kl_of_a_hand_computed_chunk():
    # Teacher chunk log-probs log([0.5, 0.25, 0.25]); student projection q = [2, 1, 1] / 4 after
    # renormalization -> identical: KL 0. Student [0.25, 0.25, 0.5]: KL = 0.25 * log 2.
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    same = pkl.chunk_kl(teacher, torch.tensor([[2.0, 1.0, 1.0]], dtype=torch.float64), False)
    assert same.item() == pytest.approx(0.0, abs=1e-15)
    other = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)
    fwd = pkl.chunk_kl(teacher, other, False).item()
    rev = pkl.chunk_kl(teacher, other, True).item()
    assert fwd == pytest.approx(
        0.5 * torch.log(torch.tensor(2.0)).item() - 0.25 * torch.log(torch.tensor(2.0)).item()
    )
    assert rev == pytest.approx(0.25 * torch.log(torch.tensor(2.0)).item())


@pytest.mark.parametrize("reverse", [False, True])
def test_pkl_reference_gradcheck(reverse):
    zs, zt, s_ids, t_ids, valid, M, _ = tiny_case(3)
    config = CrossTokenizerLossConfig(temperature=1.5, vocab_topk=4, reverse_kl=reverse)

    def f(z):
        return pkl.reference_kd_loss(LossInputs(z, zt, s_ids, t_ids, valid), M, config).kd

    assert torch.autograd.gradcheck(f, (zs,))


@pytest.mark.parametrize("vocab_topk", [None, 4])
def test_pkl_reference_of_an_empty_batch_is_a_zero_with_a_gradient(vocab_topk):
    zs, zt, s_ids, t_ids, valid, M, _ = tiny_case(3)
    zs0 = zs[:0].detach().requires_grad_()
    inputs = LossInputs(zs0, zt[:0], s_ids[:0], t_ids[:0], valid[:0])
    config = CrossTokenizerLossConfig(temperature=1.0, vocab_topk=vocab_topk, reverse_kl=False)
    terms = pkl.reference_kd_loss(inputs, M, config)
    assert terms.kd.item() == 0.0 and terms.num_valid.item() == 0
    terms.kd.backward()
    assert zs0.grad.shape == zs0.shape
    cols = pkl.select_teacher_columns(zt[:0], t_ids[:0], vocab_topk)
    k = vocab_topk or zt.shape[-1]
    assert cols.numel() == k and bool((cols.diff() > 0).all())  # k distinct ids, ascending
