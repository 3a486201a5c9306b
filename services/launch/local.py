"""Local launcher: worker processes as subprocesses in their own process groups, with logs,
ready files and signals. The control plane reuses it; it knows only a :class:`ProcessSpec`.

Each process has a reaper thread that waits for it and stamps the moment it ended
(:attr:`LocalProcess.exited_at`): the driver tells which rank of a group died first by that
stamp, not by the order its polls found the exits in.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from services.launch.base import Launcher, open_log, read_ready_file, tail_file, worker_command
from services.launch.spec import ProcessSpec

__all__ = ["LocalLauncher", "LocalProcess"]

logger = logging.getLogger(__name__)


# seconds poll() waits for the reaper's stamp of an exit it found (the stamp follows at once)
_STAMP_WAIT_S = 1.0


class LocalProcess:
    """A started process and its spec.

    Attributes:
        exited_at: when the process ended (seconds since the epoch, stamped by a thread that
            waits for it), or None while it runs.
    """

    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen, log: Any) -> None:
        self.spec = spec
        self.popen = popen
        self._log = log
        self.started = time.monotonic()
        self.exited_at: float | None = None
        self._reaped = threading.Event()
        threading.Thread(target=self._reap, name=f"reap-{spec.name}", daemon=True).start()

    def _reap(self) -> None:
        """Wait for the process and stamp its end (the thread only waits: the process's
        dead-parent signal is tied to the thread that started it, not to this one)."""
        try:
            self.popen.wait()
        finally:
            self.exited_at = time.time()
            self._reaped.set()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    @property
    def host(self) -> str:
        """This machine's host name (a local process runs where its launcher runs)."""
        return socket.gethostname()

    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal), or None while running; once it is
        known, so is :attr:`exited_at`."""
        code = self.popen.poll()
        if code is None:
            return None
        if not self._reaped.wait(_STAMP_WAIT_S) and self.exited_at is None:
            self.exited_at = time.time()  # no stamp (no reaper): when it was found
        if not self._log.closed:
            self._log.close()
        return code

    def signal(self, signum: int) -> None:
        """Send a signal to the process group (the process and anything it started)."""
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 20) -> str:
        """The last lines of the process log."""
        return tail_file(self.spec.log_file, lines)


class LocalLauncher(Launcher):
    """Start, watch and stop the processes of a run on this machine.

    Args:
        python: the interpreter that runs ``-m services.cli`` (default: this one).
        parent_sentinel: pass ``XTOKEN_PARENT_PID`` so children stop when this process dies
            (``xtoken run``); False lets them outlive it (the control plane re-attaches them).
    """

    def __init__(self, python: str | None = None, parent_sentinel: bool = True) -> None:
        self.python = python or sys.executable
        self.parent_sentinel = parent_sentinel
        self.processes: dict[str, LocalProcess] = {}

    def start(self, spec: ProcessSpec) -> LocalProcess:
        """Start a process (its own process group; the dead-parent sentinel watches us).

        Raises:
            ValueError: a process of that name is running, or the spec has no log file.
        """
        self.check_startable(spec)
        log = open_log(spec)
        env = {**os.environ, **spec.env}
        env.pop("XTOKEN_PARENT_PID", None)
        if self.parent_sentinel:
            env["XTOKEN_PARENT_PID"] = str(os.getpid())
        popen = subprocess.Popen(
            self.command(spec),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        proc = LocalProcess(spec, popen, log)
        self.processes[spec.name] = proc
        logger.info(
            "[run] started %s (pid %d): xtoken %s", spec.name, popen.pid, " ".join(spec.argv)
        )
        return proc

    def command(self, spec: ProcessSpec) -> list[str]:
        """The command line of ``spec`` (:func:`~services.launch.base.worker_command`)."""
        return worker_command(self.python, spec)

    def ready(self, proc: Any) -> dict[str, Any] | None:
        """The ready file of ``proc`` once it wrote it, else None."""
        return read_ready_file(proc.spec.ready_file)
