"""LocalLauncher with real processes: start, ready file, stop (the queue last); a process that
dies before it is ready fails the wait with its log tail."""

from __future__ import annotations

import os
import time

import pytest
import torch

from services import protocol as proto
from services.launch.local import LocalLauncher
from services.launch.spec import ProcessSpec
from services.queue.client import QueueClient


def _queue_spec(tmp_path, name: str = "queue") -> ProcessSpec:
    return ProcessSpec(
        name,
        "queue",
        ["queue", "serve", "--bind", "tcp://127.0.0.1:*", "--capacity", "16MiB"],
        log_file=str(tmp_path / "logs" / f"{name}.log"),
        ready_file=str(tmp_path / "ready" / name),
    )


@pytest.fixture
def launcher():
    launcher = LocalLauncher()
    yield launcher
    launcher.stop(grace_s=10)


def test_start_wait_ready_and_stop_a_real_process(launcher, tmp_path):
    proc = launcher.start(_queue_spec(tmp_path))
    with pytest.raises(RuntimeError, match=r"queue was not ready within 0s; log: .*queue\.log"):
        launcher.wait_ready(proc, 0.0)
    info = launcher.wait_ready(proc, 60)
    assert info["pid"] == proc.pid and info["endpoint"].startswith("tcp://127.0.0.1:")
    assert proc.poll() is None
    with pytest.raises(ValueError, match="'queue' is already running"):
        launcher.start(_queue_spec(tmp_path))
    assert launcher.stop([], grace_s=5) == {}  # an empty list stops nothing
    assert proc.poll() is None
    assert launcher.stop(["queue"], grace_s=30) == {"queue": 0}  # SIGTERM: drained, exit 0
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    assert "[queue]" in proc.tail()
    assert not (tmp_path / "ready" / "queue").exists()  # removed when the process exited


def test_a_stop_ends_the_teacher_while_its_queue_is_up_then_the_queue(launcher, tmp_path):
    """The teacher gives the request it holds back to a live queue (no lease runs out), then the
    queue stops: seconds in all, no reply waited for from a queue that is gone."""
    queue = launcher.start(_queue_spec(tmp_path))
    address = launcher.wait_ready(queue, 60)["endpoint"]
    argv = ["teacher", "--queue", address, "--model", "tiny", "--tokenizer", "smollm2",
            "--slots", "2", "--max-batch", "2", "--max-length", "16", "--claim-timeout-s", "5"]  # fmt: skip
    teacher = launcher.start(
        ProcessSpec(
            "teacher0",
            "teacher",
            argv,
            log_file=str(tmp_path / "logs" / "teacher0.log"),
            ready_file=str(tmp_path / "ready" / "teacher0"),
        )
    )
    launcher.wait_ready(teacher, 120)
    part = proto.request_partition("train", 0)
    with QueueClient(address, timeout_s=10) as client:
        for i in range(3):  # no trainer frees a ring slot: two are served, the third waits
            client.put(part, [f"r{i}"], proto.request_fields([torch.arange(5)], rank=0))
        deadline = time.monotonic() + 60
        status: dict = {}
        while (status.get("consumed"), status.get("leased")) != (2, 1):
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
            status = client.status(part, proto.TEACHER_TASK)
    signalled: dict[str, float] = {}
    for proc in (queue, teacher):
        send = proc.signal
        proc.signal = lambda signum, name=proc.spec.name, send=send: (
            signalled.setdefault(name, time.time()),
            send(signum),
        )
    t0 = time.monotonic()
    assert launcher.stop(grace_s=30) == {"queue": 0, "teacher0": 0}
    stop_s = time.monotonic() - t0
    assert teacher.exited_at <= signalled["queue"]  # the queue was told once the teacher ended
    log = teacher.tail(100)
    assert "stopped (SIGTERM), exit code 0" in log
    assert "could not give back" not in log and "went away" not in log, log
    assert stop_s < 10, stop_s


def test_a_process_that_exits_before_ready_raises_with_its_log_tail(launcher, tmp_path):
    spec = ProcessSpec(
        "teacher0",
        "teacher",
        ["teacher", "--slots", "1"],
        log_file=str(tmp_path / "teacher0.log"),
        ready_file=str(tmp_path / "ready" / "teacher0"),
    )
    proc = launcher.start(spec)
    with pytest.raises(RuntimeError) as exc:
        launcher.wait_ready(proc, 60)
    message = str(exc.value)
    assert "teacher0 exited with code 2 before it was ready" in message
    assert "teacher0.log" in message
    assert "[teacher] error: slots=1: the ring needs >= 2 slots" in message
    assert launcher.stop(grace_s=1) == {"teacher0": 2}


def test_a_restarted_spec_runs_again_under_its_name(launcher, tmp_path):
    spec = _queue_spec(tmp_path, "q")
    first = launcher.start(spec)
    launcher.wait_ready(first, 60)
    launcher.stop(["q"], grace_s=30)
    second = launcher.start(spec)
    assert second.pid != first.pid and launcher.processes["q"] is second
    launcher.wait_ready(second, 60)


def test_a_spec_without_a_log_file_or_ready_file_is_refused_with_the_fix(launcher, tmp_path):
    with pytest.raises(ValueError, match="'nolog' has no log_file; set one"):
        launcher.start(ProcessSpec("nolog", "queue", ["queue", "serve"]))
    spec = _queue_spec(tmp_path, "unready")
    spec.ready_file = None
    proc = launcher.start(spec)
    with pytest.raises(ValueError, match="'unready' has no ready_file"):
        launcher.wait_ready(proc, 60)
