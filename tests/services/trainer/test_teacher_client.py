"""TeacherClient's watch of its teacher's ring, with a stand-in queue and a real shm ring: a
request waiting on a dead teacher is put again at once (its old record cleared), once; a live
teacher is never asked twice; a late result of the dead teacher is dropped, never trained on."""

from __future__ import annotations

import time
import types

import pytest
import torch

from services import protocol as proto
from services.trainer.config import TrainerConfig
from services.trainer.teacher_client import Asked, TeacherClient
from xtoken_core.ipc.logit_ring import LogitRingReader, LogitRingWriter
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.wire import JaggedColumn

B, U, W = 1, 4, 8


class _Queue:
    """The calls TeacherClient makes, recorded; ``claim`` hands out the results set in
    ``arrived``."""

    def __init__(self) -> None:
        self.puts: list[str] = []
        self.cleared: list[str] = []
        self.acked: list[str] = []
        self.arrived: list[tuple[str, proto.Result]] = []

    def put(self, partition, keys, fields):
        self.puts += keys

    def claim(self, partition, task, needs, n, *, fields, timeout_s, lease_s):
        got, self.arrived = self.arrived, []
        if not got:
            return {"keys": [], "fields": {}, "lease_id": None}
        blobs = [r.blob() for _, r in got]
        column = JaggedColumn(
            torch.cat([b.row(0) for b in blobs]),
            torch.tensor([0] + [b.row(0).shape[0] for b in blobs]).cumsum(0),
        )
        return {"keys": [k for k, _ in got], "fields": {proto.result_field(0): column},
                "lease_id": 1}  # fmt: skip

    def ack(self, partition, task, lease_id, keys):
        self.acked += keys

    def clear(self, partition, keys):
        self.cleared += keys


@pytest.fixture
def ring():
    writer = LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32, heartbeat_s=0.05
    )
    reader = LogitRingReader(dead_after_s=0.3)
    yield writer, reader
    reader.close()
    writer.close()


def _answer(queue: _Queue, writer: LogitRingWriter, key: str) -> None:
    slot = writer.acquire(timeout_s=1)
    writer.buffer(slot)[:B, :U].fill_(1.0)
    handle = writer.publish(slot, rows=B, length=U)
    result = proto.Result("shm", "t", writer.descriptor, handle, W, B, U)
    queue.arrived.append((key, result))


def _client(queue, reader) -> TeacherClient:
    config = TrainerConfig(
        loss=CrossTokenizerLossConfig(mode="ce"),
        claim_timeout_s=0.01,
        teacher_timeout_s=300.0,
        dead_after_s=0.3,
    )
    worker = types.SimpleNamespace(device=torch.device("cpu"))
    return TeacherClient(queue, config, 0, worker, reader=reader)


def _asked() -> Asked:
    return Asked(rows=[torch.arange(U)], shape=(B, U))


def test_a_request_waiting_on_a_dead_teacher_is_put_again_at_once_and_only_once(ring):
    writer, reader = ring
    queue = _Queue()
    client = _client(queue, reader)
    first = _asked()
    client.ask(first)
    _answer(queue, writer, first.request_key)
    assert client.logits(first).shape == (B, U, W)  # the ring the rank watches from now on
    client.done(first)

    waiting = _asked()
    client.ask(waiting)
    old_key = waiting.request_key
    for _ in range(3):  # a live teacher that is slow is not asked again
        client.poll(waiting)
    assert queue.puts == [first.request_key, old_key]

    writer._state.stop.set()  # the heartbeat stops: the teacher died
    time.sleep(0.4)  # past dead_after_s
    client.poll(waiting)
    assert waiting.request_key != old_key and waiting.attempts == 2
    assert queue.puts[-1] == waiting.request_key and old_key in queue.cleared
    assert client.counters["re_requests"] == 1
    for _ in range(3):  # asked after the death was seen: not again
        client.poll(waiting)
    assert queue.puts[-1] == waiting.request_key and len(queue.puts) == 3

    # the dead teacher's late result of the old request is dropped, never attached
    queue.arrived.append(
        (old_key, proto.Result("shm", "t", writer.descriptor, {"slot": 0}, W, B, U))
    )
    client.poll(waiting)
    assert waiting.record is None and old_key in queue.acked
    assert client.counters["orphans"] == 1


def test_a_ring_found_dead_by_the_reader_is_named_with_its_heartbeat_age(ring):
    writer, reader = ring
    assert reader.why_dead(writer.descriptor) is None
    writer._state.stop.set()
    time.sleep(0.4)
    why = reader.why_dead(writer.descriptor)
    assert why is not None and "heartbeat" in why and "dead_after_s=0.3" in why
