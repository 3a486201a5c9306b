"""The queue-depth history of a run: a bounded ring that spans the whole run (thinned evenly past
its bound), kept in the run directory; a run on a real `xtoken queue serve` gets its samples from
the control plane's queue monitor, and a control plane started again (not watching the finished
run) serves what was recorded."""

from __future__ import annotations

import json
import time

import pytest

from services.control.queue_history import FIELDS, QueueHistory, history_path
from services.control.store import Store
from tests.services.control.conftest import tiny_config
from tests.services.control.test_queue_watch import RestartableQueue
from tests.services.control.test_supervisor import wait_state


def _stats(i: int) -> dict:
    return {"samples": i, "bytes_used": 100 * i, "leases": 1, "parked_claims": 2, "parked_puts": 0}


def test_the_ring_never_holds_more_than_its_bound_and_still_spans_the_whole_run():
    h = QueueHistory(None, max_points=8)
    kept = [h.add(_stats(i), at=1000.0 + i) for i in range(100)]
    points = h.points()
    assert 2 <= len(points) <= 8 and len(h) == len(points)
    assert points[0][0] <= 1000.0 + 16  # the start is still there ...
    assert points[-1][0] >= 1000.0 + 99 - h.stride  # ... and the end
    gaps = {b[0] - a[0] for a, b in zip(points, points[1:], strict=False)}
    assert gaps == {float(h.stride)}  # evenly spaced: one answer in `stride` kept
    assert h.stride == 16 and sum(kept) < 100
    assert points[-1][1:] == [points[-1][0] - 1000.0, 100 * (points[-1][0] - 1000.0), 1, 2, 0]


def test_samples_after_a_time_and_a_clock_step_back_is_ignored():
    h = QueueHistory(None)
    for i in range(5):
        h.add(_stats(i), at=10.0 + i)
    assert not h.add(_stats(9), at=12.5)
    assert [p[0] for p in h.points(after=12.0)] == [13.0, 14.0]
    assert h.points(after=99.0) == []


def test_the_history_is_kept_in_the_run_directory_and_read_back(tmp_path):
    path = history_path(tmp_path / "run")
    h = QueueHistory(path, max_points=4)
    for i in range(9):
        h.add(_stats(i), at=float(i))
    h.save()
    body = json.loads(path.read_text())
    assert body["fields"] == list(FIELDS) and body["stride"] == h.stride
    again = QueueHistory(path, max_points=4)
    assert again.points() == h.points() and again.stride == h.stride
    assert not list(path.parent.glob("*.tmp"))  # written atomically


@pytest.mark.parametrize("text", ["{not json", '{"fields": ["time"], "points": [[1]]}'])
def test_an_unreadable_or_foreign_file_starts_a_new_history(tmp_path, text):
    path = history_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert QueueHistory(path).points() == []


def test_a_run_records_its_queue_depth_and_a_restarted_control_plane_serves_it(make, tmp_path):
    queue = RestartableQueue(tmp_path)
    try:
        store = Store(tmp_path / "control.db")
        sup = make({}, store=store, queue_stats_s=0.1)
        rid = sup.submit(tiny_config(**{"queue.address": queue.address}))["id"]
        wait_state(sup, rid, {"RUNNING"})
        deadline = time.monotonic() + 20
        while len(sup.queue_history(rid)["points"]) < 3:
            assert time.monotonic() < deadline, sup.queue_history(rid)
            time.sleep(0.05)
        live = sup.queue_history(rid)
        assert live["fields"] == list(FIELDS) and live["max_points"] == 2048
        times = [p[0] for p in live["points"]]
        assert times == sorted(times) and times[0] > sup.get(rid)["created"]
        assert sup.queue_history(rid, after=times[-1])["points"] == []

        sup.stop(rid, grace_s=5)
        wait_state(sup, rid, {"STOPPED"})
        recorded = sup.queue_history(rid)["points"]
        assert len(recorded) >= 3
        path = history_path(sup.get(rid)["run_dir"])
        assert json.loads(path.read_text())["points"] == recorded  # saved as the run ended

        sup.shutdown()
        fresh = make({}, store=store)  # watches nothing: the finished run is read from its dir
        assert fresh.queue_history(rid)["points"] == recorded
    finally:
        queue.stop()


def test_a_run_whose_queue_never_answered_has_no_samples(make):
    sup = make({}, queue_stats_s=0.1)  # the stand-in queue answers no stats call
    rid = sup.submit(tiny_config())["id"]
    wait_state(sup, rid, {"RUNNING"})
    time.sleep(0.5)
    assert sup.queue_history(rid)["points"] == []
