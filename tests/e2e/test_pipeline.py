"""A whole distillation run of real processes started by their CLIs: queue, two collators, one shm
teacher, two gloo trainer ranks."""

from __future__ import annotations

import pathlib
import signal

import pytest

from tests.e2e.conftest import (
    assert_exactly_once,
    corpus_parts,
    evals,
    feed_totals,
    rings_in_flight,
    step_records,
    trained_keys,
)


@pytest.mark.timeout(120)
def test_pipeline_trains_every_sample_once_and_every_process_exits_cleanly(pipeline, demo):
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=44, parts=2)
    queue = pipeline.start_queue()
    teacher = pipeline.start_teacher(pipeline.teacher_config())
    trainers = pipeline.start_trainers(pipeline.trainer_config(heldout=pipeline.heldout))
    collators = [pipeline.start_collator(f"collator{i}", p) for i, p in enumerate(paths)]

    for c in collators:
        assert c.wait(60) == 0, c.tail()
    assert pipeline.put_eof() == len(corpus)
    for t in trainers:
        assert t.wait(60) == 0, t.tail()
    for p in (teacher, queue):  # servers run until told to stop; together, like a run stops
        p.signal(signal.SIGTERM)
    for p in (teacher, queue):
        assert p.wait(20) == 0, p.tail()
    assert rings_in_flight(teacher) == [[], []]  # every slot released by its trainer
    assert not list(pathlib.Path("/dev/shm").glob(f"xtk_{teacher.pid}_*")), "the ring is left behind"

    run_dir = pipeline.run_dir
    assert_exactly_once(trained_keys(run_dir), corpus)
    counters = feed_totals(run_dir)
    assert counters["checksum_mismatch"] == 0, counters
    before_after = evals(run_dir)
    assert before_after["after"] < before_after["before"], before_after
    losses = [r["loss"] for r in step_records(run_dir, 0)]
    assert losses[-1] < losses[0], losses
