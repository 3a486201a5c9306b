"""TeacherWorker without sockets (tiny teacher, smollm2 tokenizer): slot logits equal a direct
forward, one ring per trainer rank, refused requests, the hidden transport."""

from __future__ import annotations

import re

import pytest
import torch

from services import protocol as proto
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from xtoken_core.ipc.logit_ring import LogitRingReader

TOKENIZER = "smollm2"
MAX_B, MAX_U = 2, 12


@pytest.fixture
def make_worker():
    made: list[TeacherWorker] = []

    def make(**overrides) -> TeacherWorker:
        fields = dict(model="tiny", tokenizer=TOKENIZER, max_batch=MAX_B, max_length=MAX_U, seed=3)
        fields.update(overrides)
        worker = TeacherWorker(TeacherConfig(**fields))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.fixture
def reader():
    with LogitRingReader() as r:
        yield r


def _request(worker: TeacherWorker, lengths: list[int], rank: int = 0, key: str = "t:1", seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, worker.tokenizer_vocab, (n,), generator=g) for n in lengths]
    return proto.decode_request(key, proto.request_fields(rows, rank), 0, worker.pad_id)


def _result(fields: dict, rank: int = 0, key: str = "t:1") -> proto.Result:
    return proto.Result.from_blob(fields[proto.result_field(rank)], key)


def test_slot_logits_equal_a_direct_forward_bitwise(make_worker, reader):
    worker = make_worker()
    assert worker.logits_dtype == torch.bfloat16 and worker.width == 49152
    request = _request(worker, [MAX_U, 7])  # the second row is padded
    result = _result(worker.compute(request))
    assert result.error is None and (result.rows, result.length) == (2, MAX_U)
    logits_BUW = reader.view(result.descriptor, result.handle)
    assert logits_BUW.dtype == torch.bfloat16 and tuple(logits_BUW.shape) == (2, MAX_U, 49152)

    pos_U = torch.arange(MAX_U)
    mask_BU = (pos_U[None, :] < request.lengths_B[:, None]).long()
    with torch.no_grad():
        batched = worker.model(request.ids_BU, attention_mask=mask_BU).logits.to(torch.bfloat16)
        alone = worker.model(request.ids_BU[:1]).logits.to(torch.bfloat16)
    assert torch.equal(logits_BUW, batched)
    assert torch.equal(logits_BUW[0], alone[0])  # a full row: the plain model(ids).logits
    reader.release(result.descriptor, result.handle)


def test_each_trainer_rank_gets_its_own_ring(make_worker, reader):
    worker = make_worker()
    r0 = _result(worker.compute(_request(worker, [5], rank=0, key="a:1")), 0, "a:1")
    r1 = _result(worker.compute(_request(worker, [5], rank=1, key="b:1")), 1, "b:1")
    assert sorted(worker.rings) == [0, 1]
    assert r0.descriptor["instance"] != r1.descriptor["instance"]
    assert r0.descriptor["header"] != r1.descriptor["header"]
    assert r0.handle["instance"] == r0.descriptor["instance"]
    assert worker.rings[0].in_flight() == [r0.handle["slot"]]
    assert worker.rings[1].in_flight() == [r1.handle["slot"]]
    # the same rows give the same logits whichever rank asked
    assert torch.equal(reader.view(r0.descriptor, r0.handle), reader.view(r1.descriptor, r1.handle))
    assert worker.computed == 2


def test_a_rank_holding_every_slot_waits_while_other_ranks_are_served(make_worker, reader):
    worker = make_worker(slots=2)
    held = []
    for i in range(2):
        slot = worker.try_acquire(0)
        assert slot is not None
        key = f"a:{i}"
        held.append(_result(worker.compute(_request(worker, [4], 0, key), slot), 0, key))
    assert worker.try_acquire(0) is None  # rank 0's trainer holds both slots
    slot = worker.try_acquire(1)
    assert slot is not None
    other = _result(worker.compute(_request(worker, [4], 1, "b:0"), slot), 1, "b:0")
    assert other.error is None and reader.view(other.descriptor, other.handle).shape[0] == 1
    reader.release(held[0].descriptor, held[0].handle)
    assert worker.try_acquire(0) == held[0].handle["slot"]  # a release frees rank 0 again


def test_the_hidden_transport_needs_no_slot(make_worker):
    assert make_worker(transport="hidden").try_acquire(5) == 0


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([4, 4, 4], rf"3 x 4 tokens, over the teacher's slot of {MAX_B} x {MAX_U}.*max_batch"),
        ([MAX_U + 1], rf"1 x {MAX_U + 1} tokens, over the teacher's slot.*max_length"),
    ],
    ids=["too-many-rows", "too-long"],
)
def test_a_request_over_the_slot_gets_an_error_result_and_frees_its_slot(
    make_worker, lengths, message
):
    worker = make_worker()
    slot = worker.try_acquire(0)
    fields = worker.compute(_request(worker, lengths, key="big:1"), slot)
    result = _result(fields, key="big:1")
    assert result.error is not None
    assert result.rows == 0 and result.handle is None
    assert re.search(message, result.error), result.error
    assert "'big:1'" in result.error
    assert worker.rings[0].in_flight() == [] and worker.computed == 0
    assert {worker.try_acquire(0), worker.try_acquire(0)} == {0, 1}  # both slots are free


@pytest.mark.parametrize("bad_id", [-1, 49152], ids=["negative", "past-the-vocab"])
def test_a_request_with_out_of_vocab_ids_gets_an_error_result(make_worker, bad_id):
    worker = make_worker()
    rows = [torch.tensor([1, 2, bad_id])]
    request = proto.decode_request("oov:1", proto.request_fields(rows, 0), 0, worker.pad_id)
    result = _result(worker.compute(request), key="oov:1")
    assert result.error is not None
    assert "outside [0, 49152)" in result.error and "'smollm2'" in result.error
    assert worker.rings == {} and worker.computed == 0  # refused before any ring work


def test_hidden_states_through_the_output_layer_equal_the_logits_within_bf16(make_worker):
    from xtoken_core.models import load_output_layer

    worker = make_worker(transport="hidden")
    request = _request(worker, [MAX_U, 5])
    fields = worker.compute(request)
    result = _result(fields)
    assert result.transport == "hidden" and result.error is None and result.handle is None
    hidden_BUd = proto.hidden_from_column(fields[proto.hidden_field(0)], 2, MAX_U, "t:1")
    assert hidden_BUd.dtype == torch.bfloat16 and hidden_BUd.shape[-1] == worker.hidden_size

    # what the trainer does: the output layer of the same model spec, loaded on its own
    output_layer = load_output_layer("tiny", vocab_size=worker.width, seed=3)
    with torch.no_grad():
        got_BUW = output_layer(hidden_BUd.float())
        want_BUW = worker.logits(request)
        # the only error is the bf16 rounding of the hidden states: |dz| <= |W| |h| 2^-8
        exact_BUd = worker.hidden_states(request)
        bound_BUW = exact_BUd.abs() @ output_layer.weight.abs().T * 2.0**-8
    assert (got_BUW - want_BUW).abs().le(bound_BUW + 1e-6).all()


def test_a_refused_hidden_request_still_carries_an_empty_hidden_field(make_worker):
    worker = make_worker(transport="hidden")
    fields = worker.compute(_request(worker, [MAX_U + 3]))
    result = _result(fields)
    assert result.error is not None
    column = fields[proto.hidden_field(0)]
    assert tuple(column.values.shape) == (0, worker.hidden_size)  # the partition's trailing shape
    assert proto.hidden_from_column(column, 0, 0, "t:1").shape == (0, 0, worker.hidden_size)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"transport": "cuda_ipc"}, "transport=cuda_ipc needs a CUDA device.*use transport=shm"),
        ({"slots": 1}, "slots=1: the ring needs >= 2 slots"),
        ({"max_batch": 0}, "max_batch=0: must be >= 1"),
        ({"logits_dtype": "int8"}, "dtype 'int8' is not a float dtype"),
        ({"transport": "pigeon"}, "transport='pigeon': use one of shm, cuda_ipc, hidden"),
        ({"packed_attention": "dense"}, "packed_attention='dense': use auto, flex_attention"),
    ],
)
def test_teacher_config_names_a_bad_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        TeacherConfig(**overrides)


def test_a_rank_past_max_rings_is_refused_without_allocating_a_ring(make_worker):
    worker = make_worker(max_rings=1)
    assert worker.try_acquire(0) is not None  # rank 0 takes the one ring
    request = _request(worker, [4], rank=7, key="r7:1")
    problem = worker.check(request)
    assert problem is not None and "max_rings" in problem and "rank 7" in problem
    result = _result(worker.compute(request), rank=7, key="r7:1")
    assert result.error == problem
    assert sorted(worker.rings) == [0]


# ---------------------------------------------------------------------- requests sharing a forward


def _slot_or_hidden(fields: dict, request: proto.Request, reader) -> torch.Tensor:
    """What the trainer gets for ``request``: its slot's logits or its hidden states."""
    result = _result(fields, request.rank, request.key)
    assert result.error is None, result.error
    if result.transport == "hidden":
        column = fields[proto.hidden_field(request.rank)]
        return proto.hidden_from_column(column, result.rows, result.length, request.key)
    return reader.view(result.descriptor, result.handle).clone()


@pytest.mark.parametrize("transport", ["shm", "hidden"])
def test_batched_requests_match_one_forward_each(make_worker, reader, transport):
    # fp32 end to end, so that "bitwise" means the forward itself. Every request is at least 12
    # tokens (B x U): below that MKL's fp32 matmul rounds a row differently for another number of
    # rows (see TeacherWorker.fits), which no request of a real context length meets.
    overrides = dict(
        transport=transport, logits_dtype="float32", max_batch=4, forward_rows=8, slots=4
    )
    batched, alone = make_worker(**overrides), make_worker(**overrides)
    shapes = [([MAX_U, 7], 0), ([MAX_U], 1), ([3, MAX_U, MAX_U], 0), ([9, 9], 1), ([5, MAX_U], 1)]
    requests = [
        _request(batched, lengths, rank=rank, key=f"r{i}:1", seed=i)
        for i, (lengths, rank) in enumerate(shapes)
    ]
    got = batched.compute_many(requests)
    want = [alone.compute(request) for request in requests]

    # the four requests of length MAX_U (8 rows) share one forward; 9 x 9 gets its own
    assert (batched.forwards, alone.forwards) == (2, 5)
    assert batched.computed == alone.computed == 5
    for request, fields_got, fields_want in zip(requests, got, want, strict=True):
        a = _slot_or_hidden(fields_got, request, reader)
        b = _slot_or_hidden(fields_want, request, reader)
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert a.shape[:2] == request.ids_BU.shape
        assert torch.equal(a, b), (request.key, (a - b).abs().max().item())


def test_a_bad_request_among_batched_ones_gets_its_error_and_spoils_none(make_worker, reader):
    worker = make_worker(logits_dtype="float32", forward_rows=8, slots=4)
    good = [_request(worker, [MAX_U, 4], key="a:1", seed=1), _request(worker, [MAX_U], key="b:1")]
    bad = proto.decode_request(
        "bad:1", proto.request_fields([torch.tensor([1, 2, 49152])], 0), 0, worker.pad_id
    )
    too_big = _request(worker, [4, 4, 4], key="big:1")  # 3 rows: over max_batch
    slots = [worker.try_acquire(0) for _ in range(4)]
    fields = worker.compute_many([good[0], bad, too_big, good[1]], slots)

    assert "outside [0, 49152)" in _result(fields[1], key="bad:1").error
    assert "over the teacher's slot" in _result(fields[2], key="big:1").error
    assert worker.forwards == 1 and worker.computed == 2  # the two good ones, in one forward
    assert len(worker.rings[0].in_flight()) == 2  # the refused requests' slots are free again
    for request, index in ((good[0], 0), (good[1], 3)):
        got = _slot_or_hidden(fields[index], request, reader)
        direct = worker.logits(request).float()
        assert torch.equal(got, direct)


def test_requests_share_a_forward_only_at_one_length_and_within_forward_rows(make_worker):
    worker = make_worker(forward_rows=3, max_batch=2)
    one, two = _request(worker, [MAX_U]), _request(worker, [MAX_U, 3])
    assert worker.fits([], two)
    assert worker.fits([one], two)  # 3 rows
    assert not worker.fits([one, two], one)  # 4 rows: over forward_rows
    assert not worker.fits([one], _request(worker, [MAX_U - 1]))  # another length

    single = make_worker(forward_rows=1, slots=4)
    single.compute_many([_request(single, [MAX_U], key=f"s:{i}") for i in range(3)])
    assert single.forwards == 3  # forward_rows=1: a forward per request


def test_a_failed_shared_forward_is_served_one_request_at_a_time(make_worker, reader, caplog):
    worker = make_worker(logits_dtype="float32", forward_rows=8, slots=4)
    backbone = worker.backbone

    def one_row_at_most(ids_RU, mask_RU):  # e.g. a forward of many rows runs out of memory
        if ids_RU.shape[0] > 1:
            raise RuntimeError("out of memory (simulated)")
        return backbone(ids_RU, mask_RU)

    worker.backbone = one_row_at_most
    requests = [_request(worker, [MAX_U], key=f"m:{i}", seed=i) for i in range(3)]
    with caplog.at_level("WARNING"):
        fields = worker.compute_many(requests)
    assert "a forward of 3 requests (3 rows) failed; serving them one at a time" in caplog.text
    assert worker.computed == 3
    for request, f in zip(requests, fields, strict=True):
        assert torch.equal(_slot_or_hidden(f, request, reader), worker.logits(request).float())


def test_a_request_whose_forward_fails_alone_leaves_no_slot_held(make_worker):
    worker = make_worker(forward_rows=8, slots=4)
    requests = [_request(worker, [MAX_U], key=f"m:{i}", seed=i) for i in range(3)]
    backbone = worker.backbone

    def fails_on_the_second(ids_RU, mask_RU):
        if ids_RU.shape[0] > 1 or torch.equal(ids_RU, requests[1].ids_BU):
            raise RuntimeError("out of memory (simulated)")
        return backbone(ids_RU, mask_RU)

    worker.backbone = fails_on_the_second
    slots = [worker.try_acquire(0) for _ in requests]
    with pytest.raises(RuntimeError, match="simulated"):
        worker.compute_many(requests, slots)
    ring = worker.rings[0]
    assert ring.in_flight() == [slots[0]]  # served before the failure: published
    # the failed request's slot and the unserved one's are free again (with the fourth)
    assert sorted(worker.try_acquire(0) for _ in range(3)) == sorted({0, 1, 2, 3} - {slots[0]})


def _packed_request(worker: TeacherWorker, documents: list[list[int]], key: str = "p:1"):
    """A request of packed rows: each row's documents (token lengths), positions restarting."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, worker.tokenizer_vocab, (sum(row),), generator=g) for row in documents]
    positions = [torch.cat([torch.arange(n) for n in row]) for row in documents]
    fields = proto.request_fields(rows, 0, positions=positions)
    return proto.decode_request(key, fields, 0, worker.pad_id)


def test_a_packed_request_gives_each_document_its_logits_alone(make_worker, reader):
    worker = make_worker(pack=True, logits_dtype="float32")
    request = _packed_request(worker, [[4, 5, 3], [7]])  # the second row is padded
    assert request.positions_BU[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]
    assert request.positions_BU[1, 7:].eq(0).all()
    result = _result(worker.compute(request))
    logits_BUW = reader.view(result.descriptor, result.handle)
    with torch.no_grad():
        for b, row in enumerate([[4, 5, 3], [7]]):
            start = 0
            for n in row:
                alone = worker.model(request.ids_BU[b : b + 1, start : start + n]).logits[0]
                torch.testing.assert_close(
                    logits_BUW[b, start : start + n], alone, rtol=0, atol=1e-5
                )
                start += n
    reader.release(result.descriptor, result.handle)


def test_packed_and_unpacked_requests_never_share_a_forward(make_worker):
    worker = make_worker(pack=True, forward_rows=8)
    packed = _packed_request(worker, [[6, 6]])
    assert worker.fits([packed], _packed_request(worker, [[5, 7]], key="p:2"))
    assert not worker.fits([packed], _request(worker, [MAX_U]))
