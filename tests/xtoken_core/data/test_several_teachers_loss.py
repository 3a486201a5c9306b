"""Samples of two teachers end to end through the real loss: the collator's two-teacher samples
(student mistral, teachers qwen3 and smollm2), padded into one batch, with each teacher's
logits and its projection built from the real tokenizers, give ``CrossTokenizerLoss`` with
``teacher_weights=[0.7, 0.3]`` exactly ``0.7 * loss(teacher 0 alone) + 0.3 * loss(teacher 1
alone)``, each alone on a one-teacher collator's batch of the same texts.

The loss sums ``w_t * kd_t / D_t`` over teachers and adds the student CE once
(docs/design.md, "The loss math"); with weights summing to 1 the CE of the weighted sum of the
one-teacher losses is the same CE, so the identity holds with the CE term in, for the loss, the
KD term and the gradient alike.
"""

from __future__ import annotations

import functools

import pytest
import torch

from xtoken_core.align import TokenAligner
from xtoken_core.data import sample as S
from xtoken_core.data.collator import CrossTokenizerCollator
from xtoken_core.data.projection_build import build_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.tokenizers import load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "",
    "Über-naïve café prices: 12,50 € each. 日本語のテキスト。",
]
STUDENT, TEACHERS = "mistral", ("qwen3", "smollm2")
WEIGHTS = (0.7, 0.3)
# the teachers' lm_heads are wider than their tokenizers (padding columns the loss drops)
EXTRA_COLUMNS = (267, 64)
CTX, DIVS = 24, (4, 3)


def _collator(teachers: tuple[str, ...], divs: tuple[int, ...]) -> CrossTokenizerCollator:
    return CrossTokenizerCollator(
        student_tokenizer=load_tokenizer(STUDENT),
        teacher_tokenizers=[load_tokenizer(t) for t in teachers],
        aligner=TokenAligner(),
        ctx_length_student=CTX,
        ctx_length_teacher=CTX,
        make_seq_div_by_student=2,
        make_seq_div_by_teacher=list(divs),
    )


def _batch(teachers: tuple[str, ...], divs: tuple[int, ...]) -> dict[str, torch.Tensor]:
    collator = _collator(teachers, divs)
    return S.pad_samples(collator.collate_samples(TEXTS), **collator.pad_kwargs())


@functools.cache
def _projection(teacher: str) -> tuple[torch.Tensor, torch.Tensor]:
    built = build_projection(load_tokenizer(STUDENT), load_tokenizer(teacher), 4)
    return built["indices"], built["likelihoods"]


def _loss(teachers: tuple[str, ...], weights: tuple[float, ...], mode: str) -> CrossTokenizerLoss:
    return CrossTokenizerLoss(
        CrossTokenizerLossConfig(
            mode=mode,
            projection=[_projection(t) for t in teachers],
            teacher_weights=list(weights),
            teacher_vocab_size=[load_tokenizer(t).vocab_size for t in teachers],
            vocab_topk=512,
            backend="reference",
        )
    )


def _logits(batch: dict[str, torch.Tensor]):
    g = torch.Generator().manual_seed(0)
    B, T = batch["input_ids"].shape
    zs = (2 * torch.randn(B, T, load_tokenizer(STUDENT).vocab_size, generator=g)).requires_grad_()
    zt = []
    for i, (name, extra) in enumerate(zip(TEACHERS, EXTRA_COLUMNS)):
        U = batch[S.teacher_field_name("teacher_input_ids", i)].shape[1]
        zt.append(2 * torch.randn(B, U, load_tokenizer(name).vocab_size + extra, generator=g))
    return zs, zt


@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_two_teacher_loss_is_the_weighted_sum_of_each_teacher_alone(mode):
    both = _batch(TEACHERS, DIVS)
    alone = [_batch((t,), (d,)) for t, d in zip(TEACHERS, DIVS)]
    zs, zt = _logits(both)
    for i, batch in enumerate(alone):  # teacher i alone sees the logits of its own width
        assert batch["teacher_input_ids"].shape[1] == zt[i].shape[1]
        assert batch["input_ids"].shape == both["input_ids"].shape

    loss_fn = _loss(TEACHERS, WEIGHTS, mode)
    counts = loss_fn.count_valid([both])
    loss, metrics = loss_fn(zs, zt, both, **counts)
    (grad,) = torch.autograd.grad(loss, zs)

    singles, grads, chunks = [], [], []
    for i, teacher in enumerate(TEACHERS):
        single_fn = _loss((teacher,), (1.0,), mode)
        single_counts = single_fn.count_valid([alone[i]])
        chunks.append(float(single_counts["global_valid_chunks"][0]))
        single, single_metrics = single_fn(zs, zt[i], alone[i], **single_counts)
        (g,) = torch.autograd.grad(single, zs)
        singles.append((single, single_metrics))
        grads.append(g)

    assert counts["global_valid_chunks"].tolist() == chunks
    assert chunks[0] != chunks[1] and min(chunks) > 0  # the teachers' alignments differ
    (l0, m0), (l1, m1) = singles
    assert abs(float(l0 - l1)) > 1e-3, "the weights must matter for the test to tell"
    expected = WEIGHTS[0] * l0 + WEIGHTS[1] * l1
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        metrics["kl_loss"], WEIGHTS[0] * m0["kl_loss"] + WEIGHTS[1] * m1["kl_loss"]
    )
    torch.testing.assert_close(metrics["ce_loss"], m0["ce_loss"])
    torch.testing.assert_close(
        grad, WEIGHTS[0] * grads[0] + WEIGHTS[1] * grads[1], rtol=1e-5, atol=1e-9
    )


def test_the_loss_refuses_a_teacher_whose_logits_do_not_fit_its_own_fields():
    both = _batch(TEACHERS, DIVS)
    zs, zt = _logits(both)
    swapped_width = torch.zeros(zt[1].shape[0], zt[0].shape[1] + 1, zt[1].shape[2])
    with pytest.raises(ValueError, match="alignment_teacher_chunk_id is"):
        _loss(TEACHERS, WEIGHTS, "pkl")(zs.detach(), [zt[0], swapped_width], both)
