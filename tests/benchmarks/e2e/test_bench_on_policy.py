"""The on-policy benchmark: its CPU smoke run (a row per KV cache kind and fraction, the
on-policy figures where the fraction is above 0, nothing written to the results) and its rollout
rates from metrics files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e import bench_on_policy as bench  # noqa: E402
from tests.benchmarks.e2e.smoke import run_smoke  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_prints_a_row_per_kv_cache_and_fraction_with_the_rollouts_figures(tmp_path):
    rows = run_smoke(
        "bench_on_policy.py",
        ["--device", "cpu", "--student", "tiny", "--teacher", "tiny",
         "--student-tokenizer", "mistral", "--teacher-tokenizer", "smollm2",
         "--student-vocab", "0", "--teacher-vocab", "0", "--shape", "2x64",
         "--prompt-tokens", "16", "--new-tokens", "16", "--rollout-batch", "4",
         "--fractions", "0", "0.5", "--kv-cache", "dynamic", "static", "--steps", "4",
         "--warmup", "1", "--work", str(tmp_path)],
        "kv lambda", "e2e_on_policy*", timeout=880,
    )  # fmt: skip
    assert [r[:2] for r in rows] == [["dynamic", "0"], ["dynamic", "0.5"], ["static", "0"],
                                     ["static", "0.5"]]  # fmt: skip
    for off, on in (rows[0], rows[1]), (rows[2], rows[3]):
        assert off[5] == "-" and on[5].endswith("%")  # the wait for rollouts: lambda 0.5
        # generated tokens/s while sampling (a batch put after the warm-up), and over the puts'
        # span where two batches fell in the measured steps (one batch serves several steps)
        assert float(on[7]) > 0
        assert on[6] == "-" or float(on[6]) > 0


def _rollout_records(run_dir, worker, records):
    path = run_dir / "metrics" / f"rollout{worker}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"event": "rollout", **r}) + "\n" for r in records))


def test_workers_that_filled_ahead_before_the_window_still_give_their_sampling_rate(tmp_path):
    """At fraction 0.5 a batch of 64 serves the measured steps: no batch is put inside the window,
    and the rate while sampling comes from the run's batches (it was missing from the row)."""
    batch = {"sample_s": 9.0, "collate_s": 1.0, "generated_tokens": 20_000, "samples": 64}
    _rollout_records(tmp_path, 0, [{"time": 5.0, **batch}])
    _rollout_records(tmp_path, 1, [{"time": 6.0, **batch}])
    got = bench._generation(tmp_path, rollouts=2, since=100.0)
    assert got["rollout_batches"] == 0 and got["generated_tokens_per_s"] is None
    assert got["generated_tokens_per_s_sampling"] == pytest.approx(40_000 / 10.0)
    assert got["sampling_rate_over"] == "whole run"


def test_batches_inside_the_window_give_the_rate_over_their_span(tmp_path):
    batch = {"sample_s": 4.0, "collate_s": 1.0, "generated_tokens": 10_000, "samples": 32}
    _rollout_records(tmp_path, 0, [{"time": t, **batch} for t in (1.0, 10.0, 15.0, 20.0)])
    got = bench._generation(tmp_path, rollouts=1, since=5.0)
    assert got["rollout_batches"] == 3
    assert got["generated_tokens_per_s"] == pytest.approx(20_000 / 10.0)  # after the first put
    assert got["generated_tokens_per_s_sampling"] == pytest.approx(30_000 / 15.0)
