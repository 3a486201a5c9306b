"""The student CE benchmark's CPU smoke run: one row per shape, kernels agreeing with the reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_smoke_prints_one_row_per_shape_with_the_kernels_matching_the_reference(tmp_path):
    pytest.importorskip("triton")
    results = tmp_path / "ce.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "losses" / "bench_ce.py"),
        "--device",
        "cpu",
        "--reps",
        "1",
        "--results",
        str(results),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, *rows = [line.split() for line in proc.stdout.strip().splitlines()]
    assert header[:3] == ["B", "T", "V"] and len(rows) == 2
    cols = {name: i for i, name in enumerate(header)}
    for row in rows:
        assert float(row[cols["loss_rel_diff"]]) <= 1e-3
        assert float(row[cols["grad_cosine"]]) >= 0.999
        assert row[cols["correct_equal"]] == "True"
    assert not results.exists()  # CPU rows are not results
