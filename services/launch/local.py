"""Local launcher: worker processes as subprocesses in their own process groups, with logs,
ready files and signals. The control plane reuses it; it knows only a :class:`ProcessSpec`.

Each process has a reaper thread that waits for it and stamps the moment it ended
(:attr:`LocalProcess.exited_at`): the driver tells which rank of a group died first by that
stamp, not by the order its polls found the exits in.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from services.launch.spec import ProcessSpec

__all__ = ["LocalLauncher", "LocalProcess", "ProcessSpec"]

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
        try:
            text = Path(self.spec.log_file).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class LocalLauncher:
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
        if spec.name in self.processes and self.processes[spec.name].poll() is None:
            raise ValueError(f"process {spec.name!r} is already running")
        if not spec.log_file:
            raise ValueError(
                f"process {spec.name!r} has no log_file; set one (its stdout and stderr go there)"
            )
        if spec.ready_file:
            Path(spec.ready_file).parent.mkdir(parents=True, exist_ok=True)
            Path(spec.ready_file).unlink(missing_ok=True)
        Path(spec.log_file).parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_file, "ab")  # noqa: SIM115 (closed when the process ends)
        env = {**os.environ, **spec.env}
        env.pop("XTOKEN_PARENT_PID", None)
        if self.parent_sentinel:
            env["XTOKEN_PARENT_PID"] = str(os.getpid())
        argv = self.command(spec)
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        proc = LocalProcess(spec, popen, log)
        self.processes[spec.name] = proc
        logger.info("[run] started %s (pid %d): xtoken %s", spec.name, popen.pid, " ".join(spec.argv))
        return proc

    def command(self, spec: ProcessSpec) -> list[str]:
        """The command line of ``spec``: ``python -m services.cli <argv> [--ready-file F]``."""
        argv = [self.python, "-m", "services.cli", *spec.argv]
        if spec.ready_file:
            argv += ["--ready-file", spec.ready_file]
        return argv

    def wait_ready(self, proc: LocalProcess, timeout_s: float) -> dict[str, Any]:
        """Wait for the ready file of ``proc``.

        Raises:
            RuntimeError: the process exited first (with its last log lines) or did not get
                ready within ``timeout_s``.
            ValueError: the spec has no ready file.
        """
        if not proc.spec.ready_file:
            raise ValueError(
                f"process {proc.spec.name!r} has no ready_file, so it never reports ready; give "
                "its spec one"
            )
        deadline = time.monotonic() + timeout_s
        path = Path(proc.spec.ready_file)
        while time.monotonic() < deadline:
            if path.is_file():  # written atomically: complete once it exists
                text = path.read_text()
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    return {"text": text.strip()}
            code = proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"{proc.spec.name} exited with code {code} before it was ready; last log "
                    f"lines ({proc.spec.log_file}):\n{proc.tail()}"
                )
            time.sleep(0.05)
        raise RuntimeError(
            f"{proc.spec.name} was not ready within {timeout_s:.0f}s; log: {proc.spec.log_file}"
        )

    def stop(self, names: list[str] | None = None, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM the processes (``names``; None: all), SIGKILL what is left after ``grace_s``;
        returns exit codes."""
        names = list(self.processes) if names is None else names
        procs = [self.processes[n] for n in names if n in self.processes]
        for p in procs:
            if p.poll() is None:
                p.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                logger.warning("[run] %s did not stop within %.0fs: killing it", p.spec.name, grace_s)
                p.signal(signal.SIGKILL)
                p.popen.wait(timeout=10)
        return {p.spec.name: p.poll() for p in procs}
