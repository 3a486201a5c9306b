"""bench_topk_columns: a CPU smoke run on one text prints its table row (distinct ids sent, kept
columns shared with the full logits' pick, the gradient errors of each reading) and writes no
rows with --no-write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_a_cpu_smoke_run_prints_the_column_study_row_and_writes_nothing(tmp_path):
    results = ROOT / "benchmarks" / "results" / "teachers_topk_columns.jsonl"
    before = results.read_bytes() if results.exists() else None
    proc = subprocess.run(
        [sys.executable, "benchmarks/teachers/bench_topk_columns.py", "--texts", "1", "--ks", "8",
         "--no-write"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, row = proc.stdout.strip().splitlines()[-2:]
    assert header.split()[:3] == ["K", "distinct_ids_sent", "kept_as_reference"]
    k, sent, kept, spread, nothing, cap, every = row.split()
    assert k == "8" and 0 < int(sent) and 0 <= int(kept) <= 8192
    assert float(every) < float(spread)  # every column is the close reading
    assert (results.read_bytes() if results.exists() else None) == before
