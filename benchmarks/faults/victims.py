"""How the fault campaign finds a run's victim by its role, kills it at its moment, and cleans up
after a run: the run's files (heartbeat, keys log, checkpoints, the queue's count) and /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from services.common.heartbeat import HEARTBEAT_ENV
from services.common.metrics import read_jsonl

POLL_S = 0.05
STOP = threading.Event()  # Ctrl-C: every run in flight stops


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def role_pid(run_dir: Path, name: str) -> int | None:
    """The live pid of the run's process ``name``: the pid in its heartbeat file, if that
    process lives and was given that heartbeat file (not a recycled pid)."""
    path = run_dir / "heartbeat" / name
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None
    if not _alive(pid) or _environ(pid).get(HEARTBEAT_ENV) != str(path):
        return None
    return pid


def run_pids(run_dir: Path) -> list[int]:
    """Every live process started for the run (its heartbeat file is under ``run_dir``),
    their own workers included (they inherit the environment)."""
    prefix = str(run_dir / "heartbeat") + os.sep
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if _environ(pid).get(HEARTBEAT_ENV, "").startswith(prefix) and _alive(pid):
                out.append(pid)
    return out


def reap(run_dir: Path, pids_seen: set[int], grace_s: float = 5.0) -> int:
    """After a run: wait ``grace_s`` for its processes to end, SIGKILL those left and remove
    the shared-memory segments of its dead processes (a SIGKILLed teacher's ring).

    Returns:
        How many processes were left.
    """
    deadline = time.monotonic() + grace_s
    left = run_pids(run_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = run_pids(run_dir)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids_seen | set(left):
        for segment in Path("/dev/shm").glob(f"xtk_{pid}_*"):
            segment.unlink(missing_ok=True)
    return len(left)


def end_process(popen: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            popen.kill()
    return popen.wait()


# ----------------------------------------------------------------------------- the kill


class Watch:
    """What a run's files say while it runs: steps logged, the latest checkpoint, its pids."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.pids_seen: set[int] = set()
        self._queue: Any = None

    def steps(self) -> int:
        """Steps rank 0 logged (every launch)."""
        path = self.run_dir / "keys" / "trainer.rank0.jsonl"
        return sum(r.get("event") == "trained" for r in read_jsonl(path))

    def checkpoint(self) -> int | None:
        """The step of the latest checkpoint, or None before the first."""
        try:
            return int((self.run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def samples(self) -> int:
        """Samples the collator put so far (the queue's count, those retention dropped too)."""
        from services.queue.client import QueueClient
        from services.queue.errors import QueueError

        try:
            context = json.loads((self.run_dir / "config" / "context.json").read_text())
            if self._queue is None:
                self._queue = QueueClient(context["queue"], timeout_s=2, name="fault-campaign")
            status = self._queue.status(context["partition"], "fault-campaign")
        except (FileNotFoundError, json.JSONDecodeError, KeyError, QueueError):
            return 0
        return int(status.get("samples", 0)) + int(status.get("dropped", 0))

    def note_pids(self) -> None:
        """Remember the pids in the run's heartbeat files (to clean up after them)."""
        for path in (self.run_dir / "heartbeat").glob("*"):
            try:
                self.pids_seen.add(int(json.loads(path.read_text())["pid"]))
            except (OSError, KeyError, ValueError, TypeError):
                pass

    def close(self) -> None:
        """Close the queue client."""
        if self._queue is not None:
            self._queue.close()


def strike(plan: Any, watch: Watch, victim_pid, ended, deadline: float,
           before_kill=None) -> dict[str, Any]:  # fmt: skip
    """Wait for the plan's moment, then SIGKILL the victim.

    Args:
        plan: the run's plan.
        watch: the run's files.
        victim_pid: ``() -> pid or None``: the victim's live pid now.
        ended: ``() -> bool``: the run is over (the kill missed).
        deadline: ``time.monotonic()`` past which the kill is given up.
        before_kill: called just before the signal (a snapshot of what the kill changes).

    Returns:
        ``landed`` (the victim was alive and got the signal), ``pid``, ``at_step`` (steps rank
        0 had logged), ``checkpoint`` (the latest checkpoint's step), ``kill_s`` (when).
    """
    start = time.monotonic()
    out: dict[str, Any] = {"landed": False, "pid": None}
    while not STOP.is_set() and time.monotonic() < deadline:
        watch.note_pids()
        if ended():
            return out
        reached = (watch.steps() if plan.unit == "step" else watch.samples()) >= plan.at
        if reached and victim_pid() is not None:
            break
        time.sleep(POLL_S)
    else:
        return out
    time.sleep(plan.delay_s)
    pid = victim_pid()
    out.update(at_step=watch.steps(), checkpoint=watch.checkpoint(),
               kill_s=round(time.monotonic() - start, 2))  # fmt: skip
    if pid is None or ended():
        return out
    if before_kill is not None:
        before_kill()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return out
    out.update(landed=True, pid=pid)
    return out
