"""The trainer's garbage-collection schedule: the start-up heap frozen, the automatic collector
off, a collection every ``gc_every`` steps, the process's collector given back at the end; and
the per-step clock of the collections."""

from __future__ import annotations

import gc
import weakref

import pytest

from services.trainer.collector import CollectorClock, CollectorSchedule
from services.trainer.config import TrainerConfig
from services.trainer.sections import ComputeConfig


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def clock():
    c = CollectorClock()
    c.install()
    yield c
    c.remove()


def test_the_clock_counts_a_full_collection_and_starts_again_from_zero(clock):
    clock.read()
    gc.collect()
    first = clock.read()
    assert first["gc_full"] == 1 and first["gc_s"] >= 0.0
    assert clock.read() == {"gc_s": 0.0, "gc_full": 0}


def test_the_schedule_collects_cycles_only_at_its_steps_and_gives_the_collector_back(clock):
    assert gc.isenabled()
    schedule = CollectorSchedule(50)
    schedule.start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        report = schedule.start_report
        # frozen objects still die by their reference counts (another thread's, here), so
        # the count can only have fallen since the report
        assert 0 < gc.get_freeze_count() <= report["frozen"] and report["full_collection_s"] >= 0
        clock.read()
        node = _Node()
        dead = weakref.ref(node)
        del node
        for step in range(1, 50):
            schedule.after_step(step)
        assert dead() is not None and clock.read()["gc_full"] == 0  # no collection yet
        schedule.after_step(50)
        assert dead() is None and clock.read()["gc_full"] == 1
    finally:
        schedule.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_trainer_waiting_for_data_collects_every_idle_period(clock, monkeypatch):
    from services.trainer import collector

    now = [1000.0]
    monkeypatch.setattr(collector.time, "monotonic", lambda: now[0])
    schedule = CollectorSchedule(50)
    schedule.start()
    try:
        clock.read()
        schedule.when_idle()  # just collected at the start
        assert clock.read()["gc_full"] == 0
        now[0] += collector.IDLE_S
        schedule.when_idle()
        assert clock.read()["gc_full"] == 1
        schedule.when_idle()  # not again until the next period
        assert clock.read()["gc_full"] == 0
    finally:
        schedule.close()


def test_gc_every_zero_leaves_pythons_collector_as_it_is():
    schedule = CollectorSchedule(0)
    schedule.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    schedule.after_step(50)
    schedule.close()
    assert gc.isenabled()


def test_a_negative_gc_every_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="gc_every=-1: must be >= 0"):
        TrainerConfig(compute=ComputeConfig(gc_every=-1))
    with pytest.raises(ValueError, match="gc_every=-1: must be >= 0"):
        CollectorSchedule(-1)
