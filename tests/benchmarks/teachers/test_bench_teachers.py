"""The teacher-layouts benchmark: its CPU smoke run trains through ``xtoken run`` with a
one-process teacher and a tensor-parallel group of two gloo ranks, and writes one row per layout
with the keys the results file reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.teachers.bench_teachers import layout_of  # noqa: E402

KEYS = {"device", "gpus", "layout", "teacher", "teacher_tp", "teacher_gpus", "trainer_gpus",
        "student", "shape", "mode", "transport", "bytes_per_teacher_token", "tokens_per_s",
        "tokens_per_s_per_gpu", "mfu_e2e", "peak_mem_gib", "teachers"}  # fmt: skip


def test_layouts_split_the_gpus_between_trainer_ranks_and_teacher_groups():
    assert layout_of("coloc-tp2", 4) == {"trainers": 4, "trainer_gpus": [0, 1, 2, 3],
                                         "teachers": 2, "tp": 2, "teacher_gpus": [0, 1, 2, 3]}  # fmt: skip
    assert layout_of("dedicated-tp2", 4) == {"trainers": 2, "trainer_gpus": [0, 1],
                                             "teachers": 1, "tp": 2, "teacher_gpus": [2, 3]}  # fmt: skip
    assert layout_of("dedicated", 4)["teacher_gpus"] == [2, 3]
    with pytest.raises(ValueError, match="unknown layout 'x'"):
        layout_of("x", 4)
    with pytest.raises(ValueError, match="3 GPUs do not divide into groups of 2"):
        layout_of("coloc-tp2", 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_trains_a_one_process_teacher_and_a_tensor_parallel_group(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "teachers" / "bench_teachers.py"),
        "--device", "cpu", "--gpus", "2", "--teacher", "tiny", "--student", "tiny",
        "--teacher-tokenizer", "smollm2", "--student-tokenizer", "mistral",
        "--layouts", "coloc", "coloc-tp2", "--shape", "1x64", "--steps", "2", "--warmup", "1",
        "--transport", "shm", "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["layout"], r["teacher_tp"], r["teachers"]) for r in rows] == [
        ("coloc", 1, 2),
        ("coloc-tp2", 2, 1),
    ]
    for row in rows:
        assert KEYS <= row.keys() and row["error"] is None
        assert row["tokens_per_s"] > 0 and row["bytes_per_teacher_token"] == 2 * 49152
        assert row["rate"] == "step_starts" and row["timed_steps"] >= 1
        assert row["ahead_steps"] == 1  # the default: one step ahead
    for run in ("run_coloc", "run_coloc-tp2"):  # the steps alone: no eval, no last checkpoint
        logs = "".join(p.read_text() for p in (tmp_path / "work" / run / "logs").glob("*.log"))
        assert "[eval]" not in logs and "held-out" not in logs
        assert not (tmp_path / "work" / run / "checkpoints" / "latest").exists()
