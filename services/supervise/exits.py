"""How the driver reads the exits of a run's processes: when each ended, which exit of a group
caused the others, and the one line a failed process gave as its cause.

A trainer rank that dies takes its peers down a moment later (their next collective fails). The
driver holds a group's exits in :class:`GroupExits` until the group is all gone or
:data:`GROUP_EXITS_WAIT_S` passed since its first exit, then names the first to die
(:func:`~services.supervise.policy.first_cause`) by the exit time its launcher stamped, not by
the order its polls found the exits in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from services.supervise.policy import first_cause

# seconds a group's decision waits, after its first exit, for the exits of its other processes
GROUP_EXITS_WAIT_S = 2.0
# a process's one-line error in its log (services.common.lifecycle: "[name] error: ...")
_ERROR_LINE = re.compile(r"\[[\w.-]+\] error: (.+)$")


def exit_time(proc: Any) -> float:
    """When ``proc`` ended: its launcher's stamp (``exited_at``, taken as close to the process
    as it can), else now (a process re-attached after a control-plane restart has none)."""
    at = getattr(proc, "exited_at", None)
    return float(at) if at is not None else time.time()


def error_line(tail: str) -> str | None:
    """The message of the last ``[name] error: ...`` line of a process's log tail, or None."""
    for line in reversed(tail.splitlines()):
        match = _ERROR_LINE.search(line)
        if match:
            return match.group(1).strip()
    return None


class GroupExits:
    """Exits of the processes of groups (the trainer ranks) held until their group's restart is
    decided.

    Args:
        wait_s: how long after a group's first exit the decision waits for the others' exits.

    Attributes:
        wait_s: as given.
    """

    def __init__(self, wait_s: float = GROUP_EXITS_WAIT_S) -> None:
        self.wait_s = wait_s
        self._exits: dict[str, tuple[int, float]] = {}  # name -> (exit code, exit time)
        self._since: dict[str, float] = {}  # role -> monotonic time its first exit was found

    def __contains__(self, name: object) -> bool:
        return name in self._exits

    def __bool__(self) -> bool:
        """Some group's decision waits."""
        return bool(self._since)

    def hold(self, name: str, role: str, code: int, at: float) -> None:
        """Hold the exit of ``name`` of group ``role`` (``code``, ended at ``at``)."""
        self._exits[name] = (code, at)
        self._since.setdefault(role, time.monotonic())

    def due(
        self, members: Callable[[str], list[str]], running: Callable[[str], bool]
    ) -> Iterator[tuple[str, str, int, str]]:
        """The groups whose restart is to be decided now (every process of it has exited, or
        :attr:`wait_s` passed since its first exit: a rank blocked in a collective may never
        exit by itself, the restart stops it); their exits are no longer held.

        Args:
            members: role -> the names of the group's processes.
            running: name -> the process still runs (a process that ended normally does not).

        Yields:
            ``(role, cause, code, reason)``: the process that died first, its exit code, and
            the start of the restart's reason, naming the exits that followed.
        """
        for role, since in list(self._since.items()):
            names = members(role)
            exits = {n: self._exits[n] for n in names if n in self._exits}
            if not exits:  # a restart that covers the group took them over
                del self._since[role]
                continue
            waiting = [n for n in names if n not in exits and running(n)]
            if waiting and time.monotonic() - since < self.wait_s:
                continue
            del self._since[role]
            for n in exits:
                del self._exits[n]
            cause = first_cause(exits)
            code, at = exits[cause]
            yield role, cause, code, _describe(role, cause, exits)

    def forget(self, names: set[str]) -> None:
        """Drop the held exits of ``names`` (a restart that starts them again handles them)."""
        for n in names:
            self._exits.pop(n, None)

    def clear(self) -> None:
        """Drop everything held (the run stops)."""
        self._exits.clear()
        self._since.clear()


def _describe(role: str, cause: str, exits: dict[str, tuple[int, float]]) -> str:
    """``trainer1 exited with code -9 (the first of the trainers to end; then trainer0 exited
    with code 1 0.31s later)``."""
    code, at = exits[cause]
    text = f"{cause} exited with code {code}"
    followed = sorted((t, n, c) for n, (c, t) in exits.items() if n != cause)
    if followed:
        then = ", ".join(f"{n} exited with code {c} {_later(t - at)}" for t, n, c in followed)
        text += f" (the first of the {role}s to end; then {then})"
    return text


def _later(seconds: float) -> str:
    """``0.31s later`` (``0.02s earlier`` for an exit stamped before the cause's)."""
    return f"{abs(seconds):.2f}s {'later' if seconds >= 0 else 'earlier'}"
