"""benchmarks/lanes.py: jobs side by side on lanes, each with its own LANE_OUT and the host's
cores shared, a job past its timeout stopped, one summary line per job, the pack of logs and
rows, and bad settings refused with exit 2; real shell processes on CPU lanes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import lanes  # noqa: E402


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lanes.py"), *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_jobs_run_on_lanes_with_their_own_folder_and_a_share_of_the_cores(tmp_path):
    out, pack = tmp_path / "out", tmp_path / "lanes.tgz"
    row = 'echo "{\\"omp\\": \\"$OMP_NUM_THREADS\\"}" > $LANE_OUT/rows.jsonl; echo done $LANE_OUT'
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = _run("--lanes", "2", "--timeout", "60", "--out", str(out), "--pack", str(pack),
             "--job", row, "--job", row, "--job", "echo bad >&2; exit 3", env=env)  # fmt: skip
    assert p.returncode == 1, p.stderr  # one job failed
    lines = p.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["job0", "job1", "job2"]
    assert "exit 0" in lines[0] and "1 rows" in lines[0] and f"done {out / 'job0'}" in lines[0]
    assert "exit 3" in lines[2] and "bad" in lines[2]
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert json.loads((out / "job1" / "rows.jsonl").read_text()) == {"omp": share}
    with tarfile.open(pack) as tar:
        names = set(tar.getnames())
    assert {"job0.log", "job0/rows.jsonl", "job1/rows.jsonl", "job2.log"} <= names


def test_a_job_past_its_timeout_is_stopped_and_reported_124(tmp_path):
    p = _run("--lanes", "1", "--timeout", "1", "--out", str(tmp_path), "--job", "sleep 30")
    assert p.returncode == 1
    assert "exit 124" in p.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lanes", "1"], "no --job given"),
        (["--gpus", "0", "0", "--job", "true"], "a GPU named twice"),
        (["--gpus", "a", "--job", "true"], "give GPU indices"),
        (["--lanes", "0", "--job", "true"], "--lanes 0: must be >= 1"),
        (["--lanes", "1", "--timeout", "0", "--job", "true"], "--timeout 0.0: must be > 0"),
    ],
)
def test_bad_settings_exit_2_in_one_line(tmp_path, capsys, argv, message):
    assert lanes.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lanes: ") and message in err and "\n" not in err
