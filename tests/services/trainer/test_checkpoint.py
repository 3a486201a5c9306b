"""Trainer checkpoints: a save loaded into a fresh student restores everything a resume needs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.trainer import checkpoint
from services.trainer.step import StudentStep
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup

# single-process DCP (no process group) is what these tests mean
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _step(seed: int = 0) -> StudentStep:
    return build_step(
        setup.trainer_config(
            None, student={"seed": seed}, optim={"warmup_steps": 2}, schedule={"max_steps": 10}
        )
    )


def _train(step: StudentStep, steps: int) -> None:
    mb = setup.micro_batch(setup.micro_batches()[0], ["a", "b"], with_teacher=False)
    for _ in range(steps):
        step.run([mb])


def _optim_state(student) -> list[dict[str, torch.Tensor]]:
    """Optimizer state in parameter order (ids differ between students)."""
    return [student.optimizer.state[p] for p in student.module.parameters()]


def test_save_then_load_restores_weights_optimizer_step_schedule_rng_and_trained_keys(tmp_path):
    step = _step()
    _train(step, 3)
    saved = step.student
    before = {"bits_per_byte": 4.5}
    path = checkpoint.save(
        saved, tmp_path, epoch=1, task_start=2, trained={"k1", "k2"}, skipped_steps=1,
        before=before,
    )  # fmt: skip
    rng = torch.get_rng_state()
    assert checkpoint.latest_checkpoint(tmp_path) == path
    # another rank of the same checkpoint trained other keys of the same epoch
    meta = json.loads((path / "rank0.json").read_text())
    (path / "rank1.json").write_text(json.dumps({**meta, "trained": ["k3"]}))
    torch.rand(100)  # move the RNG on

    fresh_step = _step(seed=7)
    fresh = fresh_step.student
    assert not torch.equal(
        fresh.module.model.embed_tokens.weight, saved.module.model.embed_tokens.weight
    )
    state = checkpoint.load(fresh, path)

    assert state == {
        "step": 3,
        "epoch": 1,
        "task_start": 2,
        "trained": {"k1", "k2", "k3"},
        "skipped_steps": 1,
        "student_before": before,
    }
    assert fresh.step == 3
    for (name, a), b in zip(saved.module.named_parameters(), fresh.module.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(_optim_state(saved), _optim_state(fresh)):
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    assert fresh.scheduler.state_dict()["last_epoch"] == 3
    assert fresh.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [
        g["lr"] for g in saved.optimizer.param_groups
    ]
    assert torch.equal(torch.get_rng_state(), rng)

    # and the two go on identically
    _train(step, 1)
    _train(fresh_step, 1)
    for (name, a), b in zip(saved.module.named_parameters(), fresh.module.parameters()):
        assert torch.equal(a, b), name


def test_keys_of_another_epoch_are_not_part_of_what_was_trained(tmp_path):
    student = _step().student
    path = checkpoint.save(student, tmp_path, epoch=2, task_start=0, trained={"new"})
    meta = json.loads((path / "rank0.json").read_text())
    (path / "rank1.json").write_text(json.dumps({**meta, "epoch": 1, "trained": ["old"]}))
    assert checkpoint.load(_step().student, path)["trained"] == {"new"}


def test_a_rank_without_its_own_file_resumes_from_another_ranks(tmp_path):
    step = _step()
    _train(step, 2)
    path = checkpoint.save(step.student, tmp_path, epoch=0, task_start=0, trained={"a"})
    (path / "rank0.json").rename(path / "rank1.json")  # as if written by rank 1 of a larger world
    fresh = _step(seed=5).student
    assert checkpoint.load(fresh, path) == {
        "step": 2,
        "epoch": 0,
        "task_start": 0,
        "trained": {"a"},
        "skipped_steps": 0,
        "student_before": None,
    }
    assert fresh.scheduler.state_dict()["last_epoch"] == 2


def test_a_checkpoint_without_rank_files_is_refused_naming_it(tmp_path):
    student = _step().student
    path = checkpoint.save(student, tmp_path, epoch=0, task_start=0, trained=set())
    for f in path.glob("rank*.json"):
        f.unlink()
    with pytest.raises(ValueError, match=rf"{path}.*no rank\*\.json.*incomplete"):
        checkpoint.load(_step().student, path)


def test_latest_names_the_newest_and_only_two_are_kept(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    student = _step().student
    for step in (2, 4, 6):
        student.step = step
        checkpoint.save(student, tmp_path, epoch=0, task_start=0, trained=set())
    root = checkpoint.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert checkpoint.latest_checkpoint(tmp_path) == root / "step_00000006"
    shutil.rmtree(root / "step_00000006")  # "latest" naming a deleted checkpoint: none
    assert checkpoint.latest_checkpoint(tmp_path) is None
