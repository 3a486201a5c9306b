"""Rank 0's metrics series read as the trainer appends to its file: tokens seen along the run's
trajectory (a replay after a restart counts once), thinning that keeps the latest step, and the
time of the last step read from the file's end."""

from __future__ import annotations

from services.common.metrics import JsonlWriter
from services.common.series import LastSteps, Series, last_step


def _write(writer, step, t, tokens=100.0):
    writer.write("step", time=t, step=step, loss=1.0, tokens=tokens, memory_mb=10.0)


def test_tokens_seen_follow_the_trajectory_and_a_replay_counts_once(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path, rank=0)
    for step in (1, 2, 3, 4):
        _write(w, step, float(step))
    series = Series(path)
    series.poll()
    for step in (3, 4, 5):  # restarted from the checkpoint of step 2
        _write(w, step, 10.0 + step, tokens=50.0)
    series.poll()
    w.close()
    seen = [(s["step"], s["tokens_seen"]) for s in series.steps]
    assert seen == [(1, 100), (2, 200), (3, 300), (4, 400), (3, 250), (4, 300), (5, 350)]
    assert series.tokens_total == 550  # the work done, replays included


def test_thinning_keeps_the_latest_step(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path, rank=0)
    for step in range(1, 13):
        _write(w, step, float(step))
    w.close()
    series = Series(path, max_points=10)
    series.poll()
    assert len(series.steps) <= 10 and series.latest()["step"] == 12


def test_the_last_step_is_read_from_the_end_past_evals_and_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    assert last_step(path) is None
    w = JsonlWriter(path, rank=0)
    w.write("eval", time=1.0, step=0, bits_per_byte=4.0)
    assert last_step(path) is None
    for step in range(1, 400):
        _write(w, step, 1000.0 + step)
    w.write("eval", time=5000.0, step=399, bits_per_byte=3.0)
    w.close()
    with open(path, "a") as fh:
        fh.write('{"event": "step", "time": 9999, "st')  # being written
    assert last_step(path, window=64)["time"] == 1399.0  # blocks smaller than a line
    steps = LastSteps()
    assert steps.get(path)["step"] == 399
    with open(path, "a") as fh:
        fh.write('ep": 400}\n')
    assert steps.get(path) == {"event": "step", "time": 9999, "step": 400}  # read again
