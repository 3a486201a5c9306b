"""The teacher's topk transport (tiny teacher, smollm2 tokenizer): each request's fields hold the
top-K log-probabilities of the teacher logits and their log-partition, no ring is made, a refused request still carries
empty topk fields, and a K over the vocab (or below 1) is refused in one line, by the process
before it serves."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from services import protocol as proto
from services.teacher import main as teacher_main
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire.topk import decode_topk, encode_topk

MAX_B, MAX_U, K = 2, 12, 8
VOCAB = 49152  # the smollm2 tokenizer's, which the tiny preset takes


def _config(**overrides) -> TeacherConfig:
    fields = dict(
        model="tiny", tokenizer="smollm2", max_batch=MAX_B, max_length=MAX_U, seed=3,
        transport="topk", top_k=K,
    )  # fmt: skip
    return TeacherConfig(**{**fields, **overrides})


@pytest.fixture
def worker():
    with TeacherWorker(_config()) as w:
        yield w


def _request(worker: TeacherWorker, lengths: list[int], rank: int = 0, key: str = "t:1"):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, worker.tokenizer_vocab, (n,), generator=g) for n in lengths]
    return proto.decode_request(key, proto.request_fields(rows, rank), 0, worker.pad_id)


def _result(fields: dict, rank: int = 0, key: str = "t:1") -> proto.Result:
    return proto.Result.from_blob(fields[proto.result_field(rank)], key)


def test_topk_fields_hold_the_top_k_log_probs_and_the_log_partition_of_the_teacher_logits(worker):
    request = _request(worker, [MAX_U, 5], rank=1)
    assert worker.try_acquire(1) == 0
    fields = worker.compute(request, 0)
    result = _result(fields, rank=1)
    assert (result.transport, result.error, result.handle) == ("topk", None, None)
    assert (result.rows, result.length, result.width) == (2, MAX_U, VOCAB)
    assert set(fields) == {proto.result_field(1), *proto.topk_fields(1)}
    assert worker.rings == {} and worker.computed == 1  # nothing but the queue fields

    columns = [fields[name] for name in proto.topk_fields(1)]
    assert [tuple(c.values.shape) for c in columns] == [(24, K), (24, K), (24,), (24,)]
    targets = proto.topk_from_columns(columns, 2, MAX_U, "t:1")
    want = encode_topk(worker.logits(request), K)
    for got_t, want_t in zip(targets, want, strict=True):
        assert torch.equal(got_t, want_t)
    # and they are the log_softmax of the logits at their K largest ids, and its log-partition
    z_BUW = worker.logits(request).float()
    lp_BUW = torch.log_softmax(z_BUW, -1)
    top_BUK = lp_BUW.topk(K, -1)
    torch.testing.assert_close(targets.logprobs_NK, top_BUK.values, rtol=0, atol=1e-5)
    lse_BU = torch.logsumexp(z_BUW, -1)
    torch.testing.assert_close(targets.lse_N, lse_BU, rtol=0, atol=1e-5)
    # decoded: the teacher's logits at the top K ids, the same partition over the row
    dense_BUW = decode_topk(targets, VOCAB)
    top_ids = targets.ids_NK.long()
    torch.testing.assert_close(dense_BUW.gather(-1, top_ids), z_BUW.gather(-1, top_ids))
    torch.testing.assert_close(torch.logsumexp(dense_BUW, -1), lse_BU)


def test_a_refused_topk_request_still_carries_empty_topk_fields(worker):
    fields = worker.compute(_request(worker, [MAX_U + 3]))
    result = _result(fields)
    assert result.error is not None and "max_length" in result.error
    columns = [fields[name] for name in proto.topk_fields(0)]
    # the partition's trailing shapes (K, K, none, none) and dtypes, with no positions
    assert [(tuple(c.values.shape), c.values.dtype) for c in columns] == [
        ((0, K), torch.int32),
        ((0, K), torch.float32),
        ((0,), torch.float32),
        ((0,), torch.float32),
    ]
    assert proto.topk_from_columns(columns, 0, 0, "t:1").ids_NK.shape == (0, 0, K)


def test_a_k_over_the_vocab_refuses_each_request_naming_the_setting():
    with TeacherWorker(_config(top_k=VOCAB + 1)) as worker:
        result = _result(worker.compute(_request(worker, [4])))
    assert result.error == (
        f"teacher.top_k={VOCAB + 1} is over the teacher's vocab of {VOCAB}: set teacher.top_k "
        f"<= {VOCAB}"
    )


def test_a_teacher_process_with_a_k_over_the_vocab_stops_before_it_serves(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "16MiB")
    lc = types.SimpleNamespace(
        stop=threading.Event(), ready=lambda **_: pytest.fail("the teacher served")
    )
    try:
        with pytest.raises(ValueError) as exc:
            teacher_main.serve(_config(queue=server.address, top_k=VOCAB + 1), lc)
    finally:
        server.stop()
    assert str(exc.value) == (
        f"teacher.top_k={VOCAB + 1} must be between 1 and the teacher's vocab of {VOCAB}; set "
        f"teacher.top_k <= {VOCAB}"
    )


@pytest.mark.parametrize("top_k", [0, -1, 2.5])
def test_a_top_k_below_one_is_refused_in_one_line(top_k):
    with pytest.raises(ValueError) as exc:
        _config(top_k=top_k)
    assert str(exc.value) == (
        f"top_k={top_k!r}: the log-probs sent per teacher token must be an int >= 1; set "
        "teacher.top_k >= 1"
    )
