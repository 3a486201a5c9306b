"""Processes of a run found again by pid after a control-plane restart (identity from /proc).

One process (:func:`attach`), or every process of a run from its rows in the store
(:func:`attach_run`); :func:`kill_leftovers` ends what is left of a run that cannot go on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

# poll() of a re-attached process that has ended: it is not our child, so its code is unknown.
EXIT_UNKNOWN = -1000


def identity(pid: int) -> dict[str, Any] | None:
    """What tells this process apart from a later one that reuses its pid.

    Args:
        pid: a process id.

    Returns:
        ``{"start_ticks": int, "cmdline": str, "state": str}`` (start time in clock ticks since
        boot, the command line joined by spaces, the /proc state letter), or None when no such
        process exists.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    return {
        "state": fields[0],
        "start_ticks": int(fields[19]),
        "cmdline": " ".join(p.decode(errors="replace") for p in cmdline.split(b"\0") if p),
    }


def is_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True while ``pid`` runs (not a zombie) and, when given, started at ``start_ticks``."""
    ident = identity(pid)
    if ident is None or ident["state"] in ("Z", "X"):
        return False
    return start_ticks is None or ident["start_ticks"] == start_ticks


class AttachedProcess:
    """A run's process started by an earlier control plane, watched by pid.

    It has the interface of a launcher's process (``spec``, ``pid``, ``poll``, ``signal``,
    ``tail``); ``poll`` returns :data:`EXIT_UNKNOWN` once the process is gone.

    Args:
        spec: its ProcessSpec.
        pid: its pid (a session leader: its process group id too).
        start_ticks: its start time from :func:`identity` (guards against pid reuse).
    """

    def __init__(self, spec: Any, pid: int, start_ticks: int) -> None:
        self.spec = spec
        self._pid = pid
        self.start_ticks = start_ticks
        self.started = time.monotonic()
        self._code: int | None = None

    @property
    def pid(self) -> int:
        """The process id."""
        return self._pid

    @property
    def popen(self) -> AttachedProcess:
        """Itself: a launcher's ``stop`` waits through ``proc.popen.wait``."""
        return self

    def poll(self) -> int | None:
        """None while it runs, :data:`EXIT_UNKNOWN` once it is gone."""
        if self._code is None and not is_alive(self._pid, self.start_ticks):
            self._code = EXIT_UNKNOWN
        return self._code

    def wait(self, timeout: float | None = None) -> int | None:
        """Poll until the process is gone or ``timeout`` seconds passed; returns ``poll()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        return self.poll()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to its process group (only while it is still the same process)."""
        if self.poll() is not None:
            return
        try:
            os.killpg(self._pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        try:
            text = Path(self.spec.log_file).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def attach(spec: Any, pid: int, start_ticks: int) -> AttachedProcess | None:
    """Re-attach the process ``pid`` of ``spec`` if it is still the same process.

    Args:
        spec: the ProcessSpec it was started with.
        pid: its recorded pid.
        start_ticks: its recorded start time (:func:`identity`).

    Returns:
        An :class:`AttachedProcess`, or None when it is gone or the pid now names another process
        (a different start time, or a command line without ``services.cli`` and its subcommand).
    """
    ident = identity(pid)
    if ident is None or ident["state"] in ("Z", "X") or ident["start_ticks"] != start_ticks:
        return None
    argv0 = spec.argv[0] if spec.argv else ""
    if "services.cli" not in ident["cmdline"] or argv0 not in ident["cmdline"]:
        return None
    return AttachedProcess(spec, pid, start_ticks)


def attach_run(run: Any, rows: list[dict[str, Any]]) -> dict[str, AttachedProcess]:
    """Re-attach the recorded processes of a run into its launcher.

    Args:
        run: a :class:`services.supervise.driver.Driver` rebuilt from its runtime record
            (:meth:`~services.supervise.driver.Driver.restore`: its specs and finished processes).
        rows: the run's process rows from the store (``name``, ``pid``, ``start_ticks``).

    Returns:
        The processes found alive, by name. When there is one, each is in
        ``run.launcher.processes`` and so is every other unfinished process of the run, as one
        that ended unseen (``poll`` gives :data:`EXIT_UNKNOWN`: the restart policy decides);
        when there is none, the launcher is left as it was.
    """
    attached: dict[str, AttachedProcess] = {}
    recorded = {p["name"]: p for p in rows}
    for p in rows:
        spec = run.specs.get(p["name"])
        if spec is None or not p["pid"] or p["start_ticks"] is None:
            continue
        a = attach(spec, p["pid"], p["start_ticks"])
        if a is not None:
            attached[p["name"]] = a
    if not attached:
        return attached
    for name, spec in run.specs.items():
        if name in attached:
            run.launcher.processes[name] = attached[name]
        elif name not in run.finished:
            row = recorded.get(name) or {}
            # its recorded pid: the driver matches it against the code the process wrote
            gone = AttachedProcess(spec, row.get("pid") or 0, row.get("start_ticks") or 0)
            gone._code = EXIT_UNKNOWN  # ended unseen
            run.launcher.processes[name] = gone
    return attached


def kill_leftovers(rows: list[dict[str, Any]]) -> None:
    """SIGKILL the process group of every process recorded as running that is still the same
    process (pid and start time): what is left of a run that cannot be re-attached."""
    for p in rows:
        if p["pid"] and p["start_ticks"] is not None and p["state"] == "running":
            ident = identity(p["pid"])
            if ident is not None and ident["start_ticks"] == p["start_ticks"]:
                try:
                    os.killpg(p["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
