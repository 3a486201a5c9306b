"""The scaling plot's choice of the collector A/B rows (benchmarks/e2e/plot_scaling.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e.plot_scaling import gc_rows, plot_gc  # noqa: E402


def _row(tag: str, commit: str, time: str, ranks: int, series: bool = True) -> dict:
    stalls = {
        str(r): {"steps": [5, 6], "step_ms": [100.0, 650.0], "gc_ms": [0.0, 540.0]}
        if series
        else {"median_ms": 100.0}
        for r in range(ranks)
    }
    return {
        "tag": tag,
        "commit": commit,
        "time": time,
        "trainers": ranks,
        "mode": "pkl",
        "shape": "1x4096",
        "device": "GPU",
        "pipeline": {"tokens_per_s": 1000.0, "stalls_by_rank": stalls},
    }


def test_the_collector_rows_of_the_newest_commit_with_per_step_series_are_drawn():
    rows = [
        _row("two-gpu-gc50", "old", "2026-01-01", 2),
        _row("two-gpu-gc50", "new", "2026-02-01", 1),
        _row("two-gpu-gc0", "new", "2026-02-01", 2),
        _row("two-gpu-gc0", "newer", "2026-03-01", 2, series=False),  # no series: not drawable
        _row("two-gpu", "newest", "2026-04-01", 2),  # another tag
    ]
    picked = gc_rows(rows)
    assert {(r["tag"], r["commit"], r["trainers"]) for r in picked} == {
        ("two-gpu-gc50", "new", 1),
        ("two-gpu-gc0", "new", 2),
    }
    assert gc_rows([_row("two-gpu", "c", "t", 2)]) == []


def test_the_collector_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("two-gpu-gc50", "c", "t", 1), _row("two-gpu-gc0", "c", "t", 2)]
    path = plot_gc(rows, tmp_path / "gc.png")
    assert path.stat().st_size > 10_000
