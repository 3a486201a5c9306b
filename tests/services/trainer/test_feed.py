"""TeacherFeed in-process: samples from a real queue, teacher logits from a TeacherWorker serving
that queue from a thread; every sample is trained once, a short last micro-batch included."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from services.collator.worker import samples_to_put_fields
from services.queue.client import QueueClient
from services.teacher import main as teacher_main
from services.teacher import protocol as proto
from services.teacher.worker import TeacherConfig, TeacherWorker
from services.trainer.feed import TeacherFeed, put_eof
from services.trainer.worker import TrainerWorker
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from xtoken_core.ipc.logit_ring import LogitRingReader

PARTITION = "train"


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


@pytest.fixture
def teacher(queue):
    config = TeacherConfig(
        queue=queue, partition=PARTITION, model="tiny", tokenizer=setup.TEACHER_TOKENIZER,
        slots=2, max_batch=2, max_length=setup.CTX, seed=1, checksum=True, claim_timeout_s=0.1,
    )  # fmt: skip
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
        projection, queue=queue, partition=PARTITION, claim_timeout_s=0.2, verify_logits=True
    )
    worker = TrainerWorker(config)
    trained: set[str] = set()
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        feed = TeacherFeed(client, config, 0, worker, "trainer/e0/s0", trained, reader=reader)
        rows, seen = [], []
        while not feed.ended:
            mbs = feed.next_step(1)
            if not mbs:
                continue
            (mb,) = mbs
            logits = mb.teacher_logits()
            want = setup.teacher_logits(mb.batch).to(logits.dtype)
            assert torch.equal(logits, want), mb.keys  # the slot holds the teacher's forward
            result = worker.train_step(mbs)
            assert not result.skipped
            feed.ack(mbs)
            rows.append(len(mb.keys))
            seen += mb.keys
        feed.give_back()
    assert sorted(seen) == keys and trained == set(keys)
    assert sorted(rows) == [1, 2, 2] and worker.step == 3
    assert feed.counters == {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}
    assert teacher.computed == 3
    assert all(ring.in_flight() == [] for ring in teacher.rings.values())  # every slot released
