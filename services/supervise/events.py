"""What the driver of a run reports as it goes: typed events, and the structured failure that ends
a run (process, role, exit code, reason and the last log lines as fields)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a run failed.

    Attributes:
        process: the process that failed (``trainer0``), or ``queue`` for a shared queue lost.
        role: its role (``queue``, ``collator``, ``teacher``, ``trainer``).
        exit_code: its exit code; None when nothing exited (a shared queue lost or unreachable).
        reason: one line (the restart policy's, or what the control plane saw).
        log_file: the process's log, or None when no process log tells more.
        log_tail: the last lines of that log.
    """

    process: str
    role: str
    exit_code: int | None
    reason: str
    log_file: str | None = None
    log_tail: str = ""

    def message(self) -> str:
        """The reason and, when there is a log, its last lines (what ``xtoken run`` prints)."""
        if self.log_file is None:
            return self.reason
        return f"{self.reason}; last log lines ({self.log_file}):\n{self.log_tail}"


@dataclasses.dataclass(frozen=True)
class Event:
    """An event of a run; ``kind`` names it, :meth:`data` is its JSON payload."""

    kind: ClassVar[str] = ""

    def data(self) -> dict[str, Any]:
        """The event's fields as a JSON mapping (the control plane records it)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Launched(Event):
    """Every process of the run was started (the run's own queue ready first)."""

    kind: ClassVar[str] = "launched"
    queue: str


@dataclasses.dataclass(frozen=True)
class Exited(Event):
    """A process exited (``code``; negative: killed by that signal)."""

    kind: ClassVar[str] = "exited"
    process: str
    role: str
    code: int


@dataclasses.dataclass(frozen=True)
class Unresponsive(Event):
    """A live process was killed: its heartbeat stopped, it made no progress, or it was frozen."""

    kind: ClassVar[str] = "unresponsive"
    process: str
    pid: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Recovering(Event):
    """A restart was decided; it starts after ``delay_s``. ``code``: the exit code behind it
    (None: nothing exited, e.g. a shared queue lost the run's samples); ``attempt`` of
    ``max_restarts`` of its budget."""

    kind: ClassVar[str] = "recovering"
    process: str
    scope: str
    attempt: int
    delay_s: float
    reason: str
    code: int | None = None
    max_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class Restarted(Event):
    """The processes of a restart were started (``code``, ``attempt`` and ``max_restarts`` as in
    :class:`Recovering`)."""

    kind: ClassVar[str] = "restarted"
    process: str
    scope: str
    attempt: int
    code: int | None = None
    max_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class DataComplete(Event):
    """The collator finished; the end-of-data marker says how many samples the epoch has."""

    kind: ClassVar[str] = "data_complete"
    samples: int


@dataclasses.dataclass(frozen=True)
class Failed(Event):
    """The run failed (:class:`Failure`)."""

    kind: ClassVar[str] = "failed"
    failure: Failure

    def data(self) -> dict[str, Any]:
        """``process``, ``role``, ``code`` and ``reason`` (the log tail stays in the failure)."""
        f = self.failure
        return {"process": f.process, "role": f.role, "code": f.exit_code, "reason": f.reason}
