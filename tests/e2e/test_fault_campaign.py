"""A small random-fault campaign (benchmarks/faults/campaign.py): real runs, each with a SIGKILL
of a process drawn from the run's seed at a moment drawn from it, and every text trained exactly
once by the final student, the run ending 0 with no traceback and no process left.

``XTOKEN_FAULT_RUNS`` (default 3) sets the runs, ``XTOKEN_FAULT_SEED`` (default 1: a trainer rank
before the first checkpoint, the queue, the teacher as it starts) the campaign's seed,
``XTOKEN_FAULT_JOBS`` (default 1) the runs at once; about 90 s a run on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import CHILD_ENV, ROOT

RUNS = int(os.environ.get("XTOKEN_FAULT_RUNS", "3"))
SEED = int(os.environ.get("XTOKEN_FAULT_SEED", "1"))
JOBS = int(os.environ.get("XTOKEN_FAULT_JOBS", "1"))


@pytest.mark.slow
@pytest.mark.timeout(120 + 500 * RUNS // JOBS)
def test_random_kills_lose_no_sample_and_train_none_twice(tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = [
        sys.executable, str(ROOT / "benchmarks" / "faults" / "campaign.py"),
        "--runs", str(RUNS), "--seed", str(SEED), "--jobs", str(JOBS),
        "--root", str(tmp_path / "runs"), "--out", str(out), "--md", "-", "--keep",
    ]  # fmt: skip
    env = {**os.environ, **CHILD_ENV}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert len(rows) == RUNS, done.stdout + done.stderr

    def show(r: dict) -> str:
        return (f"run {r['run']} (seed {r['seed']}) {r['victim']} at {r['moment']}: "
                f"{r['outcome']}; missing {r.get('missing_keys')}, twice {r.get('twice_keys')}, "
                f"{r.get('run_dir')}")  # fmt: skip

    assert all(r.get("landed") for r in rows), "\n".join(map(show, rows))
    assert sum(r.get("missing", 1) for r in rows) == 0, "\n".join(map(show, rows))
    assert sum(r.get("twice", 1) for r in rows) == 0, "\n".join(map(show, rows))
    assert all(r["outcome"] == "ok" for r in rows), "\n".join(map(show, rows))
    assert done.returncode == 0, done.stdout[-4000:]
