"""What every launcher shares: the process interface a run sees, the worker's command line, its
log and ready files, and the launcher's wait for ready and its stop, written once for local
subprocesses and Ray actors alike."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from services.launch.spec import ProcessSpec

logger = logging.getLogger(__name__)

# seconds between two looks at a process that is getting ready or stopping
POLL_S = 0.05
# seconds a launcher waits for a process it sent SIGKILL to
KILL_WAIT_S = 10.0


@runtime_checkable
class LaunchedProcess(Protocol):
    """One started process of a run, wherever it runs.

    Attributes:
        spec: the :class:`ProcessSpec` it was started from.
        pid: its process id on its host.
        host: the host name it runs on.
    """

    spec: ProcessSpec

    @property
    def pid(self) -> int:
        """The process id on :attr:`host`."""
        ...

    @property
    def host(self) -> str:
        """The host the process runs on."""
        ...

    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal), or None while it runs."""
        ...

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process group (the process and whatever it started)."""
        ...

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its log."""
        ...


def worker_command(python: str, spec: ProcessSpec) -> list[str]:
    """The command line of ``spec``: ``python -m services.cli <argv> [--ready-file F]``."""
    argv = [python, "-m", "services.cli", *spec.argv]
    if spec.ready_file:
        argv += ["--ready-file", spec.ready_file]
    return argv


def open_log(spec: ProcessSpec) -> IO[bytes]:
    """Make ``spec``'s folders, remove a ready file left by an earlier start, and open its log
    for appending (the caller closes it once the process ended)."""
    if spec.ready_file:
        Path(spec.ready_file).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.ready_file).unlink(missing_ok=True)
    Path(spec.log_file).parent.mkdir(parents=True, exist_ok=True)
    return open(spec.log_file, "ab")  # noqa: SIM115 (closed when the process ends)


def read_ready_file(path: str) -> dict[str, Any] | None:
    """A ready file's JSON (``{"text": ...}`` for one that is not JSON), or None while it is not
    there; it is written atomically, so it is complete once it exists."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text.strip()}


def tail_file(path: str, lines: int) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" while there is none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Launcher:
    """Starts, watches and stops the processes of one run; knows only :class:`ProcessSpec`.

    A launcher writes :meth:`start` and :meth:`ready`; waiting for ready and stopping are the
    same for every launcher.

    Attributes:
        processes: name -> the process last started under that name.
    """

    processes: dict[str, Any]

    def start(self, spec: ProcessSpec) -> LaunchedProcess:
        """Start ``spec`` (:func:`worker_command`).

        Raises:
            ValueError: a process of that name runs, or the spec cannot be started as given.
        """
        raise NotImplementedError

    def ready(self, proc: Any) -> dict[str, Any] | None:
        """``proc``'s ready file (:func:`read_ready_file`) once it wrote it, else None."""
        raise NotImplementedError

    def log_place(self, proc: Any) -> str:
        """Where ``proc``'s log is, as a message names it."""
        return proc.spec.log_file

    def check_startable(self, spec: ProcessSpec) -> None:
        """Refuse a spec no launcher can start.

        Raises:
            ValueError: a process of that name is running, or the spec has no log file.
        """
        if spec.name in self.processes and self.processes[spec.name].poll() is None:
            raise ValueError(f"process {spec.name!r} is already running")
        if not spec.log_file:
            raise ValueError(
                f"process {spec.name!r} has no log_file; set one (its stdout and stderr go there)"
            )

    def wait_ready(self, proc: Any, timeout_s: float) -> dict[str, Any]:
        """Wait for ``proc``'s ready file; returns its JSON.

        Raises:
            RuntimeError: the process exited first (with its last log lines) or did not get
                ready within ``timeout_s``.
            ValueError: its spec has no ready file.
        """
        if not proc.spec.ready_file:
            raise ValueError(
                f"process {proc.spec.name!r} has no ready_file, so it never reports ready; give "
                "its spec one"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.ready(proc)
            if ready is not None:
                return ready
            code = proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{proc.spec.name} exited with code {code} before it was ready; last log "
                    f"lines ({self.log_place(proc)}):\n{proc.tail()}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{proc.spec.name} was not ready within {timeout_s:.0f}s; log: "
                    f"{self.log_place(proc)}"
                )
            time.sleep(POLL_S)

    def stop(self, names: list[str] | None = None, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM ``names`` (None: all), SIGKILL what is left after ``grace_s``; returns their
        exit codes (None: still running :data:`KILL_WAIT_S` after its SIGKILL).

        A queue among them stops last, once the others ended (each group gets ``grace_s``): a
        stopping worker gives what it holds leased back to a live queue, so those samples are
        served again at once, not once their leases run out.
        """
        names = list(self.processes) if names is None else names
        procs = [self.processes[n] for n in names if n in self.processes]
        _stop_all([p for p in procs if p.spec.role != "queue"], grace_s)
        _stop_all([p for p in procs if p.spec.role == "queue"], grace_s)
        return {p.spec.name: p.poll() for p in procs}


def _stop_all(procs: list[Any], grace_s: float) -> None:
    """SIGTERM ``procs`` together, SIGKILL those left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            logger.warning("[run] %s did not stop within %.0fs: killing it", p.spec.name, grace_s)
            p.signal(signal.SIGKILL)
            kill_deadline = time.monotonic() + KILL_WAIT_S
            while p.poll() is None and time.monotonic() < kill_deadline:
                time.sleep(POLL_S)
