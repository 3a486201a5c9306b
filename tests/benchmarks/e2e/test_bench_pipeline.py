"""The pipeline benchmark's per-rank stall summary, from step records."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e.bench_pipeline import step_stalls  # noqa: E402


def _step(n: int, ms: float, gc_s: float = 0.0, gc_full: int = 0) -> dict:
    return {"step": n, "step_s": ms / 1000, "gc_s": gc_s, "gc_full": gc_full}


def test_steps_over_three_medians_are_named_with_the_collections_inside_them():
    rows = [_step(n, 100.0) for n in range(1, 10)]
    rows += [_step(10, 650.0, gc_s=0.55, gc_full=1), _step(11, 310.0), _step(12, 290.0)]
    out = step_stalls(rows)
    assert out["median_ms"] == 100.0 and out["slowest_ms"] == 650.0
    assert out["slow_steps"] == [10, 11]  # 290 ms is under 3 x 100
    assert out["gc_s"] == 0.55 and out["gc_full"] == 1 and out["gc_full_in_slow_steps"] == 1
    # the per-step series the plot of a run draws
    assert out["steps"] == list(range(1, 13)) and out["step_ms"][9] == 650.0
    assert out["gc_ms"][9] == 550.0 and sum(out["gc_ms"]) == 550.0


def test_records_without_collector_figures_count_none():
    rows = [{"step": n, "step_s": 0.1} for n in range(1, 4)]
    assert step_stalls(rows)["gc_full"] == 0 and step_stalls(rows)["slow_steps"] == []
