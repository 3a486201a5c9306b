"""Runs side by side over the REST API of a real `xtoken control serve`: two finished runs, their
metrics files written as the trainer writes them, compared on steps, tokens seen and wall time
(a replay after a restart from a checkpoint counted once), thinned to a bound, with the config
keys that differ; "updated" is the time of a run's last step; the recorded queue depth of a
finished run; recorded events carry their sentence."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from services.supervise.events import Exited, Restarted
from tests.services.control.conftest import ControlServer, tiny_config
from tests.services.control.finished_runs import write_finished_run

START = 1_700_000_000.0  # the runs' first records (one per second after it)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A server over three finished runs: ``a`` (lr 0.003, a trainer restart replays steps 3-6),
    ``b`` (lr 0.001, max_steps set, recorded queue depth), ``empty`` (no step)."""
    root = tmp_path_factory.mktemp("compare")
    runs_root = root / "runs"
    crash = Exited(process="trainer0", role="trainer", code=137)
    restart = Restarted(process="trainer0", scope="group", attempt=1, code=137, max_restarts=2)
    ids = {
        "a": write_finished_run(
            runs_root,
            name="lr-3e-3",
            steps=6,
            start=START,
            replay_from=2,
            evals=(0, 4),
            events=((crash.kind, crash.data()), (restart.kind, restart.data())),
        ),
        "b": write_finished_run(
            runs_root,
            name="lr-1e-3",
            steps=40,
            start=START + 100,
            config=tiny_config(**{"trainer.optim.lr": 0.001, "trainer.schedule.max_steps": 40}),
            loss0=20.0,
            memory_mb=1200.0,
            tokens=512.0,
            evals=(0, 20, 40),
            queue_samples=5,
        ),
        "empty": write_finished_run(runs_root, name="no-steps", steps=0, start=START, evals=()),
    }
    server = ControlServer(root)
    yield server, ids
    server.stop()


def _compare(server, *ids, **params) -> httpx.Response:
    with server.client() as c:
        return c.get("/v1/compare", params={"run": list(ids), **params})


def test_each_run_is_given_on_steps_tokens_seen_and_wall_time(runs):
    server, ids = runs
    r = _compare(server, ids["b"], ids["a"])
    assert r.status_code == 200, r.text
    b, a = r.json()["runs"]
    assert (b["id"], b["name"], b["state"]) == (ids["b"], "lr-1e-3", "SUCCEEDED")
    steps = b["steps"]
    assert steps["step"] == list(range(1, 41))
    assert steps["tokens_seen"] == [512.0 * s for s in range(1, 41)]
    # the "before" eval is the first record (elapsed 0), then one record a second
    assert b["origin"] == START + 100 and steps["elapsed_s"][0] == 1.0
    assert steps["memory_mb"][:2] == [1210.0, 1220.0]
    assert steps["loss"][0] == pytest.approx(steps["kl_loss"][0] + steps["ce_loss"][0])
    assert all(v > 0 for v in steps["tokens_per_s"])
    evals = b["evals"]
    assert evals["step"] == [0, 20, 40] and evals["tag"] == ["before", "step20", "step40"]
    assert evals["tokens_seen"] == [0.0, 512.0 * 20, 512.0 * 40]
    assert evals["bits_per_byte"] == [5.0, 3.0, 1.0]

    # run a: steps 1-6, a restart from the checkpoint of step 2, steps 3-7 again
    assert a["steps"]["step"] == [1, 2, 3, 4, 5, 6, 7]
    assert a["steps"]["tokens_seen"] == [256.0 * s for s in range(1, 8)]
    elapsed = a["steps"]["elapsed_s"]
    assert elapsed == sorted(elapsed) and elapsed[2] > elapsed[1] + 4  # the replay's time
    assert a["evals"]["step"] == [0, 4, 4]  # the eval after step 4, before and after the restart


def test_the_config_diff_lists_only_the_keys_that_differ(runs):
    server, ids = runs
    diff = _compare(server, ids["a"], ids["b"]).json()["config_diff"]
    assert diff == [
        {"key": "trainer.optim.lr", "values": {ids["a"]: 0.003, ids["b"]: 0.001}},
        {"key": "trainer.schedule.max_steps", "values": {ids["b"]: 40}},  # a lacks it
    ]
    assert _compare(server, ids["a"], ids["a"]).json()["config_diff"] == []  # counted once


def test_points_bounds_the_steps_of_each_run_keeping_the_first_and_the_last(runs):
    server, ids = runs
    b = _compare(server, ids["b"], points=5).json()["runs"][0]["steps"]
    assert b["step"] == [1, 11, 21, 30, 40]
    assert len(b["tokens_seen"]) == len(b["loss"]) == len(b["elapsed_s"]) == 5
    assert _compare(server, ids["empty"]).json()["runs"][0]["steps"]["step"] == []


@pytest.mark.parametrize(
    ("params", "status", "words"),
    [
        ({"run": ["nope"]}, 404, "no run 'nope'"),
        ({}, 422, "run"),
        ({"run": [f"r{i}" for i in range(17)]}, 422, "compare 1 to 16 runs"),
        ({"run": ["x"], "points": 1}, 422, "points"),
    ],
    ids=["unknown", "none", "too-many", "points"],
)
def test_a_bad_comparison_gets_a_clear_error(runs, params, status, words):
    server, _ = runs
    with server.client() as c:
        r = c.get("/v1/compare", params=params)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_updated_is_the_time_of_the_last_step_and_before_any_step_the_last_state_change(runs):
    server, ids = runs
    with server.client() as c:
        listed = {r["id"]: r for r in c.get("/v1/runs").json()["runs"]}
        one = c.get(f"/v1/runs/{ids['a']}").json()
    a, b, empty = listed[ids["a"]], listed[ids["b"]], listed[ids["empty"]]
    last_a = json.loads(
        (server.runs_root / ids["a"] / "metrics" / "trainer.rank0.jsonl")
        .read_text()
        .splitlines()[-1]
    )
    assert a["updated"] == one["updated"] == last_a["time"]
    assert b["updated"] == START + 100 + 41  # its 40th step (after one eval; the last eval, no)
    assert (a["step"], b["step"], empty["step"]) == (7, 40, None)  # from the files' ends
    assert a["state_changed"] > time.time() - 600  # the records were written just now
    assert empty["updated"] == empty["state_changed"]


def test_a_finished_run_shows_its_recorded_queue_depth_or_none(runs):
    server, ids = runs
    with server.client() as c:
        b = c.get(f"/v1/runs/{ids['b']}/queue/history").json()
        a = c.get(f"/v1/runs/{ids['a']}/queue/history").json()
        later = c.get(f"/v1/runs/{ids['b']}/queue/history", params={"after": START + 104}).json()
    assert b["fields"][:2] == ["time", "samples"]
    assert [p[:2] for p in b["points"]] == [[START + 100 + 2 * i, 10 + i] for i in range(5)]
    assert a["points"] == [] and a["max_points"] == 2048
    assert [p[0] for p in later["points"]] == [START + 106, START + 108]


def test_recorded_events_reach_the_event_stream_with_their_sentence(runs):
    server, ids = runs
    events = []
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=10)) as c,
        c.stream("GET", f"{server.url}/v1/runs/{ids['a']}/events") as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if events and events[-1]["data"].get("state") == "SUCCEEDED":
                break
    texts = [e["text"] for e in events]
    assert texts[:3] == ["run PENDING", "run STARTING", "run RUNNING"]
    assert "trainer0 (trainer) exited with code 137" in texts
    assert "trainer0 restarted after exit 137, with every trainer rank (attempt 1 of 2)" in texts
    assert texts[-1] == "run SUCCEEDED: every trainer rank finished"


def test_the_curves_of_a_finished_run_are_kept_until_its_file_changes(tmp_path):
    from services.common.metrics import JsonlWriter
    from services.common.series import Series
    from services.control.compare import KeptCurves

    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in paths:
        with open(path, "w") as fh:
            fh.write(json.dumps({"event": "step", "time": 1.0, "step": 1, "tokens": 8}) + "\n")
    reads = []

    def reader(path):
        def read():
            reads.append(path.name)
            series = Series(path)
            series.poll()
            return series

        return read

    kept = KeptCurves(kept=1)
    first = kept.get(paths[0], 100, reader(paths[0]))
    assert kept.get(paths[0], 100, reader(paths[0])) is first and reads == ["a.jsonl"]
    writer = JsonlWriter(paths[0])
    writer.write("step", step=2, tokens=8)
    writer.close()
    assert kept.get(paths[0], 100, reader(paths[0]))["steps"]["tokens_seen"] == [8.0, 16.0]
    kept.get(paths[1], 100, reader(paths[1]))  # the bound: a's curves go
    kept.get(paths[0], 100, reader(paths[0]))
    assert reads == ["a.jsonl", "a.jsonl", "b.jsonl", "a.jsonl"]
    assert kept.get(tmp_path / "none.jsonl", 100, reader(paths[0]))["steps"]["step"] == []
