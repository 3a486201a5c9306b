"""Control-plane fixtures: `xtoken control serve` as a real subprocess on loopback, a data root with
a small corpus, tiny run configs, and a cleanup that ends every process a test's runs started; for
the Supervisor without HTTP, `make`: a Supervisor whose runs' processes are scripted stand-ins;
`serve_app`: an app (over such a Supervisor) under a real uvicorn on loopback, in a thread."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.control.store import Store
from services.control.supervisor import Supervisor
from services.launch.local import LocalLauncher, LocalProcess

# The e2e helpers' fixtures (demo corpus), visible to this folder's tests.
from tests.e2e.conftest import (
    CHILD_ENV,
    ROOT,
    corpus_parts,
    demo,  # noqa: F401
    free_port,
)


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A run config like examples/tiny.yaml but smaller: 1 trainer, 1 shm teacher, tiny models."""
    config: dict[str, Any] = {
        "student_tokenizer": "mistral",
        "teacher_tokenizer": "smollm2",
        "ctx_student": 64,
        "ctx_teacher": 64,
        "trainers": 1,
        "teachers": 1,
        "restart_backoff_s": 0.5,
        "collator": {"batch": 8},
        "teacher": {"model": "tiny", "transport": "shm", "max_batch": 4, "max_length": 64},
        "trainer": {
            "student": {"model": "tiny"},
            "feed": {"micro_batch": 4, "grad_accum": 1},
            "schedule": {"epochs": 1, "checkpoint_every": 2, "eval_every": 0},
            "eval": {"texts": 2, "ctx": 64},
            "optim": {"lr": 0.003, "warmup_steps": 1},
        },
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config


class ControlServer:
    """``python -m services.cli control serve`` in its own session, on a free loopback port.

    Args:
        root: test folder: ``runs/`` (runs root, SQLite), ``data/`` (data root), ``control.log``.
        token: the bearer token (None: none).
        extra: more flags.
    """

    def __init__(self, root: pathlib.Path, token: str | None = None,
                 extra: list[str] | None = None) -> None:
        self.root = root
        self.runs_root = root / "runs"
        self.data_root = root / "data"
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "control.log"
        self.ready_file = root / "control.ready"
        self.extra = extra or []
        self.popen: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (or start again after a kill) on the same port, runs root and store."""
        self.ready_file.unlink(missing_ok=True)
        env = {**os.environ, **CHILD_ENV, "XTOKEN_CONTROL_TICK_S": "0.1"}
        env.pop("XTOKEN_PARENT_PID", None)
        if self.token:
            env["XTOKEN_CONTROL_TOKEN"] = self.token
        argv = [sys.executable, "-m", "services.cli", "control", "serve", "--port",
                str(self.port), "--runs-root", str(self.runs_root), "--data-root",
                str(self.data_root), "--ready-file", str(self.ready_file), *self.extra]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.ready_file.is_file():
            if self.popen.poll() is not None:
                pytest.fail(f"control serve exited {self.popen.poll()}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"control serve not ready in 60 s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def client(self, token: str | None = "default") -> httpx.Client:
        """An httpx client (with the server's token unless told otherwise)."""
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def kill(self) -> None:
        """SIGKILL the server only (its runs' processes live on)."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        """SIGTERM the server, then end every process its runs started (pids from its store)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        kill_run_processes(self.runs_root / "control.db")


def kill_run_processes(db: pathlib.Path) -> None:
    """SIGKILL the process group of every recorded process that is still the same process."""
    from services.supervise.attach import identity

    if not db.is_file():
        return
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT pid, start_ticks FROM processes").fetchall()
    for pid, ticks in rows:
        ident = identity(pid) if pid else None
        if ident is not None and ident["start_ticks"] == ticks:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for seg in pathlib.Path("/dev/shm").glob(f"xtk_{pid}_*"):
                seg.unlink(missing_ok=True)


def wait_state(client: httpx.Client, run_id: str, states: set[str], timeout_s: float) -> dict:
    """Poll GET /v1/runs/{id} until its state is in ``states``; fail with the run on timeout."""
    deadline = time.monotonic() + timeout_s
    run: dict = {}
    while time.monotonic() < deadline:
        run = client.get(f"/v1/runs/{run_id}").json()
        if run.get("state") in states:
            return run
        time.sleep(0.2)
    pytest.fail(f"run {run_id} not in {states} after {timeout_s:.0f}s: "
                f"{json.dumps({k: run.get(k) for k in ('state', 'reason', 'step')})}")


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` under a real uvicorn on a free loopback port, in a thread of this process; yields
    its base URL and stops the server after (a given supervisor is left to its owner)."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture
def corpus(demo, tmp_path):  # noqa: F811
    """A 24-text corpus under the data root of the test's server: (file, its keys)."""
    paths, keys = corpus_parts(demo, tmp_path / "server" / "data" / "corpus", n=24, parts=1)
    return paths[0], keys


@pytest.fixture
def server(tmp_path):
    """A control server without a token, stopped (with its runs' processes) after the test."""
    s = ControlServer(tmp_path / "server")
    yield s
    s.stop()


# A stand-in worker: writes its ready file, prints, then sleeps SECONDS (forever when < 0) and
# exits with CODE; SIGTERM ends it with 0 (like a worker that drains).
_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, json
    ready, seconds, code, summary = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    if ready != "-":
        open(ready + ".tmp", "w").write(json.dumps({"pid": os.getpid(), "name": "x"}))
        os.replace(ready + ".tmp", ready)
    print("stand-in", " ".join(sys.argv[5:]), "started", flush=True)
    end = time.monotonic() + seconds
    while seconds < 0 or time.monotonic() < end:
        time.sleep(0.02)
    if summary != "-":
        open(summary, "w").write(json.dumps({"stopped": False}))
    print("boom: exiting with", code, flush=True)
    sys.exit(code)
    """
)
FOREVER = (-1.0, 0)
# A stand-in with the real process lifecycle (heartbeat file from its env): its main loop reports
# progress every 50 ms until SIGTERM; XTOKEN_TEST_HANG makes that loop hang.
_LIFECYCLE_SCRIPT = textwrap.dedent(
    """
    import sys
    from services.common.lifecycle import run_process

    def main(lc):
        lc.ready()
        while not lc.stop.wait(0.05):
            lc.progress()

    sys.exit(run_process(sys.argv[1], main, ready_file=None if sys.argv[2] == "-" else sys.argv[2]))
    """
)
LIFECYCLE = (-2.0, 0)  # a plan entry: run _LIFECYCLE_SCRIPT


class ScriptedLauncher(LocalLauncher):
    """A LocalLauncher whose processes play ``lives[name]`` (one (seconds, code) per start; the
    last one repeats) instead of running the workers; the trainer rank 0 writes summary.json."""

    def __init__(self, lives: dict[str, list[tuple[float, int]]]) -> None:
        super().__init__(parent_sentinel=False)
        self.lives = lives
        self.starts: dict[str, int] = {}
        self.envs: dict[str, list[dict]] = {}

    def start(self, spec):
        n = self.starts.get(spec.name, 0)
        self.starts[spec.name] = n + 1
        self.envs.setdefault(spec.name, []).append(dict(spec.env))
        plan = self.lives.get(spec.name, [FOREVER])
        seconds, code = plan[min(n, len(plan) - 1)]
        if spec.ready_file:
            pathlib.Path(spec.ready_file).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(spec.ready_file).unlink(missing_ok=True)
        if (seconds, code) == LIFECYCLE:
            argv = [sys.executable, "-c", _LIFECYCLE_SCRIPT, spec.name, spec.ready_file or "-"]
            return self._popen(spec, argv)
        summary = "-"
        if spec.name == "trainer0" and code == 0 and seconds >= 0:
            summary = str(pathlib.Path(spec.log_file).parent.parent / "summary.json")
        argv = [
            sys.executable,
            "-c",
            _SCRIPT,
            spec.ready_file or "-",
            str(seconds),
            str(code),
            summary,
            "services.cli",
            *spec.argv,
        ]
        return self._popen(spec, argv)

    def _popen(self, spec, argv):
        pathlib.Path(spec.log_file).parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_file, "ab")  # noqa: SIM115 (closed by LocalProcess.poll)
        env = {**os.environ, **spec.env}
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        proc = LocalProcess(spec, popen, log)
        self.processes[spec.name] = proc
        return proc


@pytest.fixture
def make(tmp_path):
    """make(lives, **kw) -> a Supervisor whose runs use ScriptedLauncher(lives); all stopped after."""
    made: list[Supervisor] = []
    launchers: list[ScriptedLauncher] = []

    def _make(lives, store=None, **kw):
        def factory():
            launchers.append(ScriptedLauncher(lives))
            return launchers[-1]

        sup = Supervisor(
            store or Store(tmp_path / "control.db"),
            runs_root=tmp_path / "runs",
            data_roots=[tmp_path / "data"],
            launcher_factory=factory,
            tick_s=0.05,
            **kw,
        )
        sup.launchers = launchers
        made.append(sup)
        return sup

    yield _make
    for sup in made:
        sup.shutdown()
    for launcher in launchers:
        for proc in launcher.processes.values():
            proc.signal(signal.SIGKILL)
