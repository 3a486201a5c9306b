"""The process lifecycle, in real subprocesses: exit codes, signals, dead parent, ready file."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.common.lifecycle import Lifecycle, configure_logging, read_ready

ROOT = pathlib.Path(__file__).resolve().parents[3]

# A service main: ready, wait for the stop, "drain", write what stopped it.
SERVICE = """
import pathlib, sys, time
from services.common.lifecycle import run_process

out = pathlib.Path(sys.argv[1])

def main(lc):
    lc.ready(endpoint="tcp://127.0.0.1:1")
    while not lc.wait(0.05):
        pass
    time.sleep(0.2)  # drain
    out.write_text(str(lc.reason))

sys.exit(run_process("svc", main, ready_file=sys.argv[2]))
"""


def _python(code: str, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _exit_of(body: str) -> tuple[int, str]:
    code = f"""
import sys
from services.common.lifecycle import run_process
def main(lc):
{textwrap.indent(textwrap.dedent(body), "    ")}
sys.exit(run_process("svc", main))
"""
    proc = _python(code)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_a_normal_return_exits_zero_and_an_int_passes_through():
    assert _exit_of("return None")[0] == 0
    assert _exit_of("return 3")[0] == 3


def test_a_value_error_before_ready_exits_two_with_the_message_and_no_traceback():
    code, err = _exit_of("raise ValueError('lr=-1: must be > 0 (--lr)')")
    assert code == 2
    assert "[svc] error: lr=-1: must be > 0 (--lr)" in err
    assert "Traceback" not in err


def test_a_value_error_once_the_process_serves_is_a_fault_exit_one_with_its_traceback():
    # reading a run's own file mid-run (a damaged descriptor): a restart may cure it
    code, err = _exit_of(
        """
        lc.ready()
        b"\\xb6".decode("utf-8")
        """
    )
    assert code == 1
    assert "[svc] failed: UnicodeDecodeError" in err and "Traceback" in err


@pytest.mark.parametrize("ready", [False, True], ids=["at start-up", "once serving"])
def test_a_settings_error_exits_two_and_a_data_error_three_whenever_raised(ready):
    first = "lc.ready()\n" if ready else ""
    for cls, want in (("SettingsError", 2), ("DataError", 3)):
        code, err = _exit_of(
            f"from xtoken_core.errors import {cls}\n{first}raise {cls}('the cause; the fix')"
        )
        assert code == want, err
        assert "[svc] error: the cause; the fix" in err and "Traceback" not in err


def test_a_config_error_is_a_value_error():
    code, err = _exit_of(
        "from services.common.config import from_dict, ConfigError\n"
        "from services.common.lifecycle import Lifecycle\n"
        "import dataclasses\n"
        "from_dict(dataclasses.make_dataclass('C', [('a', int)]), {'b': 1})"
    )
    assert code == 2 and "[svc] error: unknown key 'b'" in err and "Traceback" not in err


def test_any_other_exception_exits_one_with_its_traceback():
    code, err = _exit_of("raise RuntimeError('boom')")
    assert code == 1
    assert "[svc] failed: RuntimeError: boom" in err and "Traceback" in err


def test_a_bad_log_level_exits_two():
    proc = _python(
        "import sys; from services.common.lifecycle import run_process; "
        "sys.exit(run_process('svc', lambda lc: 0, log_level='LOUD'))"
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "log level 'LOUD'" in err and "DEBUG" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_sets_stop_and_exits_zero_after_the_drain(tmp_path, signum):
    ready, out = tmp_path / "ready.json", tmp_path / "out"
    proc = _python(SERVICE, str(out), str(ready))
    try:
        _wait_for(lambda: ready.exists() or proc.poll() is not None, what="the ready file")
        record = read_ready(ready)
        assert record == {"pid": proc.pid, "name": "svc", "endpoint": "tcp://127.0.0.1:1"}
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.read_text() == signum.name
    assert f"[svc] {signum.name}: stopping" in err and "[svc] ready: endpoint=" in err
    assert not ready.exists(), "the ready file outlived the process"


def test_a_second_sigint_interrupts_the_drain(tmp_path):
    code = """
import sys, time
from services.common.lifecycle import run_process
def main(lc):
    lc.ready()
    lc.wait()
    time.sleep(60)  # a drain that never ends
sys.exit(run_process("svc", main, ready_file=sys.argv[1]))
"""
    ready = tmp_path / "ready.json"
    proc = _python(code, str(ready))
    try:
        _wait_for(ready.exists, what="the ready file")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "[svc] interrupted" in err


# The parent: starts SERVICE with XTOKEN_PARENT_PID set, prints the child's pid, then waits.
PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "XTOKEN_PARENT_PID": sys.argv[4]}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], env=env)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("direct", [True, False], ids=["prctl", "watcher"])
def test_a_process_stops_when_its_parent_dies(tmp_path, direct):
    """direct: the watched pid is the real parent (PR_SET_PDEATHSIG); otherwise another process
    is named as the parent and the watcher thread notices it is gone."""
    ready, out = tmp_path / "ready.json", tmp_path / "out"
    other = None if direct else subprocess.Popen(["sleep", "600"])
    watched = "self" if direct else str(other.pid)
    code = PARENT.replace("sys.argv[4]", "str(os.getpid())" if direct else "sys.argv[4]")
    parent = _python(code, SERVICE, str(out), str(ready), watched)
    try:
        child_pid = int(parent.stdout.readline())
        _wait_for(ready.exists, what="the ready file")
        assert read_ready(ready)["pid"] == child_pid
        victim = parent if direct else other
        victim.kill()
        victim.wait()
        _wait_for(out.exists, timeout=15, what="the child to stop")
    finally:
        for p in (parent, other):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    reason = out.read_text()
    assert reason.startswith("parent ") and " died" in reason, reason
    if direct:  # the kernel's SIGTERM came first, not the watcher's next poll
        assert reason.endswith("died (SIGTERM)"), reason
    _wait_for(lambda: not ready.exists(), timeout=15, what="the child to exit")


def test_a_malformed_parent_pid_variable_is_a_config_error():
    proc = _python(
        "import sys; from services.common.lifecycle import run_process; "
        "sys.exit(run_process('svc', lambda lc: 0))",
        env={"XTOKEN_PARENT_PID": "abc"},
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "XTOKEN_PARENT_PID='abc'" in err


def test_ready_writes_an_atomic_json_record_and_rejects_reserved_keys(tmp_path):
    path = tmp_path / "sub" / "ready"
    lc = Lifecycle("unit", ready_file=path, parent_pid=None)
    assert read_ready(path) is None
    record = lc.ready(endpoint="ipc:///x", gpus=[0, 1])
    assert json.loads(path.read_text()) == record
    assert record == {"pid": os.getpid(), "name": "unit", "endpoint": "ipc:///x", "gpus": [0, 1]}
    assert [p.name for p in path.parent.iterdir()] == ["ready"]  # no temp file left
    with pytest.raises(ValueError, match="pid"):
        lc.ready(pid=3)


def test_read_ready_rejects_a_file_that_is_not_a_ready_record(tmp_path):
    path = tmp_path / "ready"
    path.write_text("tcp://127.0.0.1:5555\n")
    with pytest.raises(ValueError, match="not a ready file"):
        read_ready(path)


def test_install_removes_a_stale_ready_file_and_close_restores_the_handlers(tmp_path):
    path = tmp_path / "ready"
    path.write_text(json.dumps({"pid": 1, "name": "old"}))
    before = signal.getsignal(signal.SIGTERM)
    with Lifecycle("unit", ready_file=path, parent_pid=None) as lc:
        assert not path.exists()
        assert signal.getsignal(signal.SIGTERM) == lc._on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        assert lc.wait(5) and lc.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


def test_log_lines_carry_their_component_tag(capsys):
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), [h.formatter for h in root.handlers])
    try:
        configure_logging("tagger", "INFO")
        logging.getLogger("some.library").info("plain line")
        logging.getLogger("services.x").info("[other] tagged line")
        err = capsys.readouterr().err
    finally:
        for h in list(root.handlers):
            if h not in saved[1]:
                root.removeHandler(h)
        for h, f in zip(saved[1], saved[2]):
            h.setFormatter(f)
        root.setLevel(saved[0])
    assert "INFO [tagger] plain line" in err
    assert "INFO [other] tagged line" in err and "[tagger] [other]" not in err
