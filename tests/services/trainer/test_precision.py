"""bf16 compute parameters with fp32 master weights: the update, the gradient accumulation, the
checkpoint round trip (CPU; the same code runs on CUDA, where it is the default)."""

from __future__ import annotations

import torch

from services.trainer import checkpoint
from services.trainer.precision import resolve_param_dtype
from services.trainer.sections import ComputeConfig
from services.trainer.step import StudentStep
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup


def _bf16_step(**overrides) -> StudentStep:
    return build_step(setup.trainer_config(None, compute={"param_dtype": "bfloat16"}, **overrides))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_auto_param_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert resolve_param_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_param_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_param_dtype("float32", torch.device("cuda")) == torch.float32


def test_bf16_compute_copy_is_the_fp32_masters_rounded_after_each_update():
    step = _bf16_step()
    student = step.student
    assert student.master is not None
    assert all(p.dtype == torch.float32 for p in student.module.parameters())
    assert all(p.dtype == torch.bfloat16 for p in student.compute.parameters())
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    for _ in range(2):
        step.run([mb])
    for m, c in zip(student.module.parameters(), student.compute.parameters(), strict=True):
        assert torch.equal(c, m.to(torch.bfloat16))
    # the optimizer steps the fp32 masters, not the compute copy
    stepped = {id(p) for g in student.optimizer.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in student.module.parameters()}


def test_bf16_update_follows_the_fp32_update():
    """One AdamW step from the same weights: the bf16 run's update has cosine >= 0.98 with the
    fp32 run's (bf16 rounds activations and gradients; the direction holds)."""
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    updates = []
    for dtype in ("float32", "bfloat16"):
        step = build_step(setup.trainer_config(None, compute={"param_dtype": dtype}))
        params = step.student.module.parameters
        before = torch.cat([p.detach().flatten().clone() for p in params()])
        step.run([mb])
        after = torch.cat([p.detach().flatten() for p in params()])
        updates.append(after - before)
    assert _cosine(*updates) >= 0.98


def test_micro_batches_accumulate_into_fp32_master_gradients():
    step = _bf16_step()
    student = step.student
    batch = setup.micro_batches()[0]
    mb = setup.micro_batch(batch, ["a"], with_teacher=False)
    counts = step.count_valid([mb, mb])
    device_batch = step.to_device(mb.batch)
    logits = student.forward(device_batch["input_ids"], None)
    loss, _ = step.loss(logits, device_batch, counts, None)
    loss.backward()
    # each bf16 gradient went into its master as autograd made it, and was freed
    assert all(c.grad is None for c in student.compute.parameters())
    grads = [m.grad for m in student.module.parameters() if m.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    first = [g.clone() for g in grads]
    logits = student.forward(device_batch["input_ids"], None)
    loss, _ = step.loss(logits, device_batch, counts, None)
    loss.backward()
    for g, g1 in zip(grads, first, strict=True):
        torch.testing.assert_close(g, 2 * g1, rtol=1e-6, atol=0)


def test_checkpoint_keeps_the_fp32_masters_and_resume_rebuilds_the_compute_copy(tmp_path):
    step = _bf16_step(run_dir=str(tmp_path))
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    for _ in range(3):
        step.run([mb])
    path = checkpoint.save(step.student, tmp_path, epoch=0, task_start=0, trained={"a"})
    resumed_step = _bf16_step(run_dir=str(tmp_path))
    resumed = resumed_step.student
    checkpoint.load(resumed, path)
    assert resumed.step == 3
    for m, r in zip(step.student.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(m, r)  # the fp32 masters, not their bf16 rounding
    for m, c in zip(resumed.module.parameters(), resumed.compute.parameters(), strict=True):
        assert torch.equal(c, m.to(torch.bfloat16))
    # the two go on identically
    a, b = step.run([mb]), resumed_step.run([mb])
    assert a.metrics["loss"] == b.metrics["loss"]


def test_the_fused_update_steps_as_torchs_adamw_then_the_copy_and_keeps_its_state():
    # one step from the same weights and gradients; later steps see bf16 copies that may differ
    # by a rounding, which AdamW's normalised update turns into lr-sized differences
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    runs = []
    for fused in (False, True):
        step = build_step(
            setup.trainer_config(None, compute={"param_dtype": "bfloat16", "fused_update": fused})
        )
        assert step.student.fused_update is fused
        step.run([mb])
        runs.append(step)
    plain, fused = (s.student for s in runs)
    for a, b in zip(plain.module.parameters(), fused.module.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # the optimizer state torch's AdamW keeps (what a checkpoint saves and loads)
    want, got = plain.optimizer.state_dict()["state"], fused.optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for k in want:
        assert float(got[k]["step"]) == float(want[k]["step"]) == 1.0
        torch.testing.assert_close(got[k]["exp_avg"], want[k]["exp_avg"], rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(got[k]["exp_avg_sq"], want[k]["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-12)  # fmt: skip
    runs[1].run([mb])
    for m, c in zip(fused.module.parameters(), fused.compute.parameters(), strict=True):
        assert torch.equal(c, m.to(torch.bfloat16))
    assert all(float(s["step"]) == 2.0 for s in fused.optimizer.state.values())


def test_the_fused_update_needs_masters():
    import pytest

    with pytest.raises(ValueError, match=r"^fused_update: needs bf16 parameters with fp32 masters"):
        build_step(setup.trainer_config(None, compute={"param_dtype": "float32",
                                                       "fused_update": True}))  # fmt: skip


def test_the_fused_update_is_on_by_default_only_where_masters_are_on_a_cuda_device():
    for compute in ({"param_dtype": "bfloat16"}, {"param_dtype": "float32"}, {}):
        step = build_step(setup.trainer_config(None, compute=compute))
        assert step.student.fused_update is False  # a cpu device: torch's AdamW
    assert ComputeConfig().fused_update is None  # None: auto
