"""Retention and the trainer's feed: a feed that registers its task has the
queue drop every sample a checkpoint holds, so a corpus several times the queue's --capacity
streams through it and the epoch still ends on the collators' marker; after a crash the samples
trained since the checkpoint are trained again, and the dead launch's task holds nothing for
long; a feed that does not register keeps every sample (real queue server, no teacher)."""

from __future__ import annotations

import threading
import time

import pytest

from services.collator.worker import samples_to_put_fields
from services.protocol import put_eof
from services.queue.client import QueueClient
from tests.sections import merged
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup
from xtoken_core.wire import JaggedColumn

CAPACITY = 48_000  # bytes: about 70 samples of the test corpus


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", str(CAPACITY))
    yield server.address
    server.stop()


@pytest.fixture(scope="module")
def fields():
    """The put fields of the 8 test samples (about 670 bytes each)."""
    return samples_to_put_fields(setup.samples())


def _nbytes(fields) -> int:
    return sum(
        v.values.nbytes + v.offsets.nbytes if isinstance(v, JaggedColumn) else v.nbytes
        for v in fields.values()
    )


def _feed(client, queue, partition, register, task="trainer/e0/s0", trained=(), **config):
    """A trainer rank's feed of the CE loss (no teacher), as main.py builds it."""
    config = setup.trainer_config(
        None, queue=queue, partition=partition,
        **merged(
            {"feed": {"micro_batch": 4, "grad_accum": 2, "claim_timeout_s": 0.2},
             "schedule": {"checkpoint_every": 2}},
            config,
        ),
    )  # fmt: skip
    pads = {"student_pad_id": 0, "teacher_pad_id": 0}
    return setup.teacher_feed(
        client, config, set(trained), task=task, pads=pads, register=register,
        replaces="trainer/e0/",
    )  # fmt: skip


def _train(feed, steps=None, failed=lambda: None) -> list[str]:
    """The keys the feed hands over until its epoch ends (or ``steps``), acked step by step,
    committed after every ``checkpoint_every`` steps as main.py does after a checkpoint."""
    seen, step = [], 0
    while not feed.ended and (steps is None or step < steps):
        assert not failed(), failed()
        mbs = feed.next_step(feed.config.grad_accum)
        if not mbs:
            continue
        feed.ack(mbs)
        seen += [k for mb in mbs for k in mb.keys]
        step += 1
        if step % feed.samples.checkpoint_every == 0:
            feed.commit()
    return seen


@pytest.mark.timeout(120)
def test_a_registered_feed_streams_a_corpus_larger_than_the_capacity(queue, fields):
    rounds = 80  # 640 samples, about 9 x the capacity
    keys = [f"r{r}-s{i}" for r in range(rounds) for i in range(8)]
    assert rounds * _nbytes(fields) > 5 * CAPACITY
    produced: dict = {}

    def produce():
        try:
            with QueueClient(queue, timeout_s=10, shm="never", name="collator") as client:
                for r in range(rounds):  # blocks while the queue is full
                    client.put("stream", keys[8 * r : 8 * r + 8], fields, timeout_s=60)
                put_eof(client, "stream", len(keys))
        except Exception as e:  # surfaced below
            produced["error"] = e

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    with QueueClient(queue, timeout_s=10, name="trainer0") as client:
        feed = _feed(client, queue, "stream", register=True)
        seen = _train(feed, failed=lambda: produced.get("error"))
        feed.commit()  # the last checkpoint
        producer.join(30)
        assert "error" not in produced, produced.get("error")
        assert sorted(seen) == sorted(keys)  # each sample trained once, the epoch ended
        status = client.status("stream", "trainer/e0/s0")
        stats = client.stats()
    assert status["registered"] and status["dropped"] == len(keys)
    part = stats["partitions"]["stream"]
    assert part["samples"] == 0 and part["bytes"] == 0  # the memory of every sample released
    assert part["dropped"] == len(keys)


@pytest.mark.timeout(120)
def test_an_unregistered_feed_leaves_its_samples_in_the_queue(queue, fields):
    keys = [f"s{i}" for i in range(8)]
    with QueueClient(queue, timeout_s=10, shm="never") as client:
        client.put("kept", keys, fields)
        put_eof(client, "kept", len(keys))
        used = client.stats()["partitions"]["kept"]["bytes"]
        feed = _feed(client, queue, "kept", register=False)
        assert sorted(_train(feed)) == keys
        part = client.stats()["partitions"]["kept"]
        status = client.status("kept", "trainer/e0/s0")
    assert part["samples"] == len(keys) and part["bytes"] == used > 0  # a second epoch reads them
    assert not status["registered"] and status["dropped"] == 0


@pytest.mark.timeout(120)
def test_a_resumed_feed_trains_again_what_no_checkpoint_held_and_frees_the_dead_ones(queue, fields):
    keys = [f"r{r}-s{i}" for r in range(3) for i in range(8)]
    with QueueClient(queue, timeout_s=10, shm="never") as client:
        for r in range(3):
            client.put("resume", keys[8 * r : 8 * r + 8], fields)
        put_eof(client, "resume", len(keys))
        # the first launch: 2 steps, a checkpoint, 1 more step, then it dies (no commit)
        first = _feed(client, queue, "resume", register=True, feed={"lease_s": 1.5})
        saved = set(_train(first, steps=2))  # committed after step 2
        lapse_at = time.monotonic() + 1.5
        lost = _train(first, steps=1)  # trained, in no checkpoint: its acks wait
        assert len(saved) == 16 and len(lost) == 8
        status = client.status("resume", "trainer/e0/s0")
        assert status["dropped"] == 16 and status["leased"] == 8
        # the resumed launch: a fresh task, the checkpoint's keys; it trains the rest
        second = _feed(client, queue, "resume", register=True, task="trainer/e0/s2", trained=saved)
        again = _train(second)
        assert sorted(again) == sorted(set(keys) - saved)  # exactly once from the checkpoint
        assert set(lost) <= set(again)
        time.sleep(max(0.0, lapse_at - time.monotonic()) + 0.2)
        second.commit()  # the last checkpoint; the dead launch's leases lapsed meanwhile
        part = client.stats()["partitions"]["resume"]
    assert part["registered"] == ["trainer/e0/s0", "trainer/e0/s2"]
    assert part["samples"] == 0 and part["bytes"] == 0 and part["dropped"] == len(keys)


@pytest.mark.timeout(120)
def test_samples_whose_lease_lapsed_before_the_checkpoint_are_acked_when_they_come_again(
    queue, fields, caplog
):
    keys = [f"s{i}" for i in range(8)]
    with QueueClient(queue, timeout_s=10, shm="never") as client:
        client.put("lapse", keys, fields)
        put_eof(client, "lapse", len(keys))
        feed = _feed(
            client, queue, "lapse", register=True, feed={"lease_s": 0.5},
            schedule={"checkpoint_every": 10},
        )  # fmt: skip
        assert sorted(_train(feed, steps=1)) == keys  # acks wait for the checkpoint
        time.sleep(0.7)
        feed.commit()  # the leases lapsed: the samples are back, not dropped
        assert "lease_s" in caplog.text
        assert client.status("lapse", "trainer/e0/s0")["pending"] == len(keys)
        assert _train(feed) == []  # they come again: trained already, acked at once
        part = client.stats()["partitions"]["lapse"]
    assert part["samples"] == 0 and part["dropped"] == len(keys)
