"""The on-policy benchmark's CPU smoke run: a row per fraction, the on-policy figures where the
fraction is above 0, nothing written to the results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_prints_a_row_per_fraction_with_the_rollouts_figures(tmp_path):
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "e2e" / "bench_on_policy.py"),
        "--device", "cpu", "--student", "tiny", "--teacher", "tiny",
        "--student-tokenizer", "mistral", "--teacher-tokenizer", "smollm2",
        "--student-vocab", "0", "--teacher-vocab", "0", "--shape", "2x64",
        "--prompt-tokens", "16", "--new-tokens", "16", "--rollout-batch", "4",
        "--fractions", "0", "0.5", "--steps", "4", "--warmup", "1", "--work", str(tmp_path),
    ]  # fmt: skip
    results = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("e2e_on_policy*")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["lambda", "tok/s"])
    rows = [line.split() for line in lines[at + 1 :]]
    assert [r[0] for r in rows] == ["0", "0.5"]
    assert rows[0][4] == "-" and rows[1][4].endswith("%")  # the wait for rollouts: lambda 0.5
    # generated tokens/s while sampling (a batch put after the warm-up), and over the puts' span
    # where two batches fell in the measured steps (one rollout batch serves several steps)
    assert float(rows[1][6]) > 0
    assert rows[1][5] == "-" or float(rows[1][5]) > 0
    assert {p: p.stat().st_mtime_ns for p in results.glob("e2e_on_policy*")} == before
