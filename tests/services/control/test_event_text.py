"""Recorded run events as sentences: every kind the run engine (services/supervise/events.py) and
the control plane record has its own sentence, built from the payload as it is recorded; a kind
without one reads as a compact key=value line."""

from __future__ import annotations

import pathlib
import re

import pytest

from services.control.event_text import MAX_CHARS, SENTENCES, describe
from services.supervise import events as engine

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _engine_kinds() -> set[str]:
    """Kinds of every Event class of the run engine."""
    out, todo = set(), [engine.Event]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.kind:
            out.add(cls.kind)
    return out


def _control_kinds() -> set[str]:
    """Kinds the control plane records itself: ``journal.event(run, "kind", ...)`` in its source,
    and ``state`` (Journal.set_state)."""
    pattern = re.compile(r"\.event\(\s*[\w.\[\]\"']+,\s*\"(\w+)\"", re.S)
    out = {"state"}
    for path in (ROOT / "services" / "control").rglob("*.py"):
        out.update(pattern.findall(path.read_text()))
    return out


def test_every_recorded_kind_has_a_sentence_and_no_sentence_is_for_a_kind_never_recorded():
    kinds = _engine_kinds() | _control_kinds()
    assert {"restarted", "recovering", "queue_restarted", "reattached"} <= kinds  # the greps work
    assert kinds == set(SENTENCES)


CASES = [
    (
        engine.Restarted(process="trainer0", scope="process", attempt=2, code=137, max_restarts=3),
        "trainer0 restarted after exit 137 (attempt 2 of 3)",
    ),
    (
        engine.Restarted(process="trainer1", scope="group", attempt=1, code=-9, max_restarts=2),
        "trainer1 restarted after SIGKILL, with every trainer rank (attempt 1 of 2)",
    ),
    (
        engine.Restarted(process="queue", scope="run", attempt=1, code=None, max_restarts=2),
        "the whole run restarted after queue lost what it held (attempt 1 of 2)",
    ),
    (
        engine.Recovering(
            process="teacher0",
            scope="process",
            attempt=1,
            delay_s=0.4,
            reason="teacher0 exited with code 1: restart 1 of 2 (process) in 0.4s",
            code=1,
            max_restarts=2,
        ),
        "teacher0 exited with code 1; teacher0 restarts in 0.4 s (attempt 1 of 2)",
    ),
    (
        engine.Recovering(
            process="queue",
            scope="run",
            attempt=1,
            delay_s=0.5,
            reason="queue restarted: epoch a -> b: restart 1 of 2 (run) in 0.5s",
            code=None,
            max_restarts=2,
        ),
        "the whole run restarts in 0.5 s (attempt 1 of 2): queue restarted: epoch a -> b: "
        "restart 1 of 2 (run) in 0.5s",
    ),
    (
        engine.Launched(queue="tcp://127.0.0.1:5555"),
        "every process launched on queue tcp://127.0.0.1:5555",
    ),
    (engine.Exited(process="collator", role="collator", code=0), "collator exited normally"),
    (
        engine.Exited(process="trainer0", role="trainer", code=-15),
        "trainer0 (trainer) was killed by SIGTERM",
    ),
    (
        engine.Exited(process="teacher0", role="teacher", code=5),
        "teacher0 (teacher) exited with code 5",
    ),
    (
        engine.Unresponsive(process="trainer0", pid=4242, reason="no beat for 5.1s: frozen"),
        "trainer0 (pid 4242) was unresponsive (no beat for 5.1s: frozen) and was killed",
    ),
    (engine.DataComplete(samples=24000), "the collators finished: 24,000 samples in the epoch"),
    (
        engine.Failed(
            failure=engine.Failure(
                process="teacher0",
                role="teacher",
                exit_code=5,
                reason="teacher0 exited with code 5; restart budget of teacher0 spent (1 of 1)",
                log_file="/runs/x/logs/teacher0.log",
                log_tail="boom",
            )
        ),
        "run failed on teacher0 (exit 5): teacher0 exited with code 5; restart budget of "
        "teacher0 spent (1 of 1)",
    ),
]


@pytest.mark.parametrize(("event", "sentence"), CASES, ids=lambda x: getattr(x, "kind", None))
def test_each_engine_event_reads_as_a_sentence(event, sentence):
    assert describe(event.kind, event.data()) == sentence


def test_the_cases_cover_every_engine_kind():
    assert {event.kind for event, _ in CASES} == _engine_kinds()


@pytest.mark.parametrize(
    ("kind", "data", "sentence"),
    [
        ("state", {"state": "PENDING"}, "run PENDING"),
        ("state", {"state": "PENDING", "resume": True}, "run resumed: PENDING"),
        (
            "state",
            {"state": "RECOVERING", "reason": "teacher0 exited with code 1", "attempt": 1},
            "run RECOVERING: teacher0 exited with code 1 (attempt 1)",
        ),
        (
            "state",
            {
                "state": "FAILED",
                "reason": "budget spent",
                "failed_process": "trainer0",
                "exit_code": 137,
            },
            "run FAILED: budget spent (trainer0, exit 137)",
        ),
        (
            "stop_requested",
            {"grace_s": 300.0},
            "stop requested: the trainers get 300 s to checkpoint",
        ),
        (
            "resumed",
            {"from_state": "STOPPED", "step": 12, "checkpoint": "/runs/a/checkpoints/step_12"},
            "resumed from STOPPED at the checkpoint of step 12",
        ),
        (
            "resumed",
            {"from_state": "FAILED", "step": None, "checkpoint": None},
            "resumed from FAILED with no checkpoint: training starts over",
        ),
        (
            "reattached",
            {"processes": ["collator", "queue", "trainer0"]},
            "re-attached after a control-plane restart: collator, queue, trainer0",
        ),
        (
            "queue_restarted",
            {
                "address": "tcp://q:5555",
                "old_epoch": "a1",
                "new_epoch": "b2",
                "durable": False,
                "action": "restart the run: the queue lost its samples",
            },
            "queue tcp://q:5555 restarted (instance a1 -> b2, not durable); action: restart the "
            "run: the queue lost its samples",
        ),
        (
            "queue_unreachable",
            {"address": "tcp://q:5555", "down_s": 601.2, "error": "timeout"},
            "queue tcp://q:5555 unreachable for 601.2 s: timeout",
        ),
    ],
)
def test_each_control_plane_event_reads_as_a_sentence(kind, data, sentence):
    assert describe(kind, data) == sentence


def test_an_unknown_kind_or_a_payload_of_another_shape_reads_as_one_key_value_line():
    assert describe("compiled", {"state": "done", "s": 1.5, "shapes": [[1, 64]]}) == (
        "compiled state=done s=1.5 shapes=[[1,64]]"
    )
    assert describe("exited", {"process": "trainer0"}) == "exited process=trainer0"  # no code
    assert describe("data_complete", None) == "data_complete"


def test_a_restart_recorded_before_events_named_their_cause_still_reads_as_a_sentence():
    old = {"process": "teacher0", "scope": "process", "attempt": 1}
    assert describe("restarted", old) == "teacher0 restarted (attempt 1)"


def test_a_long_sentence_is_cut_to_its_bound():
    text = describe("state", {"state": "FAILED", "reason": "x" * 5000})
    assert len(text) == MAX_CHARS and text.endswith("...")
