"""A SIGKILLed teacher is noticed in seconds: with the default request lease (120 s), the trainer
ranks see its ring's heartbeat stop, ask the restarted teacher again at once, and stall for about
``teacher_dead_after_s`` plus the successor's load time; nothing is trained on a dead teacher's slot."""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.conftest import (
    assert_exactly_once,
    corpus_parts,
    feed_totals,
    step_records,
    trained_keys,
    wait_for,
)

pytestmark = pytest.mark.slow

# What the stall may exceed the successor's load time by: teacher_dead_after_s (5 s by default), a claim
# round and a step of this machine.
STALL_BEYOND_LOAD_S = 10.0


def _kill_and_replace(pipeline, teacher, teacher_cfg, trainers, queue) -> tuple[float, float]:
    """SIGKILL ``teacher``, start its successor at once (as the run engine does), let the
    trainers finish, stop the rest; returns the kill's time and the successor's load time."""
    assert teacher.kill() == -signal.SIGKILL
    killed_at = time.time()
    successor = pipeline.start_teacher(teacher_cfg, name="teacher-restarted")
    successor.wait_ready(120)
    load_s = time.time() - killed_at
    for t in trainers:
        assert t.wait(240) == 0, t.tail()
    successor.signal(signal.SIGTERM)
    queue.signal(signal.SIGTERM)
    return killed_at, load_s


@pytest.mark.timeout(300)
def test_trainers_ask_a_restarted_teacher_again_within_seconds_of_a_sigkill(pipeline, demo):
    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=96, parts=1)
    queue = pipeline.start_queue()
    teacher_cfg = pipeline.teacher_config()  # the default request lease: 120 s
    assert teacher_cfg.lease_s >= 100
    teacher = pipeline.start_teacher(teacher_cfg)
    trainer_cfg = pipeline.trainer_config(feed={"micro_batch": 2, "grad_accum": 2})
    assert trainer_cfg.teacher.dead_after_s == 5.0 and trainer_cfg.teacher.timeout_s >= 100
    trainers = pipeline.start_trainers(trainer_cfg)
    collator = pipeline.start_collator("collator", paths[0], batch=16)
    assert collator.wait(90) == 0, collator.tail()
    pipeline.put_eof()
    run_dir = pipeline.run_dir

    wait_for(lambda: len(step_records(run_dir, 0)) >= 2, 120, "two trained steps")
    killed_at, load_s = _kill_and_replace(pipeline, teacher, teacher_cfg, trainers, queue)

    for rank in (0, 1):
        times = [r["time"] for r in step_records(run_dir, rank)]
        before = [t for t in times if t <= killed_at]
        after = [t for t in times if t > killed_at]
        assert before and after, f"rank {rank}: the kill did not land mid-run"
        stall = after[0] - before[-1]
        print(f"rank {rank}: stall {stall:.1f} s, successor load {load_s:.1f} s")
        assert stall <= STALL_BEYOND_LOAD_S + load_s, (rank, stall, load_s)
    assert_exactly_once(trained_keys(run_dir), corpus)
    assert feed_totals(run_dir)["checksum_mismatch"] == 0


@pytest.mark.timeout(300)
def test_a_teacher_dead_before_any_result_is_replaced_without_waiting_for_its_leases(
    pipeline, demo
):
    # e.g. an OOM on the teacher's first forward: it holds the first requests leased (120 s) and
    # no rank has seen a result of it, so no ring of it is known to watch
    from services import protocol as proto
    from services.queue.client import QueueClient

    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=48, parts=1)
    queue = pipeline.start_queue()
    collator = pipeline.start_collator("collator", paths[0], batch=16)
    assert collator.wait(90) == 0, collator.tail()
    pipeline.put_eof()
    # a long claim: the frozen teacher's claim waits on the server, which leases it the requests
    teacher_cfg = pipeline.teacher_config(claim_timeout_s=60.0)
    teacher = pipeline.start_teacher(teacher_cfg)
    teacher.wait_ready(120)
    time.sleep(1.0)  # into its first claim
    teacher.signal(signal.SIGSTOP)
    trainer_cfg = pipeline.trainer_config(
        feed={"micro_batch": 2, "grad_accum": 2}, teacher={"timeout_s": 600.0}
    )
    trainers = pipeline.start_trainers(trainer_cfg)
    with QueueClient(pipeline.queue, timeout_s=10, name="e2e") as client:
        requests = proto.request_partition(trainer_cfg.partition, 0)
        wait_for(lambda: client.status(requests, proto.TEACHER_TASK)["leased"] > 0, 120,
                 "requests leased to the frozen teacher")
    killed_at, load_s = _kill_and_replace(pipeline, teacher, teacher_cfg, trainers, queue)

    for rank in (0, 1):
        first = step_records(run_dir := pipeline.run_dir, rank)[0]["time"]
        print(f"rank {rank}: first step {first - killed_at:.1f} s after the kill, load {load_s:.1f} s")
        assert first - killed_at <= STALL_BEYOND_LOAD_S + load_s, (rank, first - killed_at, load_s)
        assert "was replaced by teacher" in trainers[rank].log()
    assert_exactly_once(trained_keys(run_dir), corpus)
    assert feed_totals(run_dir)["checksum_mismatch"] == 0
