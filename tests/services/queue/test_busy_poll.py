"""The event loop's busy-poll decision (server.BusyPoll), with a fake clock and yield: no timing."""

from __future__ import annotations

import pytest

from services.queue.server import CONTENDED_PAUSE_S, CONTENDED_YIELD_S, BusyPoll


class FakeCore:
    """A clock that a yield moves on by ``yield_s`` (the time other tasks held the core)."""

    def __init__(self, yield_s: float = 1e-5) -> None:
        self.now = 100.0
        self.yield_s = yield_s
        self.yields = 0

    def clock(self) -> float:
        return self.now

    def sched_yield(self) -> None:
        self.yields += 1
        self.now += self.yield_s


def _poller(ready_after: int | None):
    """A zero-timeout poll that is ready on its ``ready_after``-th call (None: never)."""
    calls = []

    def poll() -> list:
        calls.append(1)
        return [("sock", 1)] if ready_after is not None and len(calls) >= ready_after else []

    return poll, calls


def test_spin_returns_as_soon_as_a_request_is_ready():
    core = FakeCore()
    busy = BusyPoll(300e-6, clock=core.clock, yield_=core.sched_yield)
    busy.handled()
    poll, calls = _poller(ready_after=5)
    assert busy.spin(poll) is True
    assert len(calls) == 5 and core.yields == 4
    assert busy.pauses == 0


def test_spin_ends_with_its_window_when_nothing_comes():
    core = FakeCore(yield_s=1e-5)
    busy = BusyPoll(300e-6, clock=core.clock, yield_=core.sched_yield)
    busy.handled()
    poll, calls = _poller(ready_after=None)
    assert busy.spin(poll) is False
    assert core.yields == pytest.approx(30, abs=1)  # 300 us of 10 us yields
    assert busy.pauses == 0
    busy.handled()  # the next burst spins again
    assert busy.spin_until == pytest.approx(core.now + 300e-6)


def test_no_spin_before_any_request_or_with_busy_poll_off():
    core = FakeCore()
    poll, calls = _poller(ready_after=1)
    assert BusyPoll(300e-6, clock=core.clock, yield_=core.sched_yield).spin(poll) is False
    off = BusyPoll(0.0, clock=core.clock, yield_=core.sched_yield)
    off.handled()
    assert off.spin(poll) is False
    assert calls == [] and core.yields == 0


def test_a_slow_yield_pauses_spinning_for_a_second():
    # another task held the core for 4 ms: a spinning loop would wait out its slices
    core = FakeCore(yield_s=0.004)
    busy = BusyPoll(300e-6, clock=core.clock, yield_=core.sched_yield)
    busy.handled()
    poll, calls = _poller(ready_after=None)
    assert busy.spin(poll) is False
    assert core.yields == 1 and busy.pauses == 1
    assert busy.paused_until == pytest.approx(core.now + CONTENDED_PAUSE_S)

    core.yield_s = 1e-5  # the core is free again, but the pause holds
    core.now += CONTENDED_PAUSE_S / 2
    busy.handled()
    assert busy.spin_until == 0.0
    assert busy.spin(poll) is False
    assert len(calls) == 1 and core.yields == 1  # neither polled nor yielded while paused

    core.now = busy.paused_until  # a second later it spins again
    busy.handled()
    assert busy.spin(poll) is False
    assert core.yields > 1 and busy.pauses == 1


def test_yields_up_to_the_threshold_keep_spinning():
    core = FakeCore(yield_s=CONTENDED_YIELD_S * 0.9)
    busy = BusyPoll(0.01, clock=core.clock, yield_=core.sched_yield)
    busy.handled()
    poll, calls = _poller(ready_after=8)
    assert busy.spin(poll) is True
    assert busy.pauses == 0 and core.yields == 7
