"""Heartbeats of a process: a file a daemon thread rewrites every ``interval_s`` with the main
loop's progress, and the verdict a supervisor draws from it (alive, frozen or hung).

The writer side runs inside every service process through the lifecycle (env
``XTOKEN_HEARTBEAT_FILE``, set by ``xtoken run`` and the control plane per process). The record::

    {"pid": 123, "name": "trainer0", "time": <wall time of this beat>,
     "progress": <main-loop iterations so far>, "progress_at": <wall time of the last one> | null}

Two different failures show in it:

* **frozen** (SIGSTOP, the whole process stuck, the host gone): no beat for ``dead_after_s``
  (``now - time``): the thread that writes the file does not run either;
* **hung** (a deadlock, a collective waiting forever, a call that never returns): the beats go on
  but the main loop made no progress for ``hang_after_s`` (``time - progress_at``, both from the
  process's own clock). A process arms this check with its first :meth:`Heartbeat.progress`
  (after loading models and the first evaluation) and disarms it with :meth:`Heartbeat.pause`
  for a phase of unknown length (a checkpoint, an evaluation, the export): a process that never
  reports progress (the queue server) is only checked for beats. A main loop that waits on a
  peer in rounds that each return (a trainer polling the queue for its teacher's results, which
  may take a teacher's whole start-up) calls :meth:`Heartbeat.waiting` each round: it is alive,
  though no iteration completes, and a round that never returns is still caught.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "HANG_ENV",
    "HEARTBEAT_ENV",
    "HEARTBEAT_S_ENV",
    "Heartbeat",
    "read_heartbeat",
    "verdict",
]

logger = logging.getLogger(__name__)

# Where the process writes its heartbeat (unset: no heartbeat file).
HEARTBEAT_ENV = "XTOKEN_HEARTBEAT_FILE"
# Seconds between two beats (default DEFAULT_INTERVAL_S).
HEARTBEAT_S_ENV = "XTOKEN_HEARTBEAT_S"
# Test-only fault: ``<name>:<n>:<marker file>``: the process named ``name`` blocks its main loop
# forever at its n-th progress call, once (it creates the marker; a restart finds it and goes on).
HANG_ENV = "XTOKEN_TEST_HANG"
DEFAULT_INTERVAL_S = 1.0


class Heartbeat:
    """The writer: a daemon thread rewrites ``path`` atomically every ``interval_s``.

    Args:
        name: the process's component name (in the record).
        path: the heartbeat file.
        interval_s: seconds between two beats.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, name: str, path: str | os.PathLike, interval_s: float = DEFAULT_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval {interval_s!r}: must be > 0 ({HEARTBEAT_S_ENV})")
        self.name = name
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.count = 0
        self.progress_at: float | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._hang = _parse_hang(name)

    @classmethod
    def from_env(cls, name: str) -> Heartbeat | None:
        """The heartbeat the environment asks for (``XTOKEN_HEARTBEAT_FILE``), or None.

        Raises:
            ValueError: a malformed ``XTOKEN_HEARTBEAT_S``.
        """
        path = os.environ.get(HEARTBEAT_ENV, "").strip()
        if not path:
            return None
        raw = os.environ.get(HEARTBEAT_S_ENV, "").strip()
        try:
            interval = float(raw) if raw else DEFAULT_INTERVAL_S
        except ValueError:
            raise ValueError(f"{HEARTBEAT_S_ENV}={raw!r} is not a number of seconds") from None
        return cls(name, path, interval)

    def start(self) -> Heartbeat:
        """Write the first beat and start the thread; returns self."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread = threading.Thread(
            target=self._loop, name=f"{self.name}-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def progress(self) -> None:
        """The main loop made progress (one iteration); cheap: two attribute writes."""
        self.count += 1
        self.progress_at = time.time()
        if self._hang is not None and self.count >= self._hang[0]:
            self._hang_once()

    def waiting(self) -> None:
        """The main loop waits on a peer in rounds that each return (a poll with a timeout):
        an armed hang check counts this round as progress, the iteration count stays; cheap."""
        if self.progress_at is not None:
            self.progress_at = time.time()

    def pause(self) -> None:
        """Disarm the hang check until the next :meth:`progress` (a phase of unknown length)."""
        self.progress_at = None

    def close(self) -> None:
        """Stop the thread and remove the file (only if it is still ours)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)
        try:
            record = read_heartbeat(self.path)
            if record is not None and record.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("[%s] could not remove heartbeat file %s: %s", self.name, self.path, e)

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self._beat()
            except OSError as e:  # a full disk must not kill the process; the supervisor sees
                logger.warning("[%s] heartbeat not written: %s", self.name, e)

    def _beat(self) -> None:
        record = {
            "pid": os.getpid(),
            "name": self.name,
            "time": time.time(),
            "progress": self.count,
            "progress_at": self.progress_at,
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self.path)

    def _hang_once(self) -> None:
        assert self._hang is not None
        marker = Path(self._hang[1])
        self._hang = None
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        logger.warning("[%s] %s: the main loop hangs now (test fault)", self.name, HANG_ENV)
        threading.Event().wait()  # forever; the heartbeat thread goes on beating


def _parse_hang(name: str) -> tuple[int, str] | None:
    raw = os.environ.get(HANG_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        raise ValueError(f"{HANG_ENV}={raw!r}: expected <name>:<n>:<marker file>")
    return (max(1, int(parts[1])), parts[2]) if parts[0] == name else None


def read_heartbeat(path: str | os.PathLike) -> dict[str, Any] | None:
    """The last beat written to ``path``, or None (no file yet, or not a heartbeat record)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("time"), int | float):
        return None
    return data


def verdict(
    record: dict[str, Any], *, now: float, dead_after_s: float, hang_after_s: float | None
) -> str | None:
    """Why the process that wrote ``record`` counts as dead, or None while it is healthy.

    Args:
        record: a heartbeat record (:func:`read_heartbeat`).
        now: the reader's wall time.
        dead_after_s: no beat this long: frozen.
        hang_after_s: beats but no main-loop progress this long (after the first): hung;
            None: not checked.

    Returns:
        One line naming the failure and the setting that decides it, or None.
    """
    silent = now - float(record["time"])
    if silent > dead_after_s:
        return f"no heartbeat for {silent:.1f}s (dead_after_s={dead_after_s:g}): frozen"
    at = record.get("progress_at")
    if hang_after_s is not None and isinstance(at, int | float):
        stalled = float(record["time"]) - float(at)
        if stalled > hang_after_s:
            return (
                f"its main loop made no progress for {stalled:.1f}s "
                f"(hang_after_s={hang_after_s:g}): hung"
            )
    return None
