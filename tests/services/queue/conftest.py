"""Fixtures for queue tests: real queue servers as subprocesses on loopback, always stopped."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.common.lifecycle import read_ready

ROOT = pathlib.Path(__file__).resolve().parents[3]


class ServerProcess:
    """A `xtoken queue serve` subprocess and the endpoint it bound."""

    def __init__(self, tmp: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> None:
        ready = tmp / f"ready-{time.monotonic_ns()}"
        self.log_path = tmp / f"server-{time.monotonic_ns()}.log"
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "queue",
            "serve",
            "--bind",
            "tcp://127.0.0.1:*",
            "--ready-file",
            str(ready),
            *args,
        ]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"queue server did not start: {self.log()}")
            time.sleep(0.05)
        self.ready_path = ready
        self.address = read_ready(ready)["endpoint"]

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def stop_with_queue(
    stop: threading.Event, server: ServerProcess, worker: threading.Thread
) -> float:
    """A worker's SIGTERM and its queue's SIGKILL together (a run stopped with its queue): set
    ``stop``, kill ``server``, wait for ``worker`` (60 s at most); the seconds it took to end."""
    stop.set()
    t0 = time.monotonic()
    server.proc.kill()
    worker.join(60)
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A server shared by the queue tests (each test uses its own partitions)."""
    srv = ServerProcess(tmp_path_factory.mktemp("queue"), "--capacity", "256MiB")
    yield srv
    srv.stop()


@pytest.fixture
def make_server(tmp_path):
    """Start servers with extra CLI arguments; all are stopped after the test."""
    started: list[ServerProcess] = []

    def _make(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(tmp_path, *args, env=env)
        started.append(srv)
        return srv

    yield _make
    for srv in started:
        srv.stop()
