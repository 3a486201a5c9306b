"""TeacherFeed in-process: samples from a real queue, teacher logits from a TeacherWorker serving
that queue from a thread; every sample is trained once, a short last micro-batch included. And,
with the test serving the teacher's requests itself, in an order it picks: later results that
hold every slot while an earlier micro-batch waits are given back and asked again after it."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from services import protocol as proto
from services.collator.worker import samples_to_put_fields
from services.protocol import put_eof
from services.queue.client import QueueClient
from services.teacher import main as teacher_main
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from services.trainer.trainer import build_step
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from xtoken_core.ipc.logit_ring import LogitRingReader

PARTITION = "train"


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


def _teacher_config(queue: str) -> TeacherConfig:
    """The tiny teacher (seed 1: ``setup.teacher_model``) with a ring of 2 slots per rank."""
    return TeacherConfig(
        queue=queue, partition=PARTITION, model="tiny", tokenizer=setup.TEACHER_TOKENIZER,
        slots=2, max_batch=2, max_length=setup.CTX, seed=1, checksum=True, claim_timeout_s=0.1,
    )  # fmt: skip


@pytest.fixture
def teacher(queue):
    config = _teacher_config(queue)
    worker = TeacherWorker(config)
    client = QueueClient(queue, timeout_s=10, name="teacher-test")
    lc = types.SimpleNamespace(stop=threading.Event())
    thread = threading.Thread(
        target=teacher_main._loop,
        args=(client, worker, proto.request_partition(PARTITION, 0), config, lc, None),
        daemon=True,
    )
    thread.start()
    yield worker
    lc.stop.set()
    thread.join(timeout=20)
    client.close()
    worker.close()


@pytest.mark.timeout(120)
def test_every_sample_trains_once_with_its_teacher_logits(queue, teacher, projection):
    samples = setup.samples()[:5]  # micro-batches of 2: the last one has a single row
    keys = [f"s{i}" for i in range(len(samples))]
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, keys, samples_to_put_fields(samples))
        put_eof(client, PARTITION, len(samples))
    config = setup.trainer_config(
        projection,
        queue=queue,
        partition=PARTITION,
        feed={"claim_timeout_s": 0.2},
        teacher={"verify_logits": True},
    )
    step = build_step(config)
    trained: set[str] = set()
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        feed = setup.teacher_feed(client, config, trained, pads=setup.pads(), reader=reader)
        rows, seen = [], []
        while not feed.ended:
            mbs = feed.next_step(1)
            if not mbs:
                continue
            (mb,) = mbs
            logits = mb.teacher_logits()
            want = setup.teacher_logits(mb.batch).to(logits.dtype)
            assert torch.equal(logits, want), mb.keys  # the slot holds the teacher's forward
            result = step.run(mbs)
            assert not result.skipped
            feed.ack(mbs)
            rows.append(len(mb.keys))
            seen += mb.keys
        feed.give_back()
    assert sorted(seen) == keys and trained == set(keys)
    assert sorted(rows) == [1, 2, 2] and step.student.step == 3
    assert feed.counters == {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}
    assert teacher.computed == 3
    assert all(ring.in_flight() == [] for ring in teacher.rings.values())  # every slot released


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ahead", [1, 2])
def test_the_feed_asks_the_teacher_for_as_many_steps_ahead_as_set(queue, projection, ahead):
    """``feed.ahead_steps``: the step training and that many after it are claimed and asked of
    the teacher (the requests wait in its partition; no teacher serves them here)."""
    samples = setup.samples()[:8]  # four micro-batches of 2
    keys = [f"s{i}" for i in range(len(samples))]
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, keys, samples_to_put_fields(samples))
        put_eof(client, PARTITION, len(samples))
    config = setup.trainer_config(
        projection, queue=queue, partition=PARTITION,
        feed={"claim_timeout_s": 0.2, "ahead_steps": ahead},
    )  # fmt: skip
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        feed = setup.teacher_feed(client, config, pads=setup.pads(), reader=reader)
        (mb,) = feed.next_step(1)
        asked = client.claim(
            proto.request_partition(PARTITION, 0), proto.TEACHER_TASK, ["teacher_input_ids"], 4,
            fields=list(proto.REQUEST_FIELDS), timeout_s=0.5, lease_s=60,
        )["keys"]  # fmt: skip
        assert len(asked) == 1 + ahead and len(mb.keys) == 2
        feed.give_back([mb])


class _ManualTeacher:
    """The teacher's side of the request partition, one request at a time, in the test's order
    (the same serving code as the teacher's loop: ``teacher_main._serve``)."""

    def __init__(self, client: QueueClient, worker: TeacherWorker) -> None:
        self.client, self.worker = client, worker
        self.partition = proto.request_partition(PARTITION, 0)
        self.backlog: dict[str, tuple[proto.Request, int]] = {}  # claimed, not served

    def claim(self, n: int) -> list[str]:
        """Claim ``n`` requests (oldest first) into the backlog; returns their keys."""
        got = self.client.claim(
            self.partition, proto.TEACHER_TASK, ["teacher_input_ids"], n,
            fields=list(proto.REQUEST_FIELDS), timeout_s=5, lease_s=60,
        )  # fmt: skip
        for i, key in enumerate(got["keys"]):
            request = proto.decode_request(key, got["fields"], i, self.worker.pad_id)
            self.backlog[key] = (request, got["lease_id"])
        assert len(got["keys"]) == n, got["keys"]
        return list(got["keys"])

    def serve(self, key: str) -> None:
        """Compute a claimed request into a free slot of its rank's ring (one must be free)."""
        request, lease_id = self.backlog.pop(key)
        slot = self.worker.try_acquire(request.rank)
        assert slot is not None, f"no free slot for {key}"
        teacher_main._serve(
            self.client, self.worker, self.partition, key, request, lease_id, slot, None
        )


@pytest.mark.timeout(120)
def test_later_results_holding_every_slot_are_given_back_and_asked_again_after_the_waiting_one(
    queue, projection
):
    # 6 samples: micro-batches a, b, c (2 rows each), asked in that order; a ring of 2 slots.
    # The teacher computes b and c first (a's request came back late: asked again, or
    # redelivered after its teacher died): they hold both slots, and a can never get one while
    # the trainer, waiting for a, keeps them
    samples = setup.samples()[:6]
    keys = [f"s{i}" for i in range(len(samples))]
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, keys, samples_to_put_fields(samples))
    config = setup.trainer_config(
        projection,
        queue=queue,
        partition=PARTITION,
        feed={"claim_timeout_s": 0.2, "grad_accum": 3},
        teacher={"verify_logits": True, "timeout_s": 600.0},
    )
    with (
        TeacherWorker(_teacher_config(queue)) as teacher_worker,
        QueueClient(queue, timeout_s=10) as teacher_client,
        QueueClient(queue, timeout_s=10) as client,
        LogitRingReader() as reader,
    ):
        teacher = _ManualTeacher(teacher_client, teacher_worker)
        feed = setup.teacher_feed(client, config, pads=setup.pads(), reader=reader)
        a, b, c = feed.next_step(3)
        asked = [mb.context.asked[0].request_key for mb in (a, b, c)]
        assert teacher.claim(3) == asked
        teacher.serve(asked[1])
        teacher.serve(asked[2])
        ring = teacher_worker.rings[0]
        assert sorted(ring.in_flight()) == [0, 1]  # b and c hold the ring: a has no slot

        # one round of a's wait: it takes b's and c's results, sees them hold the whole ring
        teacher_client = feed.teachers[0]
        teacher_client.poll(a.context.asked[0])
        assert a.context.asked[0].record is None
        assert ring.in_flight() == []  # released: the teacher has both slots again
        assert teacher_client.deferred == [b.context.asked[0], c.context.asked[0]]
        assert b.context.asked[0].record is None and c.context.asked[0].record is None
        assert feed.counters["re_requests"] == 0  # not yet: after a has its result

        teacher.serve(asked[0])  # a slot is free: the teacher computes a
        logits = a.teacher_logits()
        assert torch.equal(logits, setup.teacher_logits(a.batch).to(logits.dtype))
        assert teacher_client.deferred == [] and feed.counters["re_requests"] == 2
        again = [b.context.asked[0].request_key, c.context.asked[0].request_key]
        assert set(again).isdisjoint(asked)
        a.done()
        assert teacher.claim(2) == again  # b and c asked again, after a, in their order
        for key in again:
            teacher.serve(key)
        for mb in (b, c):
            logits = mb.teacher_logits()
            assert torch.equal(logits, setup.teacher_logits(mb.batch).to(logits.dtype)), mb.keys
            mb.done()

        assert ring.in_flight() == [] and teacher_worker.computed == 5
        assert feed.counters == {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 2}
        # every request record was cleared, the given-back results' included
        assert client.status(teacher.partition, teacher_client.trainer_task)["samples"] == 0
        feed.ack([a, b, c])
        feed.give_back()


@pytest.mark.timeout(120)
def test_a_result_that_arrived_during_the_backward_is_taken_before_its_micro_batch_asks(
    queue, projection
):
    # the record of the next micro-batch is claimed when the previous one is done (its backward
    # queued), so opening its slot in the next step costs no queue round trip
    samples = setup.samples()[:4]
    keys = [f"s{i}" for i in range(len(samples))]
    with QueueClient(queue, timeout_s=10) as client:
        client.put(PARTITION, keys, samples_to_put_fields(samples))
    config = setup.trainer_config(
        projection,
        queue=queue,
        partition=PARTITION,
        feed={"claim_timeout_s": 0.2, "grad_accum": 2},
        teacher={"verify_logits": True},
    )
    with (
        TeacherWorker(_teacher_config(queue)) as teacher_worker,
        QueueClient(queue, timeout_s=10) as teacher_client,
        QueueClient(queue, timeout_s=10) as client,
        LogitRingReader() as reader,
    ):
        teacher = _ManualTeacher(teacher_client, teacher_worker)
        feed = setup.teacher_feed(client, config, pads=setup.pads(), reader=reader)
        a, b = feed.next_step(2)
        asked = teacher.claim(2)
        teacher.serve(asked[0])
        a.teacher_logits()
        assert b.context.asked[0].record is None  # not computed yet
        teacher.serve(asked[1])
        a.done()
        assert b.context.asked[0].record is not None  # taken while a's backward ran
        logits = b.teacher_logits()
        assert torch.equal(logits, setup.teacher_logits(b.batch).to(logits.dtype))
        b.done()
        assert feed.counters == {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}
        feed.ack([a, b])
        feed.give_back()
