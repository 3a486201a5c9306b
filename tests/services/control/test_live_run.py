"""What the control plane follows of a live run's processes: the metrics file of each trainer
rank, each group of every teacher and each rollout worker, and whether its memory is a GPU's."""

from __future__ import annotations

from services.control.live_run import metrics_files
from services.supervise.config import run_config_from_dict
from tests.services.control.conftest import tiny_config


def test_every_teachers_groups_are_followed_each_with_its_own_device():
    further = {"tokenizer": "qwen3", "model": "tiny", "groups": 1, "device": "cuda:1"}
    config = run_config_from_dict(
        tiny_config(
            trainers=2,
            teachers=2,
            extra_teachers=[further],
            **{"trainer.compute.device": "cuda"},
        )
    )
    assert metrics_files(config) == [
        (("trainer", 0, 0), "trainer.rank0.jsonl", True),
        (("trainer", 0, 1), "trainer.rank1.jsonl", True),
        (("teacher", 0, 0), "teacher.group0.jsonl", False),
        (("teacher", 0, 1), "teacher.group1.jsonl", False),
        (("teacher", 1, 0), "t1.teacher.group0.jsonl", True),
    ]


def test_a_run_without_a_teacher_follows_its_trainer_ranks_only():
    config = run_config_from_dict(tiny_config(**{"trainer.loss.mode": "ce"}))
    assert metrics_files(config) == [(("trainer", 0, 0), "trainer.rank0.jsonl", False)]
