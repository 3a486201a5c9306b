"""The CPU smoke run of a benchmark script: it exits 0, prints its table and writes no result
rows (the e2e benchmarks' tests share it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_smoke(script: str, args: list[str], header: str, results: str, timeout: float):
    """Run ``benchmarks/e2e/<script>`` with ``args``; the split rows of the table printed under
    the line starting with ``header`` (its first two words).

    Args:
        script: the benchmark's file name.
        args: its command-line arguments.
        header: the first two words of the table's header line.
        results: the glob of its result files in ``benchmarks/results`` (left untouched).
        timeout: seconds the run may take.
    """
    out = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in out.glob(results)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e" / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in out.glob(results)} == before
    lines = proc.stdout.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == header.split())
    return [line.split() for line in lines[at + 1 :]]
