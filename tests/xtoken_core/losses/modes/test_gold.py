"""Gold's reference pieces: the chunk terms of a hand-computed chunk, gradcheck."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.backends.test_reference import tiny_case
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes import gold


def test_gold_terms_of_a_hand_computed_chunk():
    # Common pair (student 0 <-> teacher 1); uncommon student {1, 2}, teacher {0, 2}.
    student = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[0.1, 0.4, 0.5]], dtype=torch.float64))
    exact = {
        "common_student": torch.tensor([0]),
        "common_teacher": torch.tensor([1]),
        "uncommon_student": torch.tensor([1, 2]),
        "uncommon_teacher": torch.tensor([0, 2]),
    }
    kl, l1 = gold.chunk_terms(teacher, student, exact, uncommon_topk=8, reverse_kl=False)
    assert kl.item() == pytest.approx(0.4 * (torch.log(torch.tensor(0.4 / 0.5))).item())
    assert l1.item() == pytest.approx(abs(0.3 - 0.5) + abs(0.2 - 0.1))
    _, l1_top1 = gold.chunk_terms(teacher, student, exact, uncommon_topk=1, reverse_kl=False)
    assert l1_top1.item() == pytest.approx(0.2)
    kl_rev, _ = gold.chunk_terms(teacher, student, exact, uncommon_topk=8, reverse_kl=True)
    assert kl_rev.item() == pytest.approx(0.5 * torch.log(torch.tensor(0.5 / 0.4)).item())


@pytest.mark.parametrize("reverse", [False, True])
def test_gold_reference_gradcheck(reverse):
    zs, zt, s_ids, t_ids, valid, _, exact = tiny_case(4)
    config = CrossTokenizerLossConfig(
        mode="gold", temperature=2.0, uncommon_topk=2, reverse_kl=reverse
    )

    def f(z):
        return gold.reference_kd_loss(LossInputs(z, zt, s_ids, t_ids, valid), exact, config).kd

    assert torch.autograd.gradcheck(f, (zs,))
