"""The teacher's serving loop in-process against a real queue: a rank whose trainer holds every
slot never blocks another rank, a malformed request gets an error result, not a crash, and a
stopping teacher spends no retries on a queue that went away."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from services import protocol as proto
from services.queue.client import QueueClient
from services.teacher import main as teacher_main
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from tests.services.queue.conftest import ServerProcess, stop_with_queue
from xtoken_core.ipc.logit_ring import LogitRingReader
from xtoken_core.wire import JaggedColumn

PARTITION = "train"


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


@pytest.fixture
def start_teacher(queue):
    """``start(**config overrides)``: a TeacherWorker serving the queue from a thread, stopped
    after the test."""
    running: list[tuple] = []

    def start(**overrides) -> TeacherWorker:
        fields = dict(
            queue=queue, partition=PARTITION, model="tiny", tokenizer="smollm2", slots=2,
            max_batch=2, max_length=16, claim_timeout_s=0.1,
        )  # fmt: skip
        fields.update(overrides)
        config = TeacherConfig(**fields)
        worker = TeacherWorker(config)
        client = QueueClient(queue, timeout_s=10, name="teacher-test")
        lc = types.SimpleNamespace(stop=threading.Event())
        partition = proto.request_partition(PARTITION, 0)
        errors: list[BaseException] = []

        def serve():
            try:
                teacher_main._loop(client, worker, partition, config, lc, None)
            except BaseException as e:  # surfaced by the test
                errors.append(e)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        running.append((worker, client, lc, thread, errors))
        return worker

    yield start
    for worker, client, lc, thread, errors in running:
        lc.stop.set()
        thread.join(timeout=20)
        client.close()
        worker.close()
        assert not thread.is_alive() and not errors, errors


@pytest.fixture
def teacher(start_teacher):
    """A TeacherWorker serving the queue from a thread, stopped after the test."""
    return start_teacher()


def _claim(client, rank: int, want: int, timeout_s: float = 15.0) -> dict[str, proto.Result]:
    """Claim results of ``rank`` until ``want`` arrived (or the time is up)."""
    out: dict[str, proto.Result] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        got = client.claim(
            proto.request_partition(PARTITION, 0), f"test-trainer{rank}", [proto.result_field(rank)],
            8, timeout_s=0.2,
        )  # fmt: skip
        column = got["fields"].get(proto.result_field(rank))
        for i, key in enumerate(got["keys"]):
            row = column.row(i)
            one = JaggedColumn(row, torch.tensor([0, row.numel()], dtype=torch.int64))
            out[key] = proto.Result.from_blob(one, key)
    return out


def test_a_busy_rank_does_not_block_another_and_a_bad_request_gets_an_error(queue, teacher):
    part = proto.request_partition(PARTITION, 0)
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        for i in range(3):  # rank 0 asks three times; its trainer never releases (yet)
            client.put(part, [f"a:{i}"], proto.request_fields([torch.arange(5)], rank=0))
        client.put(part, ["b:0"], proto.request_fields([torch.arange(4), torch.arange(2)], rank=1))
        bad = proto.request_fields([torch.arange(3)], rank=1)
        bad["teacher_lengths"] = JaggedColumn(torch.tensor([7]), torch.tensor([0, 1]))
        client.put(part, ["bad:0"], bad)

        rank1 = _claim(client, 1, 2)
        assert rank1["b:0"].error is None and (rank1["b:0"].rows, rank1["b:0"].length) == (2, 4)
        assert "teacher_lengths [7] do not add up to the 3 ids" in rank1["bad:0"].error

        rank0 = _claim(client, 0, 3, timeout_s=2.0)
        assert sorted(rank0) == ["a:0", "a:1"]  # two slots, both held: a:2 waits
        assert teacher.try_acquire(0) is None
        first = rank0["a:0"]
        reader.view(first.descriptor, first.handle)
        reader.release(first.descriptor, first.handle)
        assert sorted(_claim(client, 0, 1)) == ["a:2"]  # served once a slot came back


def test_waiting_requests_share_one_forward_and_each_gets_its_reply(queue, start_teacher):
    part = proto.request_partition(PARTITION, 0)
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
        # all waiting before the teacher starts: its first claim takes the first four
        client.put(part, ["a:0"], proto.request_fields([torch.arange(12), torch.arange(5)], 0))
        client.put(part, ["a:1"], proto.request_fields([torch.arange(12)], 0))
        client.put(part, ["b:0"], proto.request_fields([torch.arange(3), torch.arange(12)], 1))
        bad = proto.request_fields([torch.arange(3)], rank=1)
        bad["teacher_lengths"] = JaggedColumn(torch.tensor([7]), torch.tensor([0, 1]))
        client.put(part, ["bad:0"], bad)
        client.put(part, ["b:1"], proto.request_fields([torch.arange(7)], 1))  # another length
        teacher = start_teacher(forward_rows=8)

        rank0, rank1 = _claim(client, 0, 2), _claim(client, 1, 3)
        assert "teacher_lengths [7] do not add up to the 3 ids" in rank1.pop("bad:0").error
        for key, result in {**rank0, **rank1}.items():
            assert result.error is None, (key, result.error)
            view = reader.view(result.descriptor, result.handle)
            assert view.shape[:2] == {"a:0": (2, 12), "a:1": (1, 12), "b:0": (2, 12)}.get(
                key, (1, 7)
            )
        assert sorted(rank0) == ["a:0", "a:1"] and sorted(rank1) == ["b:0", "b:1"]
        assert teacher.computed == 4
        assert teacher.forwards == 2  # a:0, a:1 and b:0 in one forward; b:1 in its own


def _backlog_of(client, n: int) -> dict:
    """Put ``n`` requests and claim them for the teacher's task: a backlog as _loop holds it."""
    part = proto.request_partition(PARTITION, 0)
    keys = [f"r{i}" for i in range(n)]
    ids = JaggedColumn(torch.arange(4 * n), torch.arange(0, 4 * n + 1, 4, dtype=torch.int64))
    client.put(part, keys, {"teacher_input_ids": ids})
    got = client.claim(part, proto.TEACHER_TASK, ["teacher_input_ids"], n, timeout_s=5)
    assert sorted(got["keys"]) == keys
    return {k: (None, got["lease_id"]) for k in got["keys"]}


def test_a_stopping_teacher_gives_its_unserved_requests_back(queue):
    part = proto.request_partition(PARTITION, 0)
    with QueueClient(queue, timeout_s=10, name="teacher-test") as client:
        backlog = _backlog_of(client, 3)
        teacher_main._give_back(client, part, backlog)
        again = client.claim(part, proto.TEACHER_TASK, ["teacher_input_ids"], 3, timeout_s=5)
    assert sorted(again["keys"]) == sorted(backlog)


def test_a_stopping_teacher_does_not_wait_on_a_queue_that_went_away(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    part = proto.request_partition(PARTITION, 0)
    client = QueueClient(server.address, timeout_s=10, retries=2, name="teacher-test")
    try:
        backlog = _backlog_of(client, 3)
        server.stop()  # the run stops the queue together with the teacher
        t0 = time.monotonic()
        teacher_main._give_back(client, part, backlog)
        elapsed = time.monotonic() - t0
    finally:
        client.close()
    # one attempt of GIVE_BACK_TIMEOUT_S for all three, not 3 keys x 3 attempts x 10 s
    assert elapsed < teacher_main.GIVE_BACK_TIMEOUT_S + 2.0, elapsed


def test_a_teacher_stopped_while_its_queue_dies_returns_without_retrying_it(tmp_path):
    """Stopped while its claim waits at the queue, and the queue killed a moment later (it answers
    nothing): the teacher returns in less than one reply's wait (queue_timeout_s), not after a
    resend and two retries of queue_timeout_s + claim_timeout_s each (45 s here)."""
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    config = TeacherConfig(
        queue=server.address, partition=PARTITION, model="tiny", tokenizer="smollm2", slots=2,
        max_batch=2, max_length=16, claim_timeout_s=5.0, queue_timeout_s=10.0,
    )  # fmt: skip
    serving = threading.Event()
    lc = types.SimpleNamespace(stop=threading.Event(), ready=lambda **info: serving.set())
    result: dict = {}

    def serve():
        try:
            result["code"] = teacher_main._serve_queue(config, lc, [], TeacherWorker)
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert serving.wait(60), result
        time.sleep(1.0)  # its claim waits at the queue (claim_timeout_s)
        stop_s = stop_with_queue(lc.stop, server, thread)  # a SIGTERM with the queue's SIGKILL
    finally:
        lc.stop.set()
        server.stop()
    assert result == {"code": 0}, result
    assert stop_s < config.queue_timeout_s, stop_s


def test_the_runs_teacher_1_serves_its_own_partition_and_announces_itself_apart(queue, tmp_path):
    """A further teacher (``teacher: 1``) claims from ``<partition>.t1.teacher<g>``, never from
    teacher 0's partition, announces itself as ``t1.teacher<g>/<instance>`` and writes its
    metrics apart from teacher 0's."""
    config = TeacherConfig(
        queue=queue, partition=PARTITION, teacher=1, model="tiny", tokenizer="mistral", slots=2,
        max_batch=2, max_length=16, claim_timeout_s=0.1, run_dir=str(tmp_path),
    )  # fmt: skip
    lc = types.SimpleNamespace(stop=threading.Event(), ready=lambda **info: None)
    errors: list[BaseException] = []

    def serve():
        try:
            teacher_main._serve_queue(config, lc, [], TeacherWorker)
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    ours, theirs = proto.request_partition(PARTITION, 0, 1), proto.request_partition(PARTITION, 0)
    assert ours == f"{PARTITION}.t1.teacher0"
    with QueueClient(queue, timeout_s=10) as client, LogitRingReader():
        client.put(theirs, ["t0:0"], proto.request_fields([torch.arange(5)], rank=0))
        client.put(ours, ["t1:0"], proto.request_fields([torch.arange(6)], rank=0))
        thread.start()
        try:
            deadline = time.monotonic() + 30
            got: dict = {"keys": []}
            while not got["keys"] and time.monotonic() < deadline:
                got = client.claim(ours, "test-trainer0", [proto.result_field(0)], 1, timeout_s=0.2)
            assert got["keys"] == ["t1:0"]
            assert proto.teacher_incarnations(client, PARTITION, 0, 1)  # announced as teacher 1
            assert proto.teacher_incarnations(client, PARTITION, 0) == []  # not as teacher 0
            left = client.claim(theirs, "test-trainer0", [proto.result_field(0)], 1, timeout_s=0.2)
            assert left["keys"] == []  # teacher 0's request stays teacher 0's
        finally:
            lc.stop.set()
            thread.join(timeout=20)
    assert not thread.is_alive() and not errors, errors
    assert (tmp_path / "metrics" / "t1.teacher.group0.jsonl").is_file()
    assert not (tmp_path / "metrics" / "teacher.group0.jsonl").exists()


@pytest.fixture
def worker():
    """A TeacherWorker (no queue) whose rings have 2 slots; up to 8 rows share a forward."""
    config = TeacherConfig(
        model="tiny", tokenizer="smollm2", transport="shm", slots=2, max_batch=2, max_length=16,
        forward_rows=8,
    )  # fmt: skip
    with TeacherWorker(config) as worker:
        yield worker


def _waiting(*requests: tuple[str, int, int]) -> dict:
    """A backlog as _loop holds it (oldest first) of ``(key, rank, length)`` requests."""
    return {
        key: (proto.Request(key, rank, torch.arange(length)[None], torch.tensor([length])), 1)
        for key, rank, length in requests
    }


def test_a_slot_freed_while_a_pass_runs_goes_to_the_ranks_oldest_request_not_a_later_one(
    worker,
):
    # rank 0's trainer holds both slots of its ring; it frees one (its reader does, once the
    # GPU read it) just after the pass found none for a:0: a:1 must not take it, or a:1 and
    # a:2 end up holding the ring while the trainer waits for a:0
    ring = worker.ring(0)
    held = [ring.publish(ring.acquire(timeout_s=0), rows=1, length=4) for _ in range(2)]
    backlog = _waiting(("a:0", 0, 4), ("a:1", 0, 4), ("a:2", 0, 4), ("b:0", 1, 4))
    try_acquire = worker.try_acquire
    with LogitRingReader() as reader:

        def acquire_then_free(rank: int) -> int | None:
            slot = try_acquire(rank)
            if rank == 0 and slot is None and ring.in_flight() == [0, 1]:
                reader.release(ring.descriptor, held[0])  # the trainer frees slot 0 now
            return slot

        worker.try_acquire = acquire_then_free
        batch = teacher_main._next_batch(worker, backlog)
        assert [b[0] for b in batch] == ["b:0"]  # another rank is still served
        assert list(backlog) == ["a:0", "a:1", "a:2"]
        assert ring.in_flight() == [1]  # slot 0 is free, and waits for a:0

        batch = teacher_main._next_batch(worker, backlog)
        assert [(b[0], b[3]) for b in batch] == [("a:0", 0)]  # the oldest of rank 0 gets it
        assert list(backlog) == ["a:1", "a:2"]


def test_a_later_request_of_the_forwards_length_does_not_take_a_slot_before_an_earlier_one(
    worker,
):
    # both slots free: a:0 starts a forward, a:1 has another length; a:2 (a:0's length) must
    # not share a:0's forward, or a:0 and a:2 hold the ring while the trainer waits for a:1
    backlog = _waiting(("a:0", 0, 5), ("a:1", 0, 7), ("a:2", 0, 5), ("b:0", 1, 5))
    batch = teacher_main._next_batch(worker, backlog)
    assert [b[0] for b in batch] == ["a:0", "b:0"]  # b:0 (another rank) shares the forward
    assert [b[0] for b in teacher_main._next_batch(worker, backlog)] == ["a:1"]
    assert teacher_main._next_batch(worker, backlog) == []  # a:2 waits for a slot, in turn
    assert list(backlog) == ["a:2"]
