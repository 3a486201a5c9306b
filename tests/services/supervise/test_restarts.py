"""The run engine's restarts with stand-in processes (the control tests' ScriptedLauncher): a restart of the
whole run cancels every restart queued before it, so each process starts exactly once on the
relaunch, whether the run-wide restart follows the exit of the run's own queue (``xtoken run``) or
the loss of a shared queue's samples (:meth:`Driver.restart_all`, called by the control plane)."""

from __future__ import annotations

import signal
import time

import pytest

from services.supervise.config import run_config_from_dict
from services.supervise.driver import Driver
from services.supervise.preflight import Inputs
from tests.services.control.conftest import ScriptedLauncher, tiny_config


@pytest.fixture
def make_run(tmp_path):
    """make_run(**overrides) -> (a launched Driver of tiny_config, its ScriptedLauncher); every
    process it started is killed after the test."""
    launchers: list[ScriptedLauncher] = []

    def _make(**overrides):
        config = run_config_from_dict(tiny_config(run_dir=str(tmp_path / "run"), **overrides))
        launchers.append(ScriptedLauncher({}))
        # stand-in inputs: the scripted processes read no file
        inputs = Inputs("train.jsonl", "heldout.txt", "projection.pt")
        run = Driver(config, launcher=launchers[-1], progress=False, run_id="t", inputs=inputs)
        run.events = []
        run.on_event = lambda event: run.events.append((event.kind, event.data()))
        run.launch()
        return run, launchers[-1]

    yield _make
    for launcher in launchers:
        for proc in launcher.processes.values():
            proc.signal(signal.SIGKILL)


def _kill(run, name):
    proc = run.launcher.processes[name]
    proc.signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"{name} did not die"
        time.sleep(0.01)


def _poll_until_running(run, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = run.poll_once()
        assert status in ("running", "recovering"), (status, run.failure)
        if status == "running":
            return
        time.sleep(0.02)
    raise AssertionError(f"still recovering after {timeout_s}s: {run.events}")


def _queue_a_teacher_restart(run):
    _kill(run, "teacher0")
    assert run.poll_once() == "recovering"
    assert run.restart_queued("process") and not run.restart_queued("run")


def test_a_run_restart_after_a_queue_exit_cancels_a_queued_process_restart(make_run):
    run, launcher = make_run(restart_backoff_s=0.5)
    names = set(run.specs)
    assert launcher.starts == dict.fromkeys(names, 1)
    _queue_a_teacher_restart(run)
    _kill(run, "queue")  # its samples are gone: the whole run restarts
    assert run.poll_once() == "recovering"
    assert run.restart_queued("run") and not run.restart_queued("process")
    _poll_until_running(run)
    time.sleep(0.7)  # past the teacher's cancelled backoff: nothing starts it again
    assert run.poll_once() == "running"
    assert launcher.starts == dict.fromkeys(names, 2)  # each started once on the relaunch
    assert all(p.poll() is None for p in launcher.processes.values())
    restarted = [d for k, d in run.events if k == "restarted"]
    assert [(d["process"], d["scope"]) for d in restarted] == [("queue", "run")]


def test_restart_all_cancels_queued_restarts_and_spends_one_run_restart(make_run):
    run, launcher = make_run(restart_backoff_s=0.5)
    names = set(run.specs)
    _queue_a_teacher_restart(run)
    assert run.restart_all("queue restarted: epoch a -> b") == "recovering"
    assert run.policy.restarts() == {"teacher0": 1, "run": 1}
    assert not run.restart_queued("process")
    _poll_until_running(run)
    time.sleep(0.7)
    assert run.poll_once() == "running"
    assert launcher.starts == dict.fromkeys(names, 2)
    recovering = [d for k, d in run.events if k == "recovering"]
    assert recovering[-1]["scope"] == "run"
    assert recovering[-1]["reason"].startswith("queue restarted: epoch a -> b: restart 1 of 2")


def test_restart_all_fails_the_run_once_its_budget_is_spent(make_run):
    run, launcher = make_run(restart_backoff_s=0.1, max_restarts=1)
    assert run.restart_all("queue restarted: epoch a -> b") == "recovering"
    _poll_until_running(run)
    assert run.restart_all("queue restarted: epoch b -> c") == "failed"
    assert run.failed_process == "queue" and run.exit_code is None
    assert "restart budget of run spent (1 of 1)" in run.failure
    assert run.events[-1][0] == "failed"
    assert not run.restart_queued()
    assert launcher.starts == dict.fromkeys(run.specs, 2)  # the failed one stopped nothing new


def test_a_restarts_events_name_the_exit_code_and_the_attempt_of_its_budget(make_run):
    run, _ = make_run(restart_backoff_s=0.05)
    _kill(run, "trainer0")  # SIGKILL: the launcher reports -9
    assert run.poll_once() == "recovering"
    _poll_until_running(run)
    (recovering,) = [d for k, d in run.events if k == "recovering"]
    (restarted,) = [d for k, d in run.events if k == "restarted"]
    for data in (recovering, restarted):
        assert (data["process"], data["scope"], data["code"]) == ("trainer0", "group", -9)
        assert (data["attempt"], data["max_restarts"]) == (1, 2)
    run.restart_all("queue restarted: epoch a -> b")  # nothing exited: no code
    _poll_until_running(run)
    lost = [d for k, d in run.events if k == "restarted"][-1]
    assert (lost["process"], lost["code"], lost["attempt"], lost["max_restarts"]) == (
        "queue",
        None,
        1,
        2,
    )


def test_a_dead_rank_of_a_tensor_parallel_teacher_restarts_its_whole_group_on_a_fresh_port(
    make_run,
):
    run, launcher = make_run(**{"teacher.tensor_parallel": 2})
    group = ["teacher0", "teacher0.1"]
    assert [run.specs[n].unit for n in group] == ["teacher0", "teacher0"]
    first = {n: launcher.envs[n][0]["MASTER_PORT"] for n in group}
    assert len(set(first.values())) == 1  # one rendezvous
    _kill(run, "teacher0.1")
    assert run.poll_once() == "recovering"
    assert run.restart_queued("process")
    _poll_until_running(run)
    assert {n: launcher.starts[n] for n in group} == dict.fromkeys(group, 2)
    assert launcher.starts["trainer0"] == 1  # the trainers go on
    again = {launcher.envs[n][1]["MASTER_PORT"] for n in group}
    assert len(again) == 1 and again != set(first.values())
    assert run.policy.restarts() == {"teacher0.1": 1}


def test_a_dead_rank_of_a_further_teacher_restarts_its_own_group_alone(make_run):
    run, launcher = make_run(
        extra_teachers=[
            {"tokenizer": "qwen3", "model": "tiny", "tensor_parallel": 2, "projection": "p1.pt"}
        ]
    )
    group = ["t1.teacher0", "t1.teacher0.1"]
    assert [run.specs[n].unit for n in group] == ["t1.teacher0", "t1.teacher0"]
    assert run.specs["teacher0"].unit is None  # teacher 0 is one process of its own
    _kill(run, "t1.teacher0.1")
    assert run.poll_once() == "recovering"
    _poll_until_running(run)
    assert {n: launcher.starts[n] for n in group} == dict.fromkeys(group, 2)
    assert launcher.starts["teacher0"] == 1 and launcher.starts["trainer0"] == 1
    assert run.policy.restarts() == {"t1.teacher0.1": 1}
    _kill(run, "teacher0")  # teacher 0 restarts in place; teacher 1's group goes on
    assert run.poll_once() == "recovering"
    _poll_until_running(run)
    assert launcher.starts["teacher0"] == 2 and launcher.starts["t1.teacher0"] == 2
