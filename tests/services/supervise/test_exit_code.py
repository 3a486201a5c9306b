"""Exit codes of processes a re-attached driver did not start: each process writes its code to
RUN_DIR/exit/<name>.code as it exits (the lifecycle); the driver reads it, so a finished collator
is done (never restarted) and a deterministic failure (exit 2 or 3) fails the run at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.lifecycle import EXIT_FILE_ENV, read_exit_code
from services.launch.local import LocalLauncher
from services.supervise.attach import EXIT_UNKNOWN, AttachedProcess
from services.supervise.config import run_config_from_dict
from services.supervise.driver import Driver
from services.supervise.policy import RestartPolicy

ROOT = Path(__file__).resolve().parents[3]

# a service process under the one lifecycle whose main ends as argv[1] says
_CHILD = textwrap.dedent(
    """
    import sys
    from services.common.lifecycle import run_process

    def main(lc):
        if sys.argv[1] == "config":
            raise ValueError("bad value")
        return int(sys.argv[1])

    sys.exit(run_process("child", main))
    """
)


def _run_child(outcome: str, exit_file: Path) -> tuple[int, int | None]:
    """Run the child to its end; returns its pid (reaped: only the file tells its code)."""
    env = {**os.environ, EXIT_FILE_ENV: str(exit_file)}
    env.pop("XTOKEN_PARENT_PID", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, outcome], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert exit_file.is_file(), proc.stderr.decode()
    return proc.returncode, read_exit_code(exit_file)


def test_a_process_writes_its_exit_code_as_it_exits(tmp_path):
    for outcome, code in (("0", 0), ("config", 2), ("3", 3)):
        path = tmp_path / "exit" / f"{outcome}.code"
        assert _run_child(outcome, path) == (code, code)


def _reattached_driver(tmp_path: Path, max_restarts: int = 2) -> Driver:
    """A driver rebuilt as after a control-plane restart (no process of its own started)."""
    config = run_config_from_dict(
        {"run_dir": str(tmp_path / "run"), "max_restarts": max_restarts, "restart_backoff_s": 0}
    )
    driver = Driver(config, launcher=_Launcher(), progress=False)
    inputs = {"train": "train.jsonl", "heldout": "heldout.jsonl", "projection": "proj.pt"}
    driver.restore(
        {"queue": "tcp://127.0.0.1:1", "master_port": 1, "segment_started": 0.0, "inputs": inputs}
    )
    return driver


class _Launcher:
    """Records starts; holds the re-attached processes."""

    def __init__(self) -> None:
        self.processes: dict[str, object] = {}
        self.started: list[str] = []

    def start(self, spec):
        self.started.append(spec.name)

    def stop(self, names=None, grace_s=0.0):
        return {}


def _ended_unseen(driver: Driver, name: str, outcome: str) -> None:
    """Run process ``name`` for real to its end with the driver's exit file, then hand it to the
    driver as attach_run does for a recorded process found gone."""
    spec = driver.specs[name]
    assert spec.env[EXIT_FILE_ENV] == str(driver.run_dir / "exit" / f"{name}.code")
    env_file = Path(spec.env[EXIT_FILE_ENV])
    _run_child(outcome, env_file)
    pid = _pid_written(env_file)
    gone = AttachedProcess(spec, pid, 0)
    gone._code = EXIT_UNKNOWN
    driver.launcher.processes[name] = gone


def _pid_written(path: Path) -> int:
    import json

    return json.loads(path.read_text())["pid"]


def test_a_collator_that_finished_unseen_is_done_not_restarted(tmp_path, monkeypatch):
    driver = _reattached_driver(tmp_path)
    eof = []
    monkeypatch.setattr(driver, "_put_eof", lambda: eof.append(True))
    _ended_unseen(driver, "collator", "0")
    assert driver.poll_once() == "running"
    assert "collator" in driver.finished and eof == [True]
    assert driver.launcher.started == [] and driver.failed is None


@pytest.mark.parametrize(
    ("name", "outcome", "code"), [("collator", "3", 3), ("teacher0", "config", 2)]
)
def test_a_deterministic_failure_fails_the_run_without_a_restart(tmp_path, name, outcome, code):
    driver = _reattached_driver(tmp_path)
    _ended_unseen(driver, name, outcome)
    assert driver.poll_once() == "failed"
    assert driver.failed.exit_code == code and driver.failed.process == name
    assert "not restarted" in driver.failed.reason
    assert driver.launcher.started == []


def test_an_exit_code_of_another_pid_is_not_taken(tmp_path):
    driver = _reattached_driver(tmp_path)
    _ended_unseen(driver, "teacher0", "0")
    driver.launcher.processes["teacher0"]._pid += 1  # a later process of that name
    assert driver.poll_once() == "recovering"  # unknown code: restarted per policy
    assert driver.failed is None


def test_a_restart_clears_the_predecessors_exit_code(tmp_path):
    driver = _reattached_driver(tmp_path)
    path = driver.exit_file("teacher0")
    path.parent.mkdir(parents=True)
    path.write_text('{"pid": 1, "code": 0}')
    driver._start(driver.specs["teacher0"])
    assert not path.exists() and driver.launcher.started == ["teacher0"]


def test_exit_codes_2_and_3_are_never_retried_and_others_are():
    policy = RestartPolicy(max_restarts=3)
    for code in (2, 3):
        assert policy.decide("collator", "collator", code).action == "fail"
    assert policy.decide("collator", "collator", 1).action == "restart"
    assert policy.decide("teacher0", "teacher", -9).action == "restart"


# a service that serves, then meets an error of the kind argv[2] names
_SERVING = textwrap.dedent(
    """
    import sys
    from services.common.lifecycle import run_process
    from xtoken_core.errors import DataError

    def main(lc):
        lc.ready()
        if sys.argv[2] == "data":
            raise DataError("corpus.jsonl:7 is not JSON: fix the line or skip it (skip_bad_lines)")
        b"\\xb6".decode("utf-8")  # a run's own file found damaged mid-run

    sys.exit(run_process(sys.argv[1], main))
    """
)


class _Serving(LocalLauncher):
    """The local launcher, its processes playing :data:`_SERVING`."""

    def __init__(self, error: str) -> None:
        super().__init__(parent_sentinel=False)
        self.error = error

    def command(self, spec):
        return [sys.executable, "-c", _SERVING, spec.name, self.error]


def _run_to_its_exit(tmp_path: Path, error: str) -> tuple[Driver, str]:
    driver = _reattached_driver(tmp_path)
    driver.launcher = _Serving(error)
    proc = driver._start(driver.specs["teacher0"])
    try:
        proc.popen.wait(60)
        return driver, driver.poll_once()
    finally:
        driver.launcher.stop(grace_s=5)


def test_a_data_error_mid_run_fails_the_run_with_the_processs_one_line_message(tmp_path):
    driver, status = _run_to_its_exit(tmp_path, "data")
    assert status == "failed" and driver.failed.exit_code == 3
    assert driver.failed.reason == (
        "teacher0 exited with code 3 (bad data: a restart would fail the same way; not "
        "restarted): corpus.jsonl:7 is not JSON: fix the line or skip it (skip_bad_lines)"
    )
    assert "\n" not in driver.failed.reason


def test_a_value_error_mid_run_is_a_fault_the_process_is_restarted(tmp_path):
    driver, status = _run_to_its_exit(tmp_path, "damaged file")
    assert status == "recovering" and driver.failed is None
    assert driver.launcher.processes["teacher0"].poll() == 1
    assert "UnicodeDecodeError" in driver.launcher.processes["teacher0"].tail()
