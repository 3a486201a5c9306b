"""The loss-spread diagnostic on the CPU: one row per case, heat included."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_smoke_prints_one_row_per_fresh_case_and_the_spread_of_their_medians():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "losses" / "bench_kd_spread.py"),
        "--smoke",
        "--cases",
        "3",
        "--heat",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    medians = [float(row[1]) for row in rows]
    assert all(m > 0 for m in medians)
    low, high, spread = map(
        float,
        re.fullmatch(
            r"medians (\S+)-(\S+) ms, spread (\S+)", proc.stdout.strip().splitlines()[-1]
        ).groups(),
    )
    assert (low, high) == (min(medians), max(medians))
    assert abs(spread - (high - low)) <= 0.0015
