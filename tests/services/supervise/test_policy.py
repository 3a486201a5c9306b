"""The restart policy of a run's processes (``xtoken run`` and the control plane alike): scope,
backoff and budget per role; pure logic, no processes."""

from __future__ import annotations

import pytest

from services.supervise.policy import SIGNAL_TIE_S, RestartPolicy, first_cause


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


def test_exit_2_fails_the_run_as_bad_settings_and_exit_3_as_bad_data_never_restarted():
    p = RestartPolicy(max_restarts=3)
    settings, data = p.decide("teacher0", "teacher", 2), p.decide("collator", "collator", 3)
    assert settings.action == data.action == "fail" and p.restarts() == {}
    assert settings.reason.startswith("teacher0 exited with code 2 (bad settings")
    assert data.reason.startswith("collator exited with code 3 (bad data")
    assert "not restarted" in settings.reason and "not restarted" in data.reason
    assert (settings.code, data.code) == (2, 3)


def test_a_restart_names_the_cause_it_is_given():
    p = RestartPolicy(max_restarts=1, backoff_s=0.0)
    d = p.decide("trainer1", "trainer", -9, cause="trainer1 exited with code -9 (first)")
    assert d.reason == "trainer1 exited with code -9 (first): restart 1 of 1 (group) in 0.0s"


def test_the_first_cause_of_a_group_is_the_earliest_exit_and_a_kill_wins_a_tie():
    # (code, exit time): the exit seen first is not the first exit
    assert first_cause({"trainer0": (1, 10.30), "trainer1": (-9, 10.00)}) == "trainer1"
    assert first_cause({"trainer0": (1, 10.00), "trainer1": (1, 10.30)}) == "trainer0"
    # a signal death and a consequent exit 1 whose times tie (clocks of two hosts, late stamps)
    assert first_cause({"trainer0": (1, 10.00), "trainer1": (-9, 10.00 + SIGNAL_TIE_S / 2)}) == (
        "trainer1"
    )
    assert first_cause({"trainer0": (1, 10.00), "trainer1": (-9, 10.00 + 2 * SIGNAL_TIE_S)}) == (
        "trainer0"
    )
    # an exit code nobody knows (a lost node) is no signal death
    assert first_cause({"trainer0": (-1000, 10.00), "trainer1": (1, 10.01)}) == "trainer0"
    assert first_cause({"trainer3": (-9, 5.0)}) == "trainer3"
    with pytest.raises(ValueError, match="no exit"):
        first_cause({})
