"""TeacherClient's watch of its teacher, with a stand-in queue and real shm rings: a request
waiting on a dead teacher is put again at once, once; a live teacher is never asked twice; a late
result of an old request is dropped, its slot released, never trained on. A result of a successor
(another incarnation of the group's teacher) tells the death at once, before the dead one's
heartbeat is stale, for the ring and the hidden transport alike; the old records stay, so a
result the successor already wrote on one keeps no slot of its ring. Each teacher of a loss of
several has its own requests and successors."""

from __future__ import annotations

import time

import pytest
import torch

from services import protocol as proto
from services.trainer.config import TrainerConfig
from services.trainer.sections import TeacherLinkConfig
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
        self.partitions: list[str] = []  # the request partition of each put
        self.cleared: list[str] = []
        self.acked: list[str] = []
        self.arrived: list[tuple[str, proto.Result]] = []
        self.meta: list[str] = []  # the meta partition's keys (the teachers' announcements)

    def put(self, partition, keys, fields):
        if partition == proto.meta_partition(_client_partition()):
            self.meta += keys
            return
        self.puts += keys
        self.partitions += [partition] * len(keys)

    def list(self, partition):
        return {
            "keys": list(self.meta)
            if partition == proto.meta_partition(_client_partition())
            else []
        }

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
        self.arrived = [(k, r) for k, r in self.arrived if k not in keys]  # with its result


@pytest.fixture
def ring():
    writer = LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32, heartbeat_s=0.05
    )
    reader = LogitRingReader(dead_after_s=0.3)
    yield writer, reader
    reader.close()
    writer.close()


def _answer(queue: _Queue, writer: LogitRingWriter, key: str, teacher: str = "t") -> None:
    slot = writer.acquire(timeout_s=1)
    writer.buffer(slot)[:B, :U].fill_(1.0)
    handle = writer.publish(slot, rows=B, length=U)
    result = proto.Result("shm", teacher, writer.descriptor, handle, W, B, U)
    queue.arrived.append((key, result))


def _client_partition() -> str:
    return TrainerConfig(loss=CrossTokenizerLossConfig(mode="ce")).partition


def _client(queue, reader, device: str = "cpu", index: int = 0) -> TeacherClient:
    return TeacherClient(
        queue, TeacherLinkConfig(timeout_s=300.0, dead_after_s=0.3), _client_partition(), 0,
        torch.device(device), lease_s=300.0, claim_timeout_s=0.01, reader=reader, index=index,
    )  # fmt: skip


def _asked() -> Asked:
    return Asked(rows=[torch.arange(U)], shape=(B, U))


def _answered(queue, writer, client, teacher: str = "t") -> Asked:
    """A micro-batch asked for and answered by ``teacher`` (its record not taken yet)."""
    p = _asked()
    client.ask(p)
    _answer(queue, writer, p.request_key, teacher=teacher)
    return p


def test_a_request_waiting_on_a_dead_teacher_is_put_again_at_once_and_only_once(ring):
    writer, reader = ring
    queue = _Queue()
    client = _client(queue, reader)
    first = _answered(queue, writer, client)
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
    assert queue.puts[-1] == waiting.request_key and old_key not in queue.cleared
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


def test_a_successor_s_first_result_asks_again_at_once_what_its_predecessor_held(ring):
    # the teacher dies holding the lease of `held`; its successor is ready before the heartbeat
    # of the dead one's ring is stale and answers `later`, which the dead one had not claimed
    writer, reader = ring
    queue = _Queue()
    client = _client(queue, reader)
    first = _answered(queue, writer, client, teacher="t1")
    client.logits(first)
    client.done(first)
    held, later = _asked(), _asked()
    client.ask(held)
    client.ask(later)
    old_key = held.request_key
    successor = LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32, heartbeat_s=0.05
    )
    try:
        _answer(queue, successor, later.request_key, teacher="t2")
        assert reader.why_dead(writer.descriptor) is None  # the death does not show yet
        client.poll(held)
        assert later.record is not None and later.attempts == 1  # served: not asked again
        assert held.request_key != old_key and held.attempts == 2
        assert client.teacher == "t2" and client.counters["re_requests"] == 1

        # the dead one's heartbeat goes stale later, and its late result comes: neither asks
        # again, the result is dropped, and the successor still serves
        writer._state.stop.set()
        time.sleep(0.4)
        queue.arrived.append(
            (old_key, proto.Result("shm", "t1", writer.descriptor, {"slot": 0}, W, B, U))
        )
        client.poll(held)
        assert held.record is None and old_key in queue.acked
        assert client.teacher == "t2" and client.counters["re_requests"] == 1
        _answer(queue, successor, held.request_key, teacher="t2")
        client.poll(held)
        assert client.logits(held).shape == (B, U, W) and len(queue.puts) == 4
    finally:
        successor.close()


def test_a_successor_without_a_ring_tells_the_death_too():
    # the hidden transport: results carry hidden states, no ring, no heartbeat to watch
    queue = _Queue()
    client = _client(queue, reader=None)
    answered, held, later = _asked(), _asked(), _asked()
    for p in (answered, held, later):
        client.ask(p)
    queue.arrived.append((answered.request_key, proto.Result("hidden", "t1", None, None, W, B, U)))
    client.poll(held)
    assert answered.record is not None and client.teacher == "t1"
    assert held.attempts == later.attempts == 1  # the first teacher seen replaces none
    old_key = held.request_key
    queue.arrived.append((later.request_key, proto.Result("hidden", "t2", None, None, W, B, U)))
    client.poll(held)
    assert later.record is not None and later.attempts == 1
    assert held.request_key != old_key and held.teacher == "t2"
    for _ in range(3):  # put for the successor: not again
        client.poll(held)
    assert client.counters["re_requests"] == 1 and len(queue.puts) == 4


def test_a_result_the_successor_wrote_on_an_old_request_gives_its_slot_back(ring):
    # the successor claimed both requests the dead teacher had not; the result of `other` lands
    # while the rank handles the result of `later`: asked again, its old record must not be
    # cleared with that result on it (the successor's slot would never come back)
    writer, reader = ring
    queue = _Queue()
    client = _client(queue, reader)
    first = _answered(queue, writer, client, teacher="t1")
    client.logits(first)
    client.done(first)
    held, later, other = _asked(), _asked(), _asked()
    for p in (held, later, other):
        client.ask(p)
    other_key = other.request_key
    successor = LogitRingWriter(
        transport="shm", num_slots=2, slot_shape=(B, U, W), dtype=torch.float32, heartbeat_s=0.05
    )
    try:
        _answer(queue, successor, later.request_key, teacher="t2")
        claim = queue.claim

        def claim_then_the_successor_writes(*args, **kwargs):
            got = claim(*args, **kwargs)
            if got["keys"]:
                _answer(queue, successor, other_key, teacher="t2")
            return got

        queue.claim = claim_then_the_successor_writes
        client.poll(held)
        assert other.request_key != other_key and later.record is not None
        queue.claim = claim
        client.poll(held)  # the result on the old record comes: dropped, its slot released
        assert other_key in queue.acked and other.record is None
        assert successor.in_flight() == [later.record[0].handle["slot"]]
        client.done(later)
        assert successor.in_flight() == []
    finally:
        successor.close()


def test_prefetch_off_a_cuda_device_leaves_the_logits_to_the_wait(ring):
    writer, reader = ring
    queue = _Queue()
    client = _client(queue, reader)
    p = _answered(queue, writer, client)
    client.claim_records(0.01)
    assert reader.slot_device(writer.descriptor) == torch.device("cpu")
    client.prefetch(p)
    assert p.prefetched is None
    assert torch.equal(client.logits(p), torch.ones(B, U, W))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_logits_of_a_teacher_on_another_gpu_are_copied_before_the_forward_and_equal():
    # the ring on cuda:1, the trainer on cuda:0: prefetch copies on a stream of its own (the
    # forward is not in front of it), logits() hands that copy over; a later request takes the
    # plain path and gives the same numbers
    writer = LogitRingWriter(
        transport="cuda_ipc", num_slots=2, slot_shape=(B, U, W), dtype=torch.bfloat16,
        device="cuda:1",
    )  # fmt: skip
    reader = LogitRingReader(device="cuda:0", dead_after_s=5.0)
    queue = _Queue()
    client = _client(queue, reader, "cuda:0")
    try:
        got = []
        for prefetch in (True, False):
            p = _asked()
            client.ask(p)
            slot = writer.acquire(timeout_s=5)
            writer.buffer(slot)[:B, :U].copy_(torch.arange(U * W).view(1, U, W).to("cuda:1"))
            handle = writer.publish(slot, rows=B, length=U)
            result = proto.Result("cuda_ipc", "t", writer.descriptor, handle, W, B, U)
            queue.arrived.append((p.request_key, result))
            client.claim_records(0.01)
            if prefetch:
                client.prefetch(p)
                assert p.prefetched is not None
            logits = client.logits(p)
            assert logits.device == torch.device("cuda:0") and p.prefetched is None
            got.append(logits.cpu())
            client.done(p)
        assert torch.equal(got[0], got[1])
        assert torch.equal(got[0][0].float(), torch.arange(U * W).view(U, W).float())
    finally:
        reader.close()
        writer.close()


def test_a_teacher_replaced_before_any_result_has_its_requests_asked_again_at_once(
    ring, monkeypatch
):
    # the teacher that held the requests died before this rank saw a result of it (no ring to
    # watch): its successor's announcement is the sign
    from services.trainer import teacher_client

    monkeypatch.setattr(teacher_client, "ANNOUNCEMENTS_EVERY_S", 0.0)
    _, reader = ring
    queue = _Queue()
    proto.announce_teacher(queue, _client_partition(), 0, "first")
    client = _client(queue, reader)
    waiting = _asked()
    client.ask(waiting)
    old_key = waiting.request_key
    client.poll(waiting)  # the same teacher serves: not asked again
    assert queue.puts == [old_key]
    proto.announce_teacher(queue, _client_partition(), 0, "successor")
    client.poll(waiting)
    assert waiting.request_key != old_key and waiting.teacher == "successor"
    assert queue.puts == [old_key, waiting.request_key]
    client.poll(waiting)  # asked again once
    assert len(queue.puts) == 2 and client.counters["re_requests"] == 1


def test_each_teacher_of_the_loss_has_its_own_requests_and_its_own_successors(ring, monkeypatch):
    # a loss of two teachers: one client each, on its teacher's request partition; a successor
    # announced for teacher 1's group is asked teacher 1's requests again, and teacher 0's client
    # (whose group has the same number) sees no change
    from services.trainer import teacher_client

    monkeypatch.setattr(teacher_client, "ANNOUNCEMENTS_EVERY_S", 0.0)
    _, reader = ring
    queue = _Queue()
    partition = _client_partition()
    proto.announce_teacher(queue, partition, 0, "first")
    proto.announce_teacher(queue, partition, 0, "first-of-1", teacher=1)
    clients = [_client(queue, reader, index=j) for j in (0, 1)]
    assert [c.teacher for c in clients] == ["first", "first-of-1"]
    waiting = [_asked(), _asked()]
    for client, p in zip(clients, waiting):
        client.ask(p)
    assert queue.partitions == [f"{partition}.teacher0", f"{partition}.t1.teacher0"]
    first_keys = [p.request_key for p in waiting]

    proto.announce_teacher(queue, partition, 0, "successor-of-1", teacher=1)
    for client, p in zip(clients, waiting):
        client.poll(p)
    assert waiting[0].request_key == first_keys[0] and waiting[0].teacher == "first"
    assert clients[0].counters["re_requests"] == 0 and clients[0].teacher == "first"
    assert waiting[1].request_key != first_keys[1] and waiting[1].teacher == "successor-of-1"
    assert clients[1].counters["re_requests"] == 1
    assert queue.partitions[-1] == f"{partition}.t1.teacher0"  # asked again of teacher 1 alone
