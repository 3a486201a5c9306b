"""The rollout benchmark's CPU smoke run: a row per KV cache kind, no result rows written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_smoke_prints_a_row_per_kv_cache_kind_and_writes_no_rows(tmp_path):
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "e2e" / "bench_rollout.py"),
        "--device", "cpu", "--student", "tiny", "--batch", "2", "--prompt-tokens", "8",
        "--new-tokens", "8", "--batches", "2", "--work", str(tmp_path),
    ]  # fmt: skip
    results = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("e2e_rollout*")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["kv", "cache"])
    rows = [line.split() for line in lines[at + 1 :]]
    assert [r[0] for r in rows] == ["dynamic", "static"]
    assert all(float(r[3]) > 0 for r in rows)  # new tokens/s
    assert all(r[4] == r[5] == "-" for r in rows)  # no device memory on the CPU
    assert {p: p.stat().st_mtime_ns for p in results.glob("e2e_rollout*")} == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_run_on_a_machine_without_one_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e" / "bench_rollout.py"), "--work",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout.strip() == (
        "bench_rollout: --device cuda but this machine has no CUDA device; pass --device cpu"
    )
