"""trainer.compute.deterministic: the process settings it makes (deterministic algorithms, cuDNN,
cuBLAS's workspace, the seeds), the fixed order it needs, and runs of one config that give
bitwise-equal per-step losses and final weights (CPU; the CUDA twin is test_determinism_gpu.py)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from services.collator.worker import samples_to_put_fields
from services.common.config import ConfigError
from services.protocol import put_eof
from services.queue.client import QueueClient
from services.trainer import determinism
from services.trainer.trainer import Trainer, build_step
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from tests.services.trainer.determinism_setup import (
    CUBLAS,
    hex_losses,
    restored_process_settings,
    weight_bits,
)

# single-process DCP (no process group) is what these runs mean
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DETERMINISTIC = {"compute": {"deterministic": True}, "feed": {"micro_batch": 2, "ordered": True}}


@pytest.fixture
def process_settings():
    with restored_process_settings():
        yield


def test_the_switch_sets_deterministic_algorithms_cudnn_and_the_cublas_workspace(
    process_settings, monkeypatch
):
    monkeypatch.delenv(CUBLAS, raising=False)
    torch.backends.cudnn.benchmark = True
    determinism.configure(True, seed=3)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # a missing one raises
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ[CUBLAS] == ":4096:8"


def test_a_deterministic_cublas_workspace_already_set_is_kept_and_another_replaced(
    process_settings, monkeypatch
):
    monkeypatch.setenv(CUBLAS, ":16:8")
    determinism.configure(True, seed=0)
    assert os.environ[CUBLAS] == ":16:8"
    monkeypatch.setenv(CUBLAS, ":0:0")
    determinism.configure(True, seed=0)
    assert os.environ[CUBLAS] == ":4096:8"


def test_the_switch_seeds_torch_numpy_and_random_from_the_run_seed(process_settings):
    def draws(seed: int) -> tuple:
        determinism.configure(True, seed=seed)
        return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_the_switch_off_leaves_the_process_as_it_was(process_settings, monkeypatch):
    monkeypatch.delenv(CUBLAS, raising=False)
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    determinism.configure(False, seed=0)
    assert not torch.are_deterministic_algorithms_enabled()
    assert CUBLAS not in os.environ
    assert torch.equal(torch.rand(2), expected)  # not reseeded


def test_the_trainer_shell_configures_the_process_before_it_picks_the_device(monkeypatch):
    """``serve`` hands the switch and ``student.seed`` to :func:`determinism.configure` first."""
    from services.trainer import main

    calls = []
    device = torch.device
    monkeypatch.setattr(main.determinism, "configure", lambda *a: calls.append(a))
    monkeypatch.setattr(main.torch, "device", lambda *a: calls.append("device") or device(*a))
    monkeypatch.setattr(main, "_train", lambda *a: calls.append("train") or 0)
    config = setup.trainer_config(None, student={"seed": 5}, **DETERMINISTIC)
    assert main.serve(config, lc=None) == 0
    assert calls == [(True, 5), "device", "train"]


def test_deterministic_without_a_fixed_order_is_refused_naming_feed_ordered():
    with pytest.raises(ConfigError, match=r"compute\.deterministic needs feed\.ordered: true"):
        setup.trainer_config(None, compute={"deterministic": True})
    config = setup.trainer_config(None, **DETERMINISTIC)
    assert config.compute.deterministic and config.feed.ordered


def _steps(config, batches, n: int) -> tuple[list[str], dict[str, bytes]]:
    """``n`` optimizer steps over ``batches`` (one micro-batch each) from a freshly configured
    process: the losses (hex) and the final fp32 weights (bytes)."""
    determinism.configure(config.compute.deterministic, config.student.seed)
    step = build_step(config)
    with_teacher = step.loss_fn is not None
    losses = []
    for i in range(n):
        batch = batches[i % len(batches)]
        mb = setup.micro_batch(batch, [f"k{i}a", f"k{i}b"], with_teacher)
        losses.append(step.run([mb]).metrics["loss"])
    return hex_losses(losses), weight_bits(step.student.module)


# gold and xtoken (~7 s each on two cores) run with `pytest -m slow`; pkl stays in the default suite
@pytest.mark.parametrize(
    "mode",
    [
        "pkl",
        pytest.param("gold", marks=pytest.mark.slow),
        pytest.param("xtoken", marks=pytest.mark.slow),
    ],
)
def test_two_deterministic_step_sequences_of_each_kd_mode_are_bitwise_equal(
    process_settings, projection, mode
):
    config = setup.trainer_config(
        projection, loss={"mode": mode, "ce_weight": 0.5}, **DETERMINISTIC
    )
    batches = setup.micro_batches()[:3]
    first, second = _steps(config, batches, 4), _steps(config, batches, 4)
    assert len(first[0]) == 4
    assert first[0] == second[0]
    assert first[1] == second[1]


def test_the_comparison_sees_a_run_of_another_seed(process_settings):
    """The bitwise comparison is not blind: another ``student.seed`` gives other losses and
    weights."""
    batches = setup.micro_batches()[:2]
    runs = [
        _steps(setup.trainer_config(None, student={"seed": seed}, **DETERMINISTIC), batches, 2)
        for seed in (0, 1)
    ]
    assert runs[0][0] != runs[1][0]
    assert runs[0][1] != runs[1][1]


@pytest.fixture
def queue(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("queue"), "--capacity", "64MiB")
    yield server.address
    server.stop()


def _run(address: str, partition: str, run_dir) -> tuple[list[str], dict[str, bytes]]:
    """A deterministic CE run of the trainer over ``partition`` until its data ends: the losses
    of its step records (hex) and its final weights (bytes)."""
    config = setup.trainer_config(
        None,
        queue=address,
        partition=partition,
        run_dir=str(run_dir),
        schedule={"export": False, "max_steps": 0, "checkpoint_every": 0, "eval_every": 0},
        **{**DETERMINISTIC, "feed": {**DETERMINISTIC["feed"], "claim_timeout_s": 0.2}},
    )
    determinism.configure(config.compute.deterministic, config.student.seed)
    with QueueClient(address, timeout_s=10) as client:
        trainer = Trainer(config, client)
        trainer.train()
    records = [json.loads(line) for line in (run_dir / "metrics" / "trainer.rank0.jsonl").open()]
    losses = [r["loss"] for r in records if r["event"] == "step"]
    return hex_losses(losses), weight_bits(trainer.student.module)


def test_two_deterministic_trainer_runs_give_bitwise_equal_step_losses_and_weights(
    process_settings, queue, tmp_path
):
    """The same six samples put in the same order into two partitions; a trainer run of each
    (three steps of two): the step records' losses and the final weights are bitwise equal."""
    samples = setup.samples()[:6]
    keys = [f"s{i}" for i in range(len(samples))]
    with QueueClient(queue, timeout_s=10) as client:
        for partition in ("a", "b"):
            client.put(partition, keys, samples_to_put_fields(samples))
            put_eof(client, partition, len(samples))
    first = _run(queue, "a", tmp_path / "a")
    second = _run(queue, "b", tmp_path / "b")
    assert len(first[0]) == 3
    assert first[0] == second[0]
    assert first[1] == second[1]
