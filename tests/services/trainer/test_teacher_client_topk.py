"""TeacherClient with the topk transport, on a real queue with a teacher serving it from a thread:
each micro-batch's teacher logits are the dense decode of the teacher's top-K log-probabilities
and log-partition on the trainer's device (the teacher's logits at the top-K ids) (the first record's fields fetched by key, later ones claimed with their
result), the records are cleared once done, and a refused request raises the teacher's message."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from services import protocol as proto
from services.queue.client import QueueClient
from services.teacher import main as teacher_main
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from services.trainer.sections import TeacherLinkConfig
from services.trainer.teacher_client import Asked, TeacherClient
from tests.services.queue.conftest import ServerProcess
from xtoken_core.losses.sparse_teacher import SparseTeacher
from xtoken_core.wire.topk import LOG_FLOOR, decode_topk, encode_topk

PARTITION = "train"
K, MAX_U = 8, 16


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


@pytest.fixture
def teacher(queue):
    """A topk TeacherWorker serving the queue from a thread, stopped after the test."""
    config = TeacherConfig(
        queue=queue, partition=PARTITION, model="tiny", tokenizer="smollm2", max_batch=2,
        max_length=MAX_U, claim_timeout_s=0.1, transport="topk", top_k=K,
    )  # fmt: skip
    worker = TeacherWorker(config)
    client = QueueClient(queue, timeout_s=10, name="teacher-test")
    lc = types.SimpleNamespace(stop=threading.Event())
    errors: list[BaseException] = []
    partition = proto.request_partition(PARTITION, 0)

    def serve():
        try:
            teacher_main._loop(client, worker, partition, config, lc, None)
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield worker
    lc.stop.set()
    thread.join(timeout=20)
    client.close()
    worker.close()
    assert not thread.is_alive() and not errors, errors


@pytest.fixture
def trainer_queue(queue):
    with QueueClient(queue, timeout_s=10, name="trainer-test") as client:
        yield client


def _client(queue_client) -> TeacherClient:
    return TeacherClient(
        queue_client, TeacherLinkConfig(timeout_s=60.0), PARTITION, 0, torch.device("cpu"),
        lease_s=60.0, claim_timeout_s=0.2,
    )  # fmt: skip


def _asked(lengths: list[int], seed: int) -> Asked:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 49152, (n,), generator=g) for n in lengths]
    return Asked(rows=rows, shape=(len(rows), max(lengths)))


def _logits(worker: TeacherWorker, p: Asked) -> torch.Tensor:
    """The teacher's logits ``[B, U, W]`` of ``p``."""
    fields = proto.request_fields(p.rows, 0)
    return worker.logits(proto.decode_request("want", fields, 0, worker.pad_id))


def _want(worker: TeacherWorker, p: Asked) -> torch.Tensor:
    """What the trainer should get: the decode of the teacher's own top-K encoding."""
    return decode_topk(encode_topk(_logits(worker, p), K), worker.width)


def test_topk_results_reach_the_loss_as_targets_that_decode_to_the_teachers_logits(teacher, trainer_queue):
    client = _client(trainer_queue)
    first, second = _asked([MAX_U, 9], seed=1), _asked([5], seed=2)
    client.ask(first)
    got_first = client.logits(first)  # its fields fetched by key: no topk result was seen yet
    assert client.claimed_fields == [proto.result_field(0), *proto.topk_fields(0)]
    client.ask(second)
    got_second = client.logits(second)  # claimed with its result
    for p, targets in ((first, got_first), (second, got_second)):
        assert isinstance(targets, SparseTeacher)  # handed to the loss as targets
        got = targets.dense()
        assert got.dtype == torch.float32 and got.shape == (*p.shape, teacher.width)
        assert torch.equal(got, _want(teacher, p))
        assert got.isfinite().all() and got.min() > LOG_FLOOR
        z_BUW = _logits(teacher, p).float()
        top_ids = z_BUW.topk(K, -1).indices
        torch.testing.assert_close(got.gather(-1, top_ids), z_BUW.gather(-1, top_ids))
        torch.testing.assert_close(torch.logsumexp(got, -1), torch.logsumexp(z_BUW, -1))
        client.done(p)
    part = proto.request_partition(PARTITION, 0)
    assert trainer_queue.list(part)["keys"] == []  # acked and cleared
    assert client.counters == {"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0}


def test_a_refused_topk_request_raises_the_teachers_message(teacher, trainer_queue):
    client = _client(trainer_queue)
    served = _asked([4], seed=3)
    client.ask(served)
    client.logits(served)  # the topk fields are claimed from here on
    client.done(served)
    too_long = _asked([MAX_U + 1], seed=4)
    client.ask(too_long)
    with pytest.raises(RuntimeError, match=r"the teacher refused a request: .* max_length"):
        client.logits(too_long)
