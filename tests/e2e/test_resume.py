"""``xtoken run`` stopped by Ctrl-C and run again: the resumed run trains the steps an
uninterrupted run would (no empty or NaN step on any rank), every sample once, and keeps the summary's
``student before``."""

from __future__ import annotations

import json
import math
import signal

import pytest

from services.common.metrics import read_jsonl
from tests.e2e.conftest import (
    assert_exactly_once,
    checkpoint_keys,
    corpus_parts,
    key_log_lines,
    keys_after,
    latest_checkpoint,
    step_records,
    tiny_run_config,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_a_run_resumed_after_ctrl_c_trains_the_steps_of_an_uninterrupted_run(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=96, parts=1)
    run_dir = tmp_path / "run"
    config = tiny_run_config(
        run_dir, paths[0], str(demo.heldout_path), projection, schedule={"checkpoint_every": 2}
    )
    per_step = 2 * 4 * 2  # ranks x micro_batch x grad_accum
    steps_in_data = len(corpus) // per_step
    path = write_config(tmp_path / "run.json", config)
    run = procs.start("run", ["run", str(path), "--no-progress"], ready=False)
    wait_for(lambda: len(step_records(run_dir, 0)) >= 2, 180, "two trained steps")
    run.signal(signal.SIGINT, group=True)  # Ctrl-C: every process of the run gets it
    assert run.wait(120) == 0, run.tail()
    checkpoint = latest_checkpoint(run_dir)
    saved = checkpoint_keys(checkpoint)
    stopped_at = int(checkpoint.name.split("_")[1])
    assert 0 < stopped_at < steps_in_data and len(saved) == stopped_at * per_step

    lines = key_log_lines(run_dir)
    metrics_lines = [len(step_records(run_dir, r)) for r in range(2)]
    again = procs.start("run-again", ["run", str(path), "--no-progress"], ready=False)
    assert again.wait(240) == 0, again.tail()

    assert_exactly_once(sorted(saved) + keys_after(run_dir, lines), corpus)
    for rank in range(2):
        resumed = step_records(run_dir, rank)[metrics_lines[rank]:]
        assert [r["step"] for r in resumed] == list(range(stopped_at + 1, steps_in_data + 1))
        assert all(math.isfinite(r["loss"]) for r in resumed), resumed
        keys_log = run_dir / "keys" / f"trainer.rank{rank}.jsonl"
        steps = [r for r in read_jsonl(keys_log)[lines[keys_log.name]:] if r["event"] == "trained"]
        assert [len(r["keys"]) for r in steps] == [per_step // 2] * len(resumed), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == steps_in_data and not summary["stopped"], summary
    assert summary["student_before"]["bits_per_byte"] > 0, summary
