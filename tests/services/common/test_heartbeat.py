"""Heartbeats: the file a process's lifecycle rewrites, and the verdict on it (frozen, hung,
healthy), with a real process whose main loop hangs while its heartbeat thread goes on."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.common.heartbeat import (
    HANG_ENV,
    HEARTBEAT_ENV,
    HEARTBEAT_S_ENV,
    Heartbeat,
    read_heartbeat,
    verdict,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]

LOOP = textwrap.dedent(
    """
    import sys
    from services.common.lifecycle import run_process

    def main(lc):
        lc.ready()
        while not lc.stop.wait(0.02):
            lc.progress()

    sys.exit(run_process("svc", main, ready_file=sys.argv[1]))
    """
)


def _start(tmp_path: pathlib.Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LOOP, str(tmp_path / "ready")],
        cwd=ROOT,
        env={
            **os.environ,
            HEARTBEAT_ENV: str(tmp_path / "hb" / "svc"),
            HEARTBEAT_S_ENV: "0.1",
            **env,
        },
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (out := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return out


def test_verdict_tells_frozen_from_hung_from_healthy():
    now = 1000.0
    beat = {"time": now - 0.5, "progress_at": now - 0.6}
    assert verdict(beat, now=now, dead_after_s=2, hang_after_s=5) is None
    frozen = verdict({"time": now - 3}, now=now, dead_after_s=2, hang_after_s=5)
    assert "no heartbeat for 3.0s (dead_after_s=2): frozen" == frozen
    hung = verdict({"time": now, "progress_at": now - 6}, now=now, dead_after_s=2, hang_after_s=5)
    assert hung == "its main loop made no progress for 6.0s (hang_after_s=5): hung"
    # not armed (no progress yet, or paused), or not checked: only the beats count
    assert (
        verdict({"time": now, "progress_at": None}, now=now, dead_after_s=2, hang_after_s=5) is None
    )
    assert (
        verdict({"time": now, "progress_at": 0.0}, now=now, dead_after_s=2, hang_after_s=None)
        is None
    )


def test_a_process_beats_with_its_progress_and_removes_its_file_on_exit(tmp_path):
    proc = _start(tmp_path)
    try:
        path = tmp_path / "hb" / "svc"
        first = _wait(lambda: (r := read_heartbeat(path)) and r["progress"] > 0 and r)
        assert first["pid"] == proc.pid and first["name"] == "svc"
        later = _wait(lambda: (r := read_heartbeat(path)) and r["time"] > first["time"] and r)
        assert later["progress"] > first["progress"] and later["progress_at"] > first["progress_at"]
        assert verdict(later, now=time.time(), dead_after_s=1, hang_after_s=1) is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
    assert not path.exists()


def test_a_hung_main_loop_keeps_beating_and_is_judged_hung_once(tmp_path):
    marker = tmp_path / "hung"
    proc = _start(tmp_path, **{HANG_ENV: f"svc:3:{marker}"})
    try:
        path = tmp_path / "hb" / "svc"
        _wait(marker.exists)
        hung_at = time.time()
        stuck = _wait(lambda: (r := read_heartbeat(path)) and r["time"] > hung_at + 1.0 and r)
        assert stuck["progress"] == 3  # the loop stopped at its 3rd progress call
        assert time.time() - stuck["time"] < 1.0  # ... while the thread goes on beating
        why = verdict(stuck, now=time.time(), dead_after_s=1.0, hang_after_s=0.8)
        assert why is not None and why.endswith("hung")
        assert "main loop hangs now (test fault)" in _stderr_so_far(proc)
    finally:
        proc.kill()
        proc.wait(10)
    # a restart finds the marker and goes on (the fault fires once)
    again = _start(tmp_path, **{HANG_ENV: f"svc:3:{marker}"})
    try:
        path = tmp_path / "hb" / "svc"
        _wait(lambda: (r := read_heartbeat(path)) and r["pid"] == again.pid and r["progress"] > 10)
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(30) == 0


def test_rounds_of_a_wait_on_a_peer_keep_an_armed_hang_check_quiet_without_counting(tmp_path):
    # a trainer polls the queue for its teacher's results while the teacher starts up: each
    # round that returns is alive, though no iteration of the main loop completes
    beat = Heartbeat("svc", tmp_path / "svc", interval_s=0.05).start()
    try:
        beat.waiting()  # not armed yet (loading, or a paused phase): stays unarmed
        assert beat.progress_at is None
        beat.progress()
        armed_at = beat.progress_at
        time.sleep(0.3)
        for _ in range(3):
            beat.waiting()
            time.sleep(0.1)
        last_round = beat.progress_at
        record = _wait(lambda: (r := read_heartbeat(beat.path)) and r["time"] > last_round and r)
        assert record["progress"] == 1 and record["progress_at"] >= armed_at + 0.4
        assert verdict(record, now=time.time(), dead_after_s=1, hang_after_s=0.25) is None
        time.sleep(0.4)  # the rounds stop returning: hung again
        record = read_heartbeat(beat.path)
        why = verdict(record, now=time.time(), dead_after_s=1, hang_after_s=0.25)
        assert why is not None and why.endswith("hung")
        beat.pause()
        beat.waiting()  # a paused check stays paused until the next progress
        assert beat.progress_at is None
    finally:
        beat.close()


def _stderr_so_far(proc: subprocess.Popen) -> str:
    os.set_blocking(proc.stderr.fileno(), False)
    return proc.stderr.read() or ""


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({HEARTBEAT_S_ENV: "soon"}, "XTOKEN_HEARTBEAT_S='soon' is not a number"),
        ({HEARTBEAT_S_ENV: "0"}, "must be > 0"),
        ({HANG_ENV: "svc:x"}, "expected <name>:<n>:<marker file>"),
    ],
)
def test_a_bad_heartbeat_setting_exits_2_naming_it(tmp_path, env, pattern):
    proc = _start(tmp_path, **env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and pattern in err, err
