"""The restart policy of a run's processes (``xtoken run`` and the control plane alike): scope,
backoff and budget per role; pure logic, no processes."""

from __future__ import annotations

import pytest

from services.supervise.policy import RestartPolicy


def test_collators_and_teachers_restart_in_place_with_doubling_backoff_until_the_budget():
    p = RestartPolicy(max_restarts=3, backoff_s=1.0, max_backoff_s=3.0)
    d = [p.decide("teacher0", "teacher", 1) for _ in range(4)]
    assert [x.action for x in d] == ["restart", "restart", "restart", "fail"]
    assert [x.delay_s for x in d[:3]] == [1.0, 2.0, 3.0]
    assert [x.attempt for x in d[:3]] == [1, 2, 3]
    assert {x.scope for x in d[:3]} == {"process"}
    assert "restart budget of teacher0 spent (3 of 3)" in d[3].reason
    # another process has its own budget
    assert p.decide("teacher1", "teacher", -9).action == "restart"
    assert p.decide("collator", "collator", 1).scope == "process"


def test_any_trainer_rank_spends_the_budget_of_the_whole_group():
    p = RestartPolicy(max_restarts=1, backoff_s=0.0)
    first = p.decide("trainer1", "trainer", -9)
    assert (first.action, first.scope, first.key) == ("restart", "group", "trainers")
    assert p.decide("trainer0", "trainer", 1).action == "fail"
    assert p.restarts() == {"trainers": 1}


def test_a_lost_queue_restarts_the_run_and_normal_ends_restart_nothing():
    p = RestartPolicy(max_restarts=2)
    assert p.decide("queue", "queue", -9).scope == "run"
    assert p.decide("trainer0", "trainer", 0, finished_ok=True).action == "done"
    assert p.decide("x", "unknown-role", 1).action == "fail"
    assert RestartPolicy(max_restarts=0).decide("teacher0", "teacher", 1).action == "fail"


def test_a_lost_data_plane_without_an_exit_spends_the_budget_of_its_scope():
    # a shared queue restarted without its data: no process of the run exited, the run restarts
    p = RestartPolicy(max_restarts=1, backoff_s=0.5)
    lost = p.decide_lost("queue", "queue", "queue restarted: epoch a -> b")
    assert (lost.action, lost.scope, lost.key, lost.attempt) == ("restart", "run", "run", 1)
    assert lost.reason == "queue restarted: epoch a -> b: restart 1 of 1 (run) in 0.5s"
    again = p.decide("queue", "queue", -9)  # one budget with the exits of the run's own queue
    assert again.action == "fail" and "restart budget of run spent (1 of 1)" in again.reason
    assert p.decide_lost("queue", "queue", "x").action == "fail"
    with pytest.raises(ValueError, match="none may be negative"):
        RestartPolicy(max_restarts=-1)
