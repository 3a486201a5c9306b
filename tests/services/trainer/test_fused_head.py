"""The trainer's fused output head (trainer.compute.fused_head): off on the CPU by default, the
same steps as the materialized logits in every mode, its start-up step, the cases it refuses, and
a 200-step run that ends where the materialized run ends."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.startup import warm_step
from services.trainer.step import StudentStep
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup


def _step(projection, mode: str, fused: bool | None, **overrides) -> StudentStep:
    """``fused``: ``compute.fused_head``, None to leave it unset."""
    loss = {"mode": mode, "ce_weight": 0.5} if mode != "ce" else {}
    # several blocks per sample
    compute = {} if fused is None else {"fused_head": fused, "fused_head_rows": 7}
    config = setup.trainer_config(
        None if mode == "ce" else projection, loss=loss, compute=compute, **overrides
    )
    return build_step(config)


def _steps(step: StudentStep, batches, n: int) -> list[dict[str, float]]:
    with_teacher = step.loss_fn is not None
    mbs = [setup.micro_batch(b, [f"k{i}"] * 2, with_teacher) for i, b in enumerate(batches)]
    return [step.run(mbs).metrics for _ in range(n)]


def test_fused_head_is_off_on_the_cpu_unless_asked_for(projection):
    assert _step(projection, "pkl", None).head is None
    step = _step(projection, "pkl", True)
    assert step.head is not None and step.head.loss_fn is step.loss_fn
    assert step.head.block_rows == 7  # trainer.compute.fused_head_rows
    # tied embeddings: the head's weight is the embedding's parameter
    student = step.student
    assert student.lm_head.weight is student.compute.get_input_embeddings().weight


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken", "ce"])
def test_fused_head_steps_equal_the_materialized_steps(projection, mode):
    """fp32 on the CPU: the losses and metrics (the gradient norm included) of three steps over
    two micro-batches agree to 1e-5 (relative) with the materialized logits'; the parameters'
    moves have a cosine >= 0.9999 and differ by <= 1e-3 of their norm (AdamW turns the rounding
    of a near-zero gradient into a step of up to lr, so elementwise they may differ more)."""
    batches = setup.micro_batches()[:2]
    runs = {}
    for fused in (False, True):
        step = _step(projection, mode, fused)
        start = torch.cat([p.detach().flatten() for p in step.student.module.parameters()])
        metrics = _steps(step, batches, 3)
        end = torch.cat([p.detach().flatten() for p in step.student.module.parameters()])
        runs[fused] = (metrics, end - start)
    (m0, p0), (m1, p1) = runs[False], runs[True]
    for a, b in zip(m0, m1, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    cos = torch.nn.functional.cosine_similarity(p0.double(), p1.double(), 0)
    assert float(cos) >= 0.9999
    assert float((p1 - p0).norm()) <= 1e-3 * float(p0.norm())


def test_start_up_step_through_the_head_leaves_no_gradient(projection):
    step = _step(projection, "gold", True)
    warm_step(step.student, step.student.pads(2, 24), step.head)
    assert all(p.grad is None for p in step.student.module.parameters())
    metrics = _steps(step, setup.micro_batches()[:1], 1)[0]
    assert math.isfinite(metrics["loss"]) and metrics["loss"] > 0


def test_fused_head_with_several_processes_is_refused_naming_the_setting(projection):
    config = setup.trainer_config(projection, compute={"fused_head": True})
    with pytest.raises(ValueError, match="fused_head.*one process.*fused_head: false"):
        build_step(config, world_size=2)


@pytest.mark.slow
def test_a_200_step_run_with_the_fused_head_ends_within_the_seed_noise(projection):
    """The tiny student, P-KL, 200 steps on the CPU (fp32): the fused head's final loss (mean of
    the last 20 steps) lies within the run-to-run noise, the gap between two seeds of the
    materialized path."""
    batches = setup.micro_batches()
    finals = {}
    for name, fused, seed in (("mat0", False, 0), ("mat1", False, 1), ("head0", True, 0)):
        step = _step(projection, "pkl", fused, student={"seed": seed}, schedule={"max_steps": 200})
        losses = []
        for i in range(200):
            batch = batches[i % len(batches)]
            losses += [m["loss"] for m in _steps(step, [batch], 1)]
        finals[name] = sum(losses[-20:]) / 20
    noise = abs(finals["mat0"] - finals["mat1"])
    print(f"final losses {finals}, seed noise {noise:.4f}")
    assert abs(finals["head0"] - finals["mat0"]) <= noise


def test_a_fused_head_block_of_no_rows_is_refused_naming_the_setting():
    from services.trainer.sections import ComputeConfig

    with pytest.raises(ValueError, match=r"^fused_head_rows=0: must be >= 1"):
        ComputeConfig(fused_head_rows=0)
