"""The benchmarks' tokens/s of a run from its step records (``benchmarks._common.steady_rate``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import steady_rate  # noqa: E402


def _records(starts: list[float], written: list[float], tokens: int = 1000) -> list[dict]:
    return [
        {"step": i + 1, "started": s, "time": w, "tokens": tokens}
        for i, (s, w) in enumerate(zip(starts, written, strict=True))
    ]


def test_the_rate_counts_the_steps_between_their_starts_not_their_late_records():
    # steps of 0.2 s; each record is written during the next step, the last one at once: the
    # record times would show 6 steps in 5 intervals (1.2x the true rate)
    starts = [10.0 + 0.2 * i for i in range(8)]
    written = [s + 0.25 for s in starts[:-1]] + [starts[-1] + 0.21]
    rate, span, counted = steady_rate(_records(starts, written), warmup=2)
    assert counted == 5 and span == pytest.approx(1.0)
    assert rate == pytest.approx(5000.0)  # 1000 tokens per 0.2 s


def test_the_warmup_steps_are_left_out():
    starts = [0.0, 5.0, 5.1, 5.2, 5.3]  # a slow first step (compile)
    rate, _, counted = steady_rate(_records(starts, starts), warmup=1)
    assert counted == 3 and rate == pytest.approx(10_000.0)


def test_fewer_than_two_timed_steps_give_no_rate():
    assert steady_rate(_records([0.0, 1.0], [0.5, 1.5]), warmup=1) == (None, None, 0)
    untimed = [{"step": n, "time": float(n), "tokens": 10} for n in range(1, 6)]
    assert steady_rate(untimed, warmup=1) == (None, None, 0)


def test_excluded_steps_such_as_profiled_ones_are_left_out_of_the_rate():
    # step 4 (profiled, its trace written at its end) took 2 s; the others 0.2 s
    starts = [0.0, 0.2, 0.4, 0.6, 2.6, 2.8, 3.0]
    rate, span, counted = steady_rate(_records(starts, starts), warmup=1, exclude={4})
    assert counted == 4 and span == pytest.approx(0.8)
    assert rate == pytest.approx(5000.0)
