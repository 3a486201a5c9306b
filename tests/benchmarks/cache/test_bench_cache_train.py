"""The cache-training benchmark: its CPU smoke run builds a cache of a tiny teacher, trains the
same student online and from the cache through ``xtoken run``, and writes one row with the keys
the results file reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"device", "teacher", "student", "shape", "mode", "k", "bytes_per_teacher_token",
        "build_tokens_per_s", "tokens_per_s_online", "tokens_per_s_cached",
        "speedup_vs_online"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_trains_online_and_from_the_cache_and_writes_a_row(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "cache" / "bench_cache_train.py"),
        "--device", "cpu", "--teacher", "tiny", "--student", "tiny",
        "--teacher-tokenizer", "smollm2", "--shape", "1x64", "--k", "8", "--steps", "2",
        "--warmup", "1", "--transport", "shm", "--work", str(tmp_path / "work"), "--out", str(out),
        "--vocab-topk", "all",  # P-KL over every column, as top-K targets call for
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert KEYS <= set(row) and row["error"] is None
    assert row["tokens_per_s_online"] > 0 and row["tokens_per_s_cached"] > 0
    assert 0 < row["bytes_per_teacher_token"] < 4 * 8 + 16  # far below the full logits' bytes
    assert row["vocab_topk"] == "all"
    assert row["student_vocab"] % 128 == 0  # a preset's output layer, rounded up
    for arm in ("online", "cached"):  # where each arm's steps went
        assert {"forward", "loss", "backward", "optimizer"} <= set(row[f"split_ms_{arm}"])
