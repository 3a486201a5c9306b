"""Restart policy of a run's processes: what to restart after an exit, when (backoff), and when
the failure budget is spent. Shared by ``xtoken run`` and the control plane's supervisor.

Per role (the default :data:`SCOPES`):

* ``collator``, ``teacher`` and ``rollout`` restart **in place** (a collator skips what the
  queue already holds; a restarted teacher recomputes the requests of its dead predecessor; a
  restarted rollout worker samples again the prompts its predecessor had not put);
* any ``trainer`` rank restarts the whole **group** of ranks from the latest checkpoint (the
  survivors cannot go on without it: their next collective fails);
* the ``queue`` holds the run's samples in memory, so its loss restarts the **run**: every
  process again, the trainers from their checkpoint, the collators re-putting the corpus.

An exit with a code of :data:`DETERMINISTIC_CODES` (2: bad settings, 3: bad data; the process
lifecycle decides them by the class of the error, ``xtoken_core.errors``) fails the run at once:
the same process would fail the same way again. Any other exit is a fault, restarted.

When a rank dies its peers fail too, a moment later (their next collective). The restart of the
group is caused by the rank that died first, by exit time (:func:`first_cause`), whichever exit
the launcher happened to report first.

A budget of ``max_restarts`` per restart key (a process name, ``trainers`` or ``run``); the n-th
restart waits ``backoff_s * 2 ** (n - 1)`` seconds, at most ``max_backoff_s``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# role -> restart scope
SCOPES: dict[str, str] = {
    "collator": "process",
    "teacher": "process",
    "rollout": "process",
    "trainer": "group",
    "queue": "run",
}


# exit codes of a failure a restart repeats (xtoken_core.errors: EXIT_SETTINGS, EXIT_DATA)
DETERMINISTIC = {2: "bad settings", 3: "bad data"}
DETERMINISTIC_CODES = frozenset(DETERMINISTIC)
# exits of one group this close in time count as simultaneous: a death by a signal among them is
# the cause (the others failed because of it), whatever their clocks or reports say
SIGNAL_TIE_S = 0.5
# the largest signal number: an exit code -1..-SIGNAL_MAX is a death by that signal
_SIGNAL_MAX = 64


def first_cause(exits: Mapping[str, tuple[int, float]], tie_s: float = SIGNAL_TIE_S) -> str:
    """Which of a group's exits caused the others: the earliest; among the exits within ``tie_s``
    of the earliest, a death by a signal (a SIGKILL, the OOM killer) before an exit code (a rank
    that exits 1 because its peer died).

    Args:
        exits: process name -> ``(exit code, exit time)`` (a negative code: killed by that
            signal; the time in seconds since the epoch, as close to the process as observed).
        tie_s: exits this close to the earliest count as simultaneous.

    Returns:
        The name of the process that died first.

    Raises:
        ValueError: no exit given.
    """
    if not exits:
        raise ValueError("first_cause() got no exit")
    earliest = min(at for _, at in exits.values())
    near = [(at, name, code) for name, (code, at) in exits.items() if at - earliest <= tie_s]
    killed = [x for x in near if -_SIGNAL_MAX <= x[2] < 0]
    return min(killed or near)[1]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do after a process exited.

    Attributes:
        action: ``done`` (a normal end: nothing to do), ``restart`` or ``fail``.
        scope: ``process`` (the one process), ``group`` (every process of its role) or ``run``.
        key: the budget key (the process name, ``trainers`` or ``run``).
        attempt: the restart's number (1-based) within its budget; 0 for done / fail.
        delay_s: seconds to wait before the restart.
        reason: one line for logs and the API.
        code: the exit code that caused it (negative: killed by that signal); None when nothing
            exited (what a process held was lost).
        max_restarts: the restarts its budget key allows (``attempt`` of ``max_restarts``).
    """

    action: str
    scope: str = "process"
    key: str = ""
    attempt: int = 0
    delay_s: float = 0.0
    reason: str = ""
    code: int | None = None
    max_restarts: int = 0


class RestartPolicy:
    """Decides, per exited process, between a normal end, a restart (with backoff) and failure.

    Args:
        max_restarts: restarts per budget key before the run fails (0: never restart).
        backoff_s: wait before the first restart of a key; doubles with each further one.
        max_backoff_s: the longest wait.
        scopes: role -> scope (default :data:`SCOPES`); a role not listed is never restarted.

    Raises:
        ValueError: a negative budget or backoff, or an unknown scope.
    """

    def __init__(
        self,
        max_restarts: int,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        scopes: dict[str, str] | None = None,
    ) -> None:
        if max_restarts < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                f"max_restarts={max_restarts}, backoff_s={backoff_s}, "
                f"max_backoff_s={max_backoff_s}: none may be negative"
            )
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.scopes = dict(SCOPES if scopes is None else scopes)
        for role, scope in self.scopes.items():
            if scope not in ("process", "group", "run"):
                raise ValueError(f"scope of {role!r} is {scope!r}: use process, group or run")
        self.used: dict[str, int] = {}

    def decide(
        self,
        name: str,
        role: str,
        code: int,
        *,
        finished_ok: bool = False,
        cause: str | None = None,
    ) -> Decision:
        """The decision for process ``name`` of ``role`` that exited with ``code``.

        Args:
            name: the process name (``teacher0``).
            role: its role (``teacher``).
            code: its exit code (negative: killed by that signal).
            finished_ok: the exit is the process's normal end (a collator or trainer exiting 0).
            cause: the start of a restart's reason (default ``"<name> exited with code <code>"``;
                a group's names the exits that followed).

        Returns:
            A :class:`Decision`; a restart is counted against the budget at once.
        """
        if finished_ok:
            return Decision("done", reason=f"{name} finished")
        if code in DETERMINISTIC:
            return Decision(
                "fail",
                reason=f"{name} exited with code {code} ({DETERMINISTIC[code]}: a restart would "
                "fail the same way; not restarted)",
                code=code,
            )
        return self.decide_lost(name, role, cause or f"{name} exited with code {code}", code=code)

    def decide_lost(self, name: str, role: str, cause: str, code: int | None = None) -> Decision:
        """The decision after what ``name`` of ``role`` held was lost while no process exited
        (a shared queue restarted without its data: ``decide_lost("queue", "queue", ...)``
        restarts the run), counted against the same budget as an exit.

        Args:
            name: the process (or service) whose state was lost.
            role: its role (the scope and budget key follow from it, as for an exit).
            cause: what happened, the start of the decision's reason.
            code: the exit code behind it, when a process exited (:meth:`decide`).

        Returns:
            A ``restart`` or ``fail`` :class:`Decision`; a restart is counted at once.
        """
        scope = self.scopes.get(role)
        if scope is None:
            return Decision("fail", reason=f"{cause}; a {role} is never restarted", code=code)
        key = {"process": name, "group": f"{role}s", "run": "run"}[scope]
        used = self.used.get(key, 0)
        if used >= self.max_restarts:
            return Decision(
                "fail",
                scope,
                key,
                reason=f"{cause}; restart budget of {key} spent ({used} of {self.max_restarts})",
                code=code,
                max_restarts=self.max_restarts,
            )
        self.used[key] = used + 1
        delay = min(self.backoff_s * 2**used, self.max_backoff_s)
        return Decision(
            "restart",
            scope,
            key,
            attempt=used + 1,
            delay_s=delay,
            reason=f"{cause}: restart {used + 1} of {self.max_restarts} ({scope}) in {delay:.1f}s",
            code=code,
            max_restarts=self.max_restarts,
        )

    def restarts(self) -> dict[str, int]:
        """Restarts used so far per budget key."""
        return dict(self.used)
