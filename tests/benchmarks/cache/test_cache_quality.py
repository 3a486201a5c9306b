"""The cache-against-online quality table (benchmarks/cache/cache_quality.py): each cache arm is
paired by seed with its online top-K twin of the same K and family, per student, and judged
against the online arm's seed spread; rows made up here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.cache import cache_quality  # noqa: E402

Q = "qwen2.5-coder-0.5b"


def _row(arm: str, seed: int, bpb: float, student: str = "smollm2:drop=10-19") -> dict:
    return {
        "phase": "final",
        "arm": arm,
        "family": arm.partition(":")[0],
        "seed": seed,
        "teachers": [Q],
        "student": student,
        "student_tokenizer": "smollm2" if student.startswith("smollm2") else "deepseek",
        "validation_bpb": bpb,
        "heldout_bpb": bpb,
        "fresh_bpb": bpb + 0.5,
        "completion_teacher_bpb": None,
        "next_line_em": None,
        "device": "NVIDIA H200",
        "commit": "abc1234",
        "tokens": 2_000_000,
    }


def _arms(cache: list[float], online: list[float], k: int = 32, **kw) -> list[dict]:
    return [_row(f"pkl@{Q}:cache={k}", s, v, **kw) for s, v in enumerate(cache)] + [
        _row(f"pkl@{Q}:topk={k}", s, v, **kw) for s, v in enumerate(online)
    ]


def test_a_cache_arm_is_paired_by_seed_with_its_online_twin_and_judged_by_its_spread():
    pairs = cache_quality.compare(_arms([0.741, 0.745, 0.739], [0.740, 0.744, 0.742]))
    (pair,) = pairs
    assert (pair["mode"], pair["k"], pair["teacher"]) == ("pkl", 32, Q)
    assert pair["online_arm"] == f"pkl@{Q}:topk=32" and pair["seeds"] == [0, 1, 2]
    held = pair["splits"]["heldout"]
    assert held["delta"] == pytest.approx((0.001 + 0.001 - 0.003) / 3)
    assert held["within"] and held["ci_spans_zero"]


def test_a_difference_beyond_twice_the_online_spread_is_not_within_the_noise():
    (pair,) = cache_quality.compare(_arms([0.760, 0.761, 0.762], [0.740, 0.741, 0.742]))
    held = pair["splits"]["heldout"]
    assert held["delta"] == pytest.approx(0.020)
    assert not held["within"] and not held["ci_spans_zero"]
    (row,) = cache_quality.result_rows([pair])
    assert row["quality_delta"]["heldout"] == pytest.approx(0.02)
    assert row["within_2sd"] is False and row["ci95_spans_zero"] is False


def test_students_are_compared_apart_and_a_twin_of_another_k_is_no_twin():
    rows = _arms([0.74, 0.75], [0.74, 0.75]) + _arms(
        [1.57, 1.58], [1.57, 1.59], student="student-25m"
    )
    rows += [_row(f"pkl@{Q}:cache=64", s, 0.7) for s in (0, 1)]  # no topk=64 twin
    pairs = cache_quality.compare(rows)
    assert sorted((p["student"], p["k"]) for p in pairs) == [
        ("smollm2:drop=10-19", 32),
        ("student-25m", 32),
    ]


def test_rows_without_a_pair_exit_2_with_one_line(tmp_path, capsys):
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in _arms([0.7, 0.7], [])[:2]))
    assert cache_quality.main([str(f)]) == 2
    assert "no cache arm" in capsys.readouterr().err


def test_the_table_and_the_results_rows_are_written(tmp_path, capsys):
    f, out = tmp_path / "rows.jsonl", tmp_path / "teacher_cache.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in _arms([0.74, 0.75], [0.745, 0.748])))
    assert cache_quality.main([str(f), "--results", str(out)]) == 0
    assert "| smollm2:drop=10-19 (smollm2) | pkl | heldout |" in capsys.readouterr().out
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["bench"] == "teacher_cache_quality" and row["seeds"] == [0, 1]
