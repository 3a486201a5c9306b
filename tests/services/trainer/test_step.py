"""The student step without sockets: the schedule, optimizer steps, skipped steps, the CE-only
mode, the projection checks of the loss."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.sections import StudentConfig
from services.trainer.step import StudentStep
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup
from xtoken_core.losses import CrossTokenizerLossConfig


def _params(step: StudentStep) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in step.student.module.named_parameters()}


def test_a_step_reports_the_learning_rate_it_used():
    config = setup.trainer_config(
        None, optim={"lr": 1e-3, "warmup_steps": 4}, schedule={"max_steps": 8}
    )
    step = build_step(config)
    batch = setup.micro_batches()[0]
    lrs = [step.run([setup.micro_batch(batch, ["a"], False)]).metrics["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert step.student.step == 5


def test_steps_on_a_fixed_batch_lower_the_pkl_loss(projection):
    step = build_step(setup.trainer_config(projection, loss={"ce_weight": 0.5}))
    assert step.loss_fn is not None
    batch = setup.micro_batches()[1]
    mbs = [setup.micro_batch(batch, ["a", "b"])]
    losses = [step.run(mbs).metrics for _ in range(6)]
    assert all(math.isfinite(m["loss"]) for m in losses)
    curve = [m["loss"] for m in losses]
    assert all(b < a for a, b in zip(curve, curve[1:])), curve
    assert losses[-1]["kl_loss"] < losses[0]["kl_loss"]
    assert mbs[0].context == {"teacher": 6, "done": 6}  # logits once, slot released once a step
    assert losses[0]["tokens"] == int(batch["input_lengths"].sum())
    assert step.student.step == 6 and step.skipped_steps == 0


# a skipped first update means the schedule steps before the optimizer ever did: intended
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_step_returns_before_its_figures_are_read_and_the_next_step_reads_them():
    # the host queues step 2 while step 1 finishes: step 1's figures are read by then at the
    # latest; a skipped update counts once its step is read (the count reads it)
    step = build_step(setup.trainer_config(None))
    param = next(step.student.module.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    first = step.run([mb])
    handle.remove()
    assert not first.read and first.keys == ["a"] and first.step == 1
    second = step.run([mb])
    assert first.read and not second.read
    assert first.skipped and not math.isfinite(first.metrics["grad_norm"])
    assert step.skipped_steps == 1 and second.read  # the count reads the last step too
    assert not second.skipped and math.isfinite(second.metrics["loss"])
    assert set(second.times) >= {"forward", "backward", "optimizer", "sync"}


# a skipped first update means the schedule steps before the optimizer ever did: intended
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_non_finite_gradient_skips_the_update_and_counts_it():
    step = build_step(setup.trainer_config(None))
    before = _params(step)
    param = next(step.student.module.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    result = step.run([mb])
    handle.remove()
    assert result.skipped and step.skipped_steps == 1
    assert not math.isfinite(result.metrics["grad_norm"])
    after = _params(step)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed weights"
    assert all(
        p.grad is None for p in step.student.module.parameters()
    )  # nothing leaks to the next
    # the fused AdamW skipped the whole update: its state is as new (no step counted)
    for state in step.student.optimizer.state.values():
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    result = step.run([mb])  # the next finite step trains again
    assert not result.skipped and step.skipped_steps == 1 and step.student.step == 2
    assert any(not torch.equal(before[n], p) for n, p in step.student.module.named_parameters())


def test_ce_mode_needs_no_projection_nor_teacher():
    config = TrainerConfig(
        student=StudentConfig(model="tiny"),
        student_tokenizer=setup.STUDENT_TOKENIZER,
        teacher_tokenizer=setup.TEACHER_TOKENIZER,
        loss=CrossTokenizerLossConfig(mode="ce"),
    )
    step = build_step(config)
    assert step.loss_fn is None and not config.loss.uses_teacher
    batch = setup.micro_batches()[2]
    mb = setup.micro_batch(batch, ["a", "b"], with_teacher=False)
    first = step.run([mb]).metrics
    for _ in range(3):
        last = step.run([mb]).metrics
    assert set(first) >= {"loss", "ce_loss", "accuracy", "grad_norm", "lr", "tokens"}
    assert first["loss"] == first["ce_loss"]
    assert last["loss"] < first["loss"]


def test_pkl_mode_without_a_projection_is_a_config_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"loss.projection.*xtoken projection build"):
        setup.trainer_config(None, loss={"mode": "pkl"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"feed": {"micro_batch": 0}}, r"^feed: micro_batch=0: must be >= 1$"),
        ({"optim": {"min_lr_ratio": 1.5}}, r"min_lr_ratio=1.5: must be in \[0, 1\]"),
        ({"loss": {"mode": "ce", "ce_weight": 0.0}}, "trains nothing"),
        ({"feed": {"queue_timeout_s": 0.0}}, "queue_timeout_s=0.0: must be > 0 seconds"),
        (
            {"compute": {"packed_attention": "dense"}},
            "packed_attention: expected one of 'auto', 'flex_attention', 'sdpa', got 'dense'",
        ),
    ],
)
def test_trainer_config_names_a_bad_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        setup.trainer_config(None, **overrides)


def _recorded_projection(path, student_tok, teacher_tok, indices=None):
    """The test projection saved with ``student_tok -> teacher_tok`` as its recorded pair."""
    from xtoken_core.data.projection_build import (
        build_projection,
        projection_metadata,
        save_projection,
    )

    result = build_projection(*setup.tokenizers(), 4)
    if indices is not None:
        result = {"indices": indices, "likelihoods": (indices >= 0).float()}
    save_projection(result, path, projection_metadata(student_tok, teacher_tok))
    return str(path)


def test_a_trainer_refuses_a_projection_built_for_other_tokenizers(tmp_path):
    student, _ = setup.tokenizers()
    path = _recorded_projection(tmp_path / "proj.pt", student, student)  # teacher side wrong
    with pytest.raises(ValueError, match=r"built for teacher tokenizer.*xtoken projection build"):
        build_step(setup.trainer_config(path))


def test_a_trainer_refuses_a_projection_with_no_usable_row(tmp_path):
    student, teacher = setup.tokenizers()
    empty = torch.full((student.vocab_size, 4), -1, dtype=torch.long)
    path = _recorded_projection(tmp_path / "proj.pt", student, teacher, indices=empty)
    with pytest.raises(ValueError, match="no usable row"):
        build_step(setup.trainer_config(path))


def test_a_trainer_accepts_the_projection_built_for_its_tokenizers(tmp_path):
    path = _recorded_projection(tmp_path / "proj.pt", *setup.tokenizers())
    assert build_step(setup.trainer_config(path)).loss_fn is not None
