"""Recovery of a run of real processes from a SIGKILL of a trainer rank, the teacher or a collator:
no sample is lost, none is trained twice (after a checkpoint), none is trained on a freed slot."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from services.common.metrics import read_jsonl
from services.queue.client import QueueClient
from tests.e2e.conftest import (
    PARTITION,
    assert_exactly_once,
    checkpoint_keys,
    cmdline,
    corpus_parts,
    descendants,
    feed_totals,
    key_log_lines,
    keys_after,
    latest_checkpoint,
    rings_in_flight,
    step_records,
    trained_keys,
    wait_for,
)

pytestmark = pytest.mark.slow


def _stop_servers(*procs) -> None:
    for p in procs:
        p.signal(signal.SIGTERM)
        assert p.wait(20) == 0, p.tail()


@pytest.mark.timeout(300)
def test_killed_trainer_rank_resumes_from_checkpoint_and_trains_each_sample_once(pipeline, demo):
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=96, parts=1)
    queue = pipeline.start_queue()
    teacher = pipeline.start_teacher(pipeline.teacher_config())
    trainer_cfg = pipeline.trainer_config(feed={"grad_accum": 2}, schedule={"checkpoint_every": 2})
    trainers = pipeline.start_trainers(trainer_cfg)
    collator = pipeline.start_collator("collator", paths[0], batch=16)
    assert collator.wait(90) == 0, collator.tail()
    pipeline.put_eof()
    run_dir = pipeline.run_dir

    # rank 1 dies after the step-2 checkpoint, with a step trained past it (lost: trained again);
    # its keys log has a step's line once the step is queued (its metrics record comes a step
    # later)
    def rank1_steps() -> int:
        path = run_dir / "keys" / "trainer.rank1.jsonl"
        return sum(r.get("event") == "trained" for r in read_jsonl(path)) if path.exists() else 0

    wait_for(lambda: latest_checkpoint(run_dir) is not None and rank1_steps() >= 3,
             120, "a checkpoint and a step after it")
    time.sleep(0.5)  # into the next step: rank 1 holds teacher records and slots
    assert trainers[1].kill() == -signal.SIGKILL
    checkpoint = latest_checkpoint(run_dir)
    survivor = trainers[0]
    try:  # its next collective fails; if it hangs there instead, it is stopped
        survivor.popen.wait(30)
    except subprocess.TimeoutExpired:
        survivor.stop(grace_s=10)
    assert latest_checkpoint(run_dir) == checkpoint, "a checkpoint was written by one rank alone"
    before = key_log_lines(run_dir)
    saved = checkpoint_keys(checkpoint)  # read now: newer checkpoints rotate it away
    lost = [k for k in keys_after(run_dir, {}) if k not in saved]

    # both ranks again, same config: they resume from the checkpoint
    trainers = pipeline.start_trainers(trainer_cfg)
    resumed = [t.wait_ready(120)["step"] for t in trainers]
    assert resumed == [int(checkpoint.name.split("_")[1])] * 2
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    _stop_servers(teacher, queue)

    after = keys_after(run_dir, before)
    assert not saved & set(after), "a checkpointed key was trained again"
    assert_exactly_once(sorted(saved) + after, corpus)
    assert lost, "the kill did not land after a trained, uncheckpointed step"
    # the slots of the records the killed ranks held were freed by their successors
    assert rings_in_flight(teacher) == [[], []]
    assert feed_totals(run_dir)["checksum_mismatch"] == 0


@pytest.mark.timeout(420)
def test_trainer_ranks_killed_twice_before_any_checkpoint_lose_no_sample(pipeline, demo):
    # a restart before the first checkpoint (an OOM in a run's first steps), twice: every launch
    # starts from no checkpoint, while the dead launches' claims stay leased for lease_s
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=96, parts=1)
    queue = pipeline.start_queue()
    teacher = pipeline.start_teacher(pipeline.teacher_config())
    trainer_cfg = pipeline.trainer_config(
        feed={"grad_accum": 2, "lease_s": 300.0}, schedule={"checkpoint_every": 1000}
    )
    collator = pipeline.start_collator("collator", paths[0], batch=16)
    assert collator.wait(90) == 0, collator.tail()
    pipeline.put_eof()
    run_dir = pipeline.run_dir
    for _ in range(2):
        lines = key_log_lines(run_dir)
        trainers = pipeline.start_trainers(trainer_cfg)
        wait_for(lambda lines=lines: len(keys_after(run_dir, lines)) >= 8, 120, "a trained step")
        assert trainers[1].kill() == -signal.SIGKILL
        try:
            trainers[0].popen.wait(30)
        except subprocess.TimeoutExpired:
            trainers[0].stop(grace_s=10)
        assert latest_checkpoint(run_dir) is None
    lines = key_log_lines(run_dir)
    trainers = pipeline.start_trainers(trainer_cfg)
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    _stop_servers(teacher, queue)
    # no checkpoint before the last launch: it trained the whole corpus, once
    assert_exactly_once(keys_after(run_dir, lines), corpus)


@pytest.mark.timeout(300)
def test_killed_teacher_is_never_trained_on_and_its_batches_are_recomputed(pipeline, demo):
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=96, parts=1)
    queue = pipeline.start_queue()
    # a short request lease: what the dead teacher claimed comes back to its successor soon
    teacher_cfg = pipeline.teacher_config(ring_heartbeat_s=0.2, lease_s=10.0)
    teacher = pipeline.start_teacher(teacher_cfg)
    # four micro-batches a step: the trainers read the teacher's slots most of the time
    trainers = pipeline.start_trainers(
        pipeline.trainer_config(
            feed={"micro_batch": 2, "grad_accum": 4},
            teacher={"dead_after_s": 1.0, "timeout_s": 20.0},
        )
    )
    collator = pipeline.start_collator("collator", paths[0], batch=16)
    assert collator.wait(90) == 0, collator.tail()
    pipeline.put_eof()
    run_dir = pipeline.run_dir

    wait_for(lambda: len(step_records(run_dir, 0)) >= 2, 120, "two trained steps")
    time.sleep(0.3)  # mid-step: both ranks hold views of its slots
    assert teacher.kill() == -signal.SIGKILL
    steps_at_kill = len(step_records(run_dir, 0))
    time.sleep(2.0)  # past teacher_dead_after_s: its handles are stale now
    successor = pipeline.start_teacher(teacher_cfg, name="teacher-restarted")
    instance = successor.wait_ready(120)["instance"]
    for t in trainers:
        assert t.wait(240) == 0, t.tail()
    _stop_servers(successor, queue)

    assert len(step_records(run_dir, 0)) > steps_at_kill, "the kill did not land mid-run"
    assert_exactly_once(trained_keys(run_dir), corpus)
    counters = feed_totals(run_dir)
    assert counters["checksum_mismatch"] == 0, counters  # nothing read from a freed slot
    served = [r for r in pipeline.teacher_requests() if r["instance"] == instance]
    assert served, "the restarted teacher computed nothing"
    # a slot still held when the successor closes holds the result of a superseded request: the
    # trainers asked the successor again for what the dead one held (its leases kept those
    # records from the successor) and keep the old records, which the successor computes once
    # their leases end; after the trainers finished, no one releases those slots. Never more
    # of them than requests asked again
    held = sum(len(slots) for slots in rings_in_flight(successor))
    assert held <= counters["re_requests"], (rings_in_flight(successor), counters)


@pytest.mark.timeout(300)
def test_killed_collator_restarted_loses_no_sample_and_trains_each_once(pipeline, demo):
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=96, parts=1)
    queue = pipeline.start_queue()
    teacher = pipeline.start_teacher(pipeline.teacher_config())
    trainers = pipeline.start_trainers(pipeline.trainer_config())
    # small puts: the worker is tokenizing or putting whenever it is killed
    collator = pipeline.start_collator("collator", paths[0], batch=4)
    with QueueClient(pipeline.queue, timeout_s=10, name="e2e") as client:
        first = wait_for(lambda: len(client.list(PARTITION).get("keys", [])), 120,
                         "the collator's first puts", poll_s=0.01)
        # the collator and its worker; multiprocessing's resource tracker lives on to unlink
        # their semaphores, as after a real crash
        tree = [p for p in descendants(collator.pid) if "resource_tracker" not in cmdline(p)]
        for pid in [*tree, collator.pid]:
            os.kill(pid, signal.SIGKILL)
    assert collator.wait(10) == -signal.SIGKILL
    at_kill = len(pipeline.queued_keys())
    assert first <= at_kill < len(corpus), "the kill did not land mid-run"

    again = pipeline.start_collator("collator", paths[0], batch=4)
    assert again.wait(120) == 0, again.tail()
    put, skipped = map(int, re.findall(r"(\d+) samples put \(\d+ new, (\d+) skipped", again.log())[-1])
    assert skipped >= at_kill and put + skipped == len(corpus)  # the rest, nothing twice
    assert pipeline.put_eof() == len(corpus)
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
    _stop_servers(teacher, queue)

    assert_exactly_once(trained_keys(pipeline.run_dir), corpus)
    assert feed_totals(pipeline.run_dir)["checksum_mismatch"] == 0
