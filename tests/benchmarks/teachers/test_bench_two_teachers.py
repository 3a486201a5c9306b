"""The two-teacher benchmark: its CPU smoke run trains one tiny student with teacher A alone,
teacher B (another tokenizer family) alone and both, through ``xtoken run``, and writes a row per
run, the two-teacher row with its ratios to each single-teacher run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_runs_each_teacher_alone_then_both_and_writes_their_ratios(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "teachers" / "bench_two_teachers.py"),
        "--device", "cpu", "--teacher-a", "tiny:smollm2", "--teacher-b", "tiny:deepseek",
        "--student", "tiny", "--shape", "1x64", "--steps", "2", "--warmup", "1",
        "--transport", "shm", "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["teachers"] for r in rows] == [
        ["tiny:smollm2"],
        ["tiny:deepseek"],
        ["tiny:smollm2", "tiny:deepseek"],
    ]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows)
    a, b, both = (r["tokens_per_s"] for r in rows)
    assert rows[2]["vs_a"] == pytest.approx(both / a) and rows[2]["vs_b"] == pytest.approx(both / b)
    assert rows[2]["vs_serial"] == pytest.approx(both * (1 / a + 1 / b))


def test_a_teacher_without_its_tokenizer_is_refused_naming_the_form():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "teachers" / "bench_two_teachers.py"),
         "--teacher-a", "qwen2.5-7b"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert "give a teacher as MODEL:TOKENIZER" in done.stderr
