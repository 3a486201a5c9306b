"""A group restart names its first cause: every rank's exit is recorded and the cause is the rank
that died first, by its exit time, not the exit the launcher reported first. Real ranks (stand-ins
that fail as a collective does when a peer is gone) under the local launcher, a real SIGKILL."""

from __future__ import annotations

import signal
import sys
import time
import types
from pathlib import Path

import pytest

from services.launch.local import LocalLauncher
from services.supervise.config import run_config_from_dict
from services.supervise.driver import Driver
from services.supervise.events import Exited, Recovering
from services.supervise.exits import GROUP_EXITS_WAIT_S, error_line
from tests.e2e.conftest import wait_for

# A trainer rank as far as its peers see it: rank 0 listens on MASTER_PORT, rank 1 connects;
# each then blocks on its peer's socket, which returns empty when the peer dies (the kernel closes
# a dead process's sockets), and exits 1, as a rank whose collective failed does.
RANK = """
import os, socket, sys, time
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
if rank == 0:
    server = socket.create_server(("127.0.0.1", port))
    peer, _ = server.accept()
else:
    while True:
        try:
            peer = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.02)
open(sys.argv[1], "w").close()
peer.recv(1)
print(f"rank {rank}: my peer is gone", flush=True)
sys.exit(1)
"""


class _Ranks(LocalLauncher):
    """The local launcher, its processes playing :data:`RANK`."""

    def command(self, spec):
        return [sys.executable, "-c", RANK, spec.ready_file]


def _driver(tmp_path: Path, launcher, events: list) -> Driver:
    config = run_config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "trainers": 2,
            "max_restarts": 2,
            "restart_backoff_s": 60,
        }  # fmt: skip
    )
    driver = Driver(config, launcher=launcher, progress=False, on_event=events.append)
    inputs = {"train": "train.jsonl", "heldout": "heldout.jsonl", "projection": "proj.pt"}
    driver.restore(
        {
            "queue": "tcp://127.0.0.1:1",
            "master_port": _free_port(),
            "segment_started": 0.0,
            "inputs": inputs,
        }  # fmt: skip
    )
    return driver


def _free_port() -> int:
    from services.supervise.driver import free_port

    return free_port()


@pytest.fixture
def ranks():
    launcher = _Ranks()
    yield launcher
    launcher.stop(grace_s=5)


@pytest.mark.parametrize("victim", ["trainer1", "trainer0"])
def test_a_sigkilled_rank_is_the_cause_of_the_group_restart_though_its_peer_exited_too(
    tmp_path, ranks, victim
):
    events: list = []
    driver = _driver(tmp_path, ranks, events)
    procs = {n: driver._start(driver.specs[n]) for n in ("trainer0", "trainer1")}
    wait_for(lambda: all(Path(p.spec.ready_file).exists() for p in procs.values()), 60,
             "both ranks connected")  # fmt: skip
    peer = "trainer0" if victim == "trainer1" else "trainer1"
    procs[victim].signal(signal.SIGKILL)
    # both are gone before the driver looks: it sees trainer0's exit first, whichever died first
    wait_for(lambda: all(p.popen.poll() is not None for p in procs.values()), 30, "both exits")
    assert driver.poll_once() == "recovering"
    exited = {e.process: e.code for e in events if isinstance(e, Exited)}
    assert exited == {victim: -9, peer: 1}  # every rank's exit is recorded
    (recovering,) = [e for e in events if isinstance(e, Recovering)]
    assert (recovering.process, recovering.code, recovering.scope) == (victim, -9, "group")
    assert recovering.reason.startswith(f"{victim} exited with code -9")
    assert f"{peer} exited with code 1" in recovering.reason  # named as what followed
    assert procs[victim].exited_at <= procs[peer].exited_at


class _Exit:
    """A process whose exit its launcher reports from poll ``seen_at`` of the driver on, with the
    time it happened."""

    def __init__(self, clock: list[int], name: str, code: int, at: float, seen_at: int) -> None:
        self.spec = types.SimpleNamespace(name=name, role="trainer", env={}, log_file="",
                                          ready_file=None)  # fmt: skip
        self.pid = 0
        self.clock, self.code, self.exited_at, self.seen_at = clock, code, at, seen_at

    def poll(self) -> int | None:
        return self.code if self.clock[0] >= self.seen_at else None

    def signal(self, signum: int) -> None:
        pass

    def tail(self, lines: int = 20) -> str:
        return ""


class _Reported:
    """A launcher whose processes report their exits late (as Ray actors may)."""

    def __init__(self, clock: list[int], *exits: tuple[str, int, float, int]) -> None:
        self.processes = {e[0]: _Exit(clock, *e) for e in exits}

    def start(self, spec):
        raise AssertionError("no start expected")

    def stop(self, names=None, grace_s=0.0):
        return {}


def test_a_cause_reported_after_its_consequence_is_still_the_cause(tmp_path):
    now, polls = time.time(), [0]
    # trainer0's exit 1 (0.4 s after) is reported at once, trainer1's SIGKILL at the next poll
    launcher = _Reported(polls, ("trainer0", 1, now + 0.4, 0), ("trainer1", -9, now, 1))
    events: list = []
    driver = _driver(tmp_path, launcher, events)
    assert driver.poll_once() == "recovering"  # waits for the other ranks' exits
    assert not [e for e in events if isinstance(e, Recovering)]
    polls[0] += 1
    assert driver.poll_once() == "recovering"
    (recovering,) = [e for e in events if isinstance(e, Recovering)]
    assert (recovering.process, recovering.code) == ("trainer1", -9)
    assert [e.process for e in events if isinstance(e, Exited)] == ["trainer0", "trainer1"]


def test_a_rank_that_does_not_exit_delays_the_decision_only_briefly(tmp_path):
    polls = [0]
    launcher = _Reported(polls, ("trainer0", 1, time.time(), 0), ("trainer1", -9, 0.0, 99))
    events: list = []
    driver = _driver(tmp_path, launcher, events)
    assert driver.group_exits.wait_s == GROUP_EXITS_WAIT_S > 0
    assert driver.poll_once() == "recovering"
    assert not [e for e in events if isinstance(e, Recovering)]
    driver.group_exits.wait_s = 0.0  # the wait is over; trainer1 still hangs in its collective
    polls[0] += 1
    assert driver.poll_once() == "recovering"
    (recovering,) = [e for e in events if isinstance(e, Recovering)]
    assert (recovering.process, recovering.code) == ("trainer0", 1)


def test_the_one_line_error_of_a_process_is_its_last_error_line():
    tail = (
        "2026-01-01 10:00:00,000 INFO [collator] reading data.jsonl\n"
        "2026-01-01 10:00:01,000 ERROR [collator] error: data.jsonl:7 is not JSON: fix it\n"
        "2026-01-01 10:00:01,001 INFO [collator] stopped\n"
    )
    assert error_line(tail) == "data.jsonl:7 is not JSON: fix it"
    assert error_line("Traceback (most recent call last):\n  boom") is None
