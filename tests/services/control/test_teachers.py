"""A run of several teachers over the REST API of a real `xtoken control serve`: the KD term of
each teacher (``teacher{i}_kl_loss`` in its step records) is served with the steps, one series per
teacher, for the dashboard's KD lines; a run of one teacher is served as before."""

from __future__ import annotations

import json

import pytest

from services.common.series import STEP_FIELDS, Series
from tests.services.control.conftest import ControlServer
from tests.services.control.finished_runs import write_finished_run

START = 1_700_000_000.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A server over two finished runs: ``two`` (two teachers, 6 steps), ``one`` (one teacher)."""
    root = tmp_path_factory.mktemp("teachers")
    ids = {
        "two": write_finished_run(root / "runs", name="two", steps=6, start=START, teachers=2),
        "one": write_finished_run(root / "runs", name="one", steps=4, start=START + 60),
    }
    server = ControlServer(root)
    yield server, ids, root / "runs"
    server.stop()


def _step_records(runs_root, run_id: str) -> list[dict]:
    path = runs_root / run_id / "metrics" / "trainer.rank0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r.get("event") == "step"]


def test_a_run_of_two_teachers_is_served_with_the_kd_series_of_each(runs):
    server, ids, runs_root = runs
    written = _step_records(runs_root, ids["two"])
    with server.client() as c:
        steps = c.get(f"/v1/runs/{ids['two']}/metrics").json()["steps"]
        later = c.get(f"/v1/runs/{ids['two']}/metrics?after_step=4").json()["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    for teacher in (0, 1):
        key = f"teacher{teacher}_kl_loss"
        assert [s[key] for s in steps] == [r[key] for r in written], key
        assert [s[key] for s in later] == [r[key] for r in written[4:]], key
    for s in steps:
        assert s["teacher0_kl_loss"] < s["kl_loss"] < s["teacher1_kl_loss"]
        assert (s["teacher0_kl_loss"] + s["teacher1_kl_loss"]) / 2 == pytest.approx(s["kl_loss"])
        assert "teacher2_kl_loss" not in s
        # the series keeps each teacher's KD term; the rest of its figures stay in the file
        assert "teacher0_kl_common" not in s and "teacher1_num_valid_chunks" not in s


def test_a_run_of_one_teacher_is_served_without_teacher_series(runs):
    server, ids, _ = runs
    with server.client() as c:
        steps = c.get(f"/v1/runs/{ids['one']}/metrics").json()["steps"]
    assert len(steps) == 4
    for s in steps:
        assert not [k for k in s if k.startswith("teacher")], s
        assert set(s) <= {*STEP_FIELDS, "tokens_seen"}


def test_the_live_step_events_carry_each_teachers_kd_term(runs):
    """What the control plane streams as a live run's ``metrics`` events: the records its series
    reads, each teacher's KD term included."""
    _, ids, runs_root = runs
    series = Series(runs_root / ids["two"] / "metrics" / "trainer.rank0.jsonl")
    events = [e for e in series.poll() if e["kind"] == "step"]
    written = _step_records(runs_root, ids["two"])
    assert [(e["teacher0_kl_loss"], e["teacher1_kl_loss"]) for e in events] == [
        (r["teacher0_kl_loss"], r["teacher1_kl_loss"]) for r in written
    ]
