"""The driver's health check: a process found hung or frozen is SIGKILLed and reported once, also
while it takes a moment to die; its successor (another pid) is judged on its own beats."""

from __future__ import annotations

import json
import signal
import time
import types
from pathlib import Path

from services.common.heartbeat import HEARTBEAT_ENV
from services.supervise.config import run_config_from_dict
from services.supervise.driver import Driver
from services.supervise.events import Unresponsive


class _Dying:
    """A process that dies only when told to (as a real one takes a moment after a SIGKILL)."""

    def __init__(self, pid: int, heartbeat: Path) -> None:
        self.pid = pid
        self.spec = types.SimpleNamespace(name="trainer0", role="trainer",
                                          env={HEARTBEAT_ENV: str(heartbeat)})  # fmt: skip
        self.signals: list[int] = []
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def signal(self, signum: int) -> None:
        self.signals.append(signum)


def _hung_beat(path: Path, pid: int) -> None:
    now = time.time()
    record = {"pid": pid, "name": "trainer0", "time": now, "progress": 5, "progress_at": now - 9}
    path.write_text(json.dumps(record))


def test_a_hung_process_is_killed_and_reported_once_while_it_dies(tmp_path):
    config = run_config_from_dict({"run_dir": str(tmp_path / "run"), "hang_after_s": 4.0})
    events = []
    launcher = types.SimpleNamespace(processes={})
    driver = Driver(config, launcher=launcher, progress=False, on_event=events.append)
    beat = tmp_path / "trainer0.beat"
    hung = launcher.processes["trainer0"] = _Dying(1001, beat)
    _hung_beat(beat, hung.pid)
    for _ in range(3):  # ticks of the watch loop before the SIGKILL took effect
        driver.check_health()
    assert hung.signals == [signal.SIGKILL]
    assert [(e.process, e.pid) for e in events if isinstance(e, Unresponsive)] == [
        ("trainer0", 1001)
    ]
    assert events[0].reason.endswith("hung")

    hung.code = -signal.SIGKILL  # gone; its successor hangs too: judged and killed on its own
    driver.check_health()
    successor = launcher.processes["trainer0"] = _Dying(1002, beat)
    _hung_beat(beat, successor.pid)
    driver.check_health()
    driver.check_health()
    assert successor.signals == [signal.SIGKILL]
    assert [e.pid for e in events if isinstance(e, Unresponsive)] == [1001, 1002]
