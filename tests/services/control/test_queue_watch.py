"""The supervisor's watch on shared queues: a real `xtoken queue serve` on a fixed loopback address,
SIGKILLed and started again there (a new instance, a new epoch). Without --data-dir the runs on it
lost their samples: each records the restart and recovers (RECOVERING, every process started again
on the new instance, one restart of the run's budget); a durable queue's restart is only recorded;
a queue that stays unreachable past the run's hang_after_s fails the run, naming the queue. The
run's processes are the stand-ins of test_supervisor (each case takes seconds)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.control.queue_watch import QueueWatch
from tests.e2e.conftest import free_port
from tests.services.control.conftest import tiny_config
from tests.services.control.test_supervisor import wait_state
from tests.services.queue.conftest import ServerProcess


class RestartableQueue:
    """`xtoken queue serve` on one fixed address, killed and started again there."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.tmp_path = tmp_path
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.args = ("--bind", self.address, "--capacity", "64MiB", *args)
        self.servers = [ServerProcess(tmp_path, *self.args)]

    def kill(self) -> None:
        proc = self.servers[-1].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def start(self) -> None:
        self.servers.append(ServerProcess(self.tmp_path, *self.args))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def shared_queue(tmp_path):
    queues: list[RestartableQueue] = []

    def _make(*args: str) -> RestartableQueue:
        queues.append(RestartableQueue(tmp_path, *args))
        return queues[-1]

    yield _make
    for q in queues:
        q.stop()


def _pids(sup, run_id):
    return {p["name"]: p["pid"] for p in sup.processes(run_id)}


def _events(sup, run_id, kind):
    return [e["data"] for e in sup.events(run_id) if e["kind"] == kind]


def _wait_until(ready, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        time.sleep(0.05)
    return None


def _wait_event(sup, run_id, kind, timeout_s=20.0):
    found = _wait_until(lambda: _events(sup, run_id, kind), timeout_s)
    if not found:
        raise AssertionError(f"no {kind} event: {sup.events(run_id)}")
    return found


def test_a_restarted_shared_queue_without_data_recovers_each_run_on_it(make, shared_queue):
    queue = shared_queue()
    sup = make({}, queue_stats_s=0.2)
    rid = sup.submit(tiny_config(**{"queue.address": queue.address}))["id"]
    wait_state(sup, rid, {"RUNNING"})
    (launched,) = _events(sup, rid, "launched")
    before = _pids(sup, rid)
    assert "queue" not in before and before["collator"]

    queue.kill()  # its samples lived in its memory only
    queue.start()
    (event,) = _wait_event(sup, rid, "queue_restarted")
    assert event["address"] == queue.address and event["durable"] is False
    assert event["old_epoch"] != event["new_epoch"]
    cause = f"queue restarted: epoch {event['old_epoch']} -> {event['new_epoch']}"
    # the event is journaled just before the run turns RECOVERING: wait for that turn, then for
    # the recovery (a RUNNING seen in between is the state before it)
    _wait_until(lambda: any(s["state"] == "RECOVERING" for s in _events(sup, rid, "state")))
    wait_state(sup, rid, {"RUNNING"})  # after the recovery
    states = [e["data"] for e in sup.events(rid) if e["kind"] == "state"]
    recovering = [s for s in states if s["state"] == "RECOVERING"]
    assert len(recovering) == 1 and recovering[0]["reason"].startswith(cause), states
    assert recovering[0]["attempt"] == 1
    assert [s["state"] for s in states][-2:] == ["RECOVERING", "RUNNING"]
    assert _events(sup, rid, "restarted")[-1]["scope"] == "run"

    after = _pids(sup, rid)
    assert after["collator"] != before["collator"]  # it puts the corpus on the new instance
    assert after["trainer0"] != before["trainer0"]  # from its latest checkpoint
    launcher = sup.launchers[-1]
    assert launcher.starts["collator"] == launcher.starts["trainer0"] == 2
    assert "queue" not in launcher.starts
    restarts = {p["name"]: p["restarts"] for p in sup.processes(rid)}
    assert restarts["collator"] == restarts["trainer0"] == 1  # the run's budget
    assert sup.get(rid)["reason"] is None
    assert sup.store.get_run(rid)["runtime"]["queue_epoch"] == event["new_epoch"]


def test_a_restarted_durable_queue_is_recorded_and_the_run_goes_on(make, shared_queue, tmp_path):
    queue = shared_queue("--data-dir", str(tmp_path / "queue-data"))
    sup = make({}, queue_stats_s=0.2)
    rid = sup.submit(tiny_config(**{"queue.address": queue.address}))["id"]
    wait_state(sup, rid, {"RUNNING"})
    before = _pids(sup, rid)

    queue.kill()
    queue.start()
    (event,) = _wait_event(sup, rid, "queue_restarted")
    assert event["durable"] is True and "kept its samples" in event["action"]
    assert sup.get(rid)["state"] == "RUNNING" and _pids(sup, rid) == before
    assert "RECOVERING" not in [s["state"] for s in _events(sup, rid, "state")]
    assert sup.launchers[-1].starts["collator"] == 1


def test_a_shared_queue_unreachable_past_hang_after_s_fails_the_run_naming_it(make, shared_queue):
    queue = shared_queue()
    sup = make({}, queue_stats_s=0.2)
    config = tiny_config(
        **{"queue.address": queue.address, "heartbeat_s": 0.2, "hang_after_s": 1.5}
    )
    rid = sup.submit(config)["id"]
    wait_state(sup, rid, {"RUNNING"})

    queue.kill()
    run = wait_state(sup, rid, {"FAILED"}, timeout_s=20)
    assert run["failed_process"] == "queue"
    assert f"queue {queue.address} unreachable for " in run["reason"]
    assert "hang_after_s=1.5" in run["reason"], run["reason"]
    (event,) = _events(sup, rid, "queue_unreachable")
    assert event["address"] == queue.address and event["down_s"] > 1.5
    assert all(p["state"] != "running" for p in sup.processes(rid))


def test_the_watch_keeps_each_runs_instance_and_the_outage_of_its_address():
    w = QueueWatch("tcp://q", now=100.0)
    w.answered({"epoch": "a", "durable": False}, now=101.0)
    assert w.change("r1", None) is None  # a first look: the run's baseline
    assert w.baseline("r1") == "a" and w.down_s(now=150.0) == 0.0
    w.failed("timeout", now=102.0)
    w.failed("timeout", now=104.0)
    assert w.down_s(now=105.0) == 4.0  # since its last answer
    w.answered({"epoch": "b"}, now=106.0)
    assert w.down_s(now=106.5) == 0.0
    assert w.change("r1", None) == ("a", "b")
    assert w.change("r1", None) is None  # told once
    assert w.durable is None  # the hello did not say: not durable
    assert w.change("r2", "z") == ("z", "b")  # a baseline restored from the run's record
    w.forget("r1")
    assert w.change("r1", None) is None and w.baseline("r1") == "b"
