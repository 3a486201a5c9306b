"""The rollout benchmark's CPU smoke run: a row per KV cache kind, no result rows written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.e2e.smoke import run_smoke  # noqa: E402


def test_cpu_smoke_prints_a_row_per_kv_cache_kind_and_writes_no_rows(tmp_path):
    rows = run_smoke(
        "bench_rollout.py",
        ["--device", "cpu", "--student", "tiny", "--batch", "2", "--prompt-tokens", "8",
         "--new-tokens", "8", "--batches", "2", "--work", str(tmp_path)],
        "kv cache", "e2e_rollout*", timeout=300,
    )  # fmt: skip
    assert [r[0] for r in rows] == ["dynamic", "static"]
    assert all(float(r[3]) > 0 for r in rows)  # new tokens/s
    assert all(r[4] == r[5] == "-" for r in rows)  # no device memory on the CPU


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
