"""The trainer <-> teacher hand-off records: round trips, garbage refused naming the record key,
and records of any shape sharing one queue partition."""

from __future__ import annotations

import msgpack
import pytest
import torch

from services import protocol as proto
from xtoken_core.wire import JaggedColumn

PAD = 7


def _column(values: torch.Tensor) -> JaggedColumn:
    return JaggedColumn(values, torch.tensor([0, values.shape[0]], dtype=torch.int64))


def _ring_result(**overrides) -> proto.Result:
    fields = dict(
        transport="shm",
        teacher="123-abcd",
        descriptor={"kind": "logit_ring", "instance": 5, "slot_shape": [2, 8, 32]},
        handle={"instance": 5, "slot": 1, "generation": 3, "rows": 2, "length": 8, "width": 32},
        width=32,
        rows=2,
        length=8,
    )
    fields.update(overrides)
    return proto.Result(**fields)


# ----------------------------------------------------------------------------- names


def test_partition_and_field_names_carry_group_and_rank():
    assert proto.request_partition("train", 3) == "train.teacher3"
    assert (proto.result_field(2), proto.hidden_field(2)) == ("result2", "hidden2")
    a, b = proto.new_instance(), proto.new_instance()
    assert a != b and a.split("-")[0] == b.split("-")[0]


# ----------------------------------------------------------------------------- requests


def test_a_request_round_trips_with_rows_right_padded():
    rows = [torch.tensor([1, 2, 3, 4]), torch.tensor([5], dtype=torch.int32), torch.tensor([6, 7])]
    fields = proto.request_fields(rows, rank=3)
    request = proto.decode_request("t:1", fields, 0, pad_id=PAD)
    assert request.key == "t:1" and request.rank == 3
    assert request.lengths_B.tolist() == [4, 1, 2]
    assert request.ids_BU.dtype == torch.int64
    assert request.ids_BU.tolist() == [[1, 2, 3, 4], [5, PAD, PAD, PAD], [6, 7, PAD, PAD]]


def test_a_packed_request_carries_positions_padded_with_zero():
    rows = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])]
    positions = [torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 1])]
    fields = proto.request_fields(rows, rank=0, positions=positions)
    assert fields[proto.POSITIONS_FIELD].values.dtype == torch.int32
    request = proto.decode_request("p:1", fields, 0, pad_id=PAD)
    assert request.positions_BU.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    unpacked = proto.decode_request("t:1", proto.request_fields(rows, rank=0), 0, pad_id=PAD)
    assert unpacked.positions_BU is None


def test_positions_that_do_not_match_the_ids_are_a_value_error_naming_the_key():
    fields = proto.request_fields([torch.tensor([1, 2, 3])], rank=0, positions=[torch.arange(2)])
    with pytest.raises(ValueError, match=r"request 'p:2': 2 teacher_position_ids .* for 3 ids"):
        proto.decode_request("p:2", fields, 0, pad_id=PAD)


def test_row_index_picks_one_request_of_a_claimed_batch():
    a = proto.request_fields([torch.tensor([1, 2])], rank=0)
    b = proto.request_fields([torch.tensor([3]), torch.tensor([4, 5, 6])], rank=1)
    # what a claim of both records returns: one column (jagged) / one tensor (dense) per field
    claimed = {
        name: (
            JaggedColumn.from_rows([a[name].row(0), b[name].row(0)])
            if isinstance(a[name], JaggedColumn)
            else torch.cat([a[name], b[name]])
        )
        for name in proto.REQUEST_FIELDS
    }
    second = proto.decode_request("t:2", claimed, 1, pad_id=PAD)
    assert second.rank == 1 and second.ids_BU.tolist() == [[3, PAD, PAD], [4, 5, 6]]
    assert proto.decode_request("t:1", claimed, 0, pad_id=PAD).ids_BU.tolist() == [[1, 2]]


def _request(**replace):
    fields = proto.request_fields([torch.tensor([1, 2, 3]), torch.tensor([4])], rank=0)
    fields.update(replace)
    return {k: v for k, v in fields.items() if v is not None}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (_request(rank=None), r"lacks fields \['rank'\]"),
        (_request(teacher_input_ids=torch.tensor([[1, 2, 3, 4]])), "must be a jagged field"),
        (_request(teacher_lengths=_column(torch.tensor([3, 2]))), "do not add up to the 4 ids"),
        (_request(teacher_lengths=_column(torch.tensor([5, -1]))), "do not add up"),
        (
            _request(teacher_input_ids=_column(torch.tensor([1.0, 2, 3, 4]))),
            "not an integer tensor",
        ),
        (_request(teacher_lengths=_column(torch.tensor([3.0, 1.0]))), "not an integer tensor"),
        (_request(rank=torch.tensor([-1])), "rank -1 must be >= 0"),
        (_request(rank=torch.zeros(0, dtype=torch.int64)), "malformed fields"),
        (_request(rank=_column(torch.tensor([0]))), "malformed fields"),
        (_request(teacher_lengths="3,1"), "teacher_lengths is str, not an integer tensor"),
    ],
    ids=[
        "missing-field",
        "dense-ids",
        "lengths-mismatch",
        "negative-length",
        "float-ids",
        "float-lengths",
        "negative-rank",
        "empty-rank",
        "jagged-rank",
        "string-lengths",
    ],
)
def test_a_garbage_request_is_a_value_error_naming_its_key(fields, message):
    with pytest.raises(ValueError, match=message) as exc:
        proto.decode_request("bad:9", fields, 0, pad_id=PAD)
    assert "'bad:9'" in str(exc.value)


def test_a_request_row_past_the_claimed_rows_is_a_value_error():
    with pytest.raises(ValueError, match="'t:1'.*malformed fields"):
        proto.decode_request("t:1", _request(), 1, pad_id=PAD)


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize(
    "result",
    [
        _ring_result(),
        _ring_result(transport="cuda_ipc", descriptor={"data": {"handle": b"\x00\xff" * 32}}),
        _ring_result(transport="hidden", descriptor=None, handle=None),
        _ring_result(descriptor=None, handle=None, rows=0, length=0, error="too large"),
    ],
    ids=["shm", "cuda_ipc-bytes", "hidden", "error"],
)
def test_a_result_round_trips_through_its_blob(result):
    blob = result.blob()
    assert isinstance(blob, JaggedColumn) and blob.values.dtype == torch.uint8
    assert blob.num_rows == 1
    assert proto.Result.from_blob(blob, "t:1") == result


def _blob(obj) -> JaggedColumn:
    return _column(
        torch.frombuffer(bytearray(msgpack.packb(obj, use_bin_type=True)), dtype=torch.uint8)
    )


def _result_dict(**overrides) -> dict:
    import dataclasses

    d = dataclasses.asdict(_ring_result())
    d.update(overrides)
    return d


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (torch.zeros(3, dtype=torch.uint8), "expected a 1-row uint8 jagged field"),
        (_column(torch.zeros(3, dtype=torch.int64)), "expected a 1-row uint8 jagged field"),
        (_column(torch.tensor([0xC1], dtype=torch.uint8)), "not a msgpack blob"),
        (_column(torch.tensor([0x92, 0x01], dtype=torch.uint8)), "not a msgpack blob"),
        (_column(torch.tensor([0x81, 0x01, 0x01], dtype=torch.uint8)), "not a msgpack blob"),
        (_column(torch.zeros(proto.MAX_BLOB_BYTES + 1, dtype=torch.uint8)), "over the"),
        (_blob([1, 2, 3]), "expected keys"),
        (_blob({**_result_dict(), "extra": 1}), "expected keys"),
        (
            _blob(
                {
                    b"transport": "shm",
                    **{k: v for k, v in _result_dict().items() if k != "transport"},
                }
            ),
            "expected keys",
        ),
        (_blob(_result_dict(transport="carrier-pigeon")), "unknown transport"),
        (_blob(_result_dict(transport=["shm"])), "unknown transport"),
        (_blob(_result_dict(width=-1)), "width=-1 must be an int >= 0"),
        (_blob(_result_dict(rows=2.0)), "rows=2.0 must be an int >= 0"),
        (_blob(_result_dict(length=True)), "length=True must be an int >= 0"),
        (_blob(_result_dict(handle=[1, 2])), "handle is a list"),
        (_blob(_result_dict(descriptor="ring")), "descriptor is a str"),
        (_blob(_result_dict(teacher=None)), "teacher is a NoneType"),
        (_blob(_result_dict(error=3)), "error is a int"),
        (_blob(_result_dict(handle=None)), "shm result needs a descriptor and a handle"),
    ],
    ids=[
        "dense-tensor",
        "int64-column",
        "reserved-byte",
        "truncated",
        "int-map-key",
        "too-large",
        "a-list",
        "extra-key",
        "bytes-key",
        "unknown-transport",
        "list-transport",
        "negative-width",
        "float-rows",
        "bool-length",
        "list-handle",
        "str-descriptor",
        "no-teacher",
        "int-error",
        "ring-without-handle",
    ],
)
def test_a_garbage_result_is_a_value_error_naming_the_request_key(column, message):
    with pytest.raises(ValueError, match=message) as exc:
        proto.Result.from_blob(column, "rq:42")
    assert "'rq:42'" in str(exc.value)


def test_blobs_hold_plain_values_only():
    assert proto.unpack_blob(proto.pack_blob({"a": [1, 2.5, "x", b"y", None]}), "w") == {
        "a": [1, 2.5, "x", b"y", None]
    }
    with pytest.raises(TypeError):
        proto.pack_blob({"tensor": torch.zeros(2)})  # nothing is pickled


# ----------------------------------------------------------------------------- hidden states


def test_hidden_states_round_trip_as_one_jagged_row():
    hidden_BUd = torch.randn(3, 5, 4).to(torch.bfloat16)
    column = proto.hidden_column(hidden_BUd)
    assert column.num_rows == 1 and tuple(column.values.shape) == (15, 4)
    assert torch.equal(proto.hidden_from_column(column, 3, 5, "t:1"), hidden_BUd)


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (torch.zeros(1, 3, 5, 4), "expected a 1-row jagged field"),
        (_column(torch.zeros(15)), "expected a 1-row jagged field"),
        (_column(torch.zeros(15, 4, dtype=torch.int64)), "not a float dtype"),
        (_column(torch.zeros(14, 4)), "14 vectors, but the result says 3 rows x 5 tokens"),
    ],
    ids=["dense", "1-d", "int", "wrong-count"],
)
def test_garbage_hidden_states_are_a_value_error_naming_the_request_key(column, message):
    with pytest.raises(ValueError, match=message) as exc:
        proto.hidden_from_column(column, 3, 5, "rq:7")
    assert "'rq:7'" in str(exc.value)


# ----------------------------------------------------------------------------- top-k targets


def _topk_columns() -> list[JaggedColumn]:
    """The four topk fields of 3 rows x 5 tokens at K = 4 (in ``topk_fields`` order)."""
    from xtoken_core.wire.topk import encode_topk

    return list(proto.topk_columns(encode_topk(torch.randn(3, 5, 11), 4)))


def test_topk_targets_round_trip_as_four_one_row_jagged_fields():
    from xtoken_core.wire.topk import encode_topk

    z_BUW = torch.randn(3, 5, 11)
    targets = encode_topk(z_BUW, 4)
    columns = proto.topk_columns(targets)
    assert proto.topk_fields(2) == ("topk_ids2", "topk_logprobs2", "topk_rest2", "topk_lse2")
    assert [(c.num_rows, tuple(c.values.shape)) for c in columns] == [
        (1, (15, 4)),
        (1, (15, 4)),
        (1, (15,)),
        (1, (15,)),
    ]
    back = proto.topk_from_columns(columns, 3, 5, "t:1")
    for got, want in zip(back, targets, strict=True):
        assert torch.equal(got, want)
    torch.testing.assert_close(back.lse_N, torch.logsumexp(z_BUW, -1))


def _replace(columns: list[JaggedColumn], i: int, values: torch.Tensor) -> list[JaggedColumn]:
    return [*columns[:i], _column(values), *columns[i + 1 :]]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c[:3], r"expected four 1-row jagged fields \(ids, logprobs, rest, lse\)"),
        (lambda c: [*c[:3], c[3].values], r"expected four 1-row jagged fields"),
        (
            lambda c: _replace(c, 3, torch.zeros(14)),
            r"lse is torch.float32 \(14,\), not float32 \(15,\)",
        ),
        (
            lambda c: _replace(c, 3, torch.zeros(15, 1)),
            r"lse is torch.float32 \(15, 1\), not float32 \(15,\)",
        ),
        (
            lambda c: _replace(c, 3, torch.zeros(15, dtype=torch.float64)),
            r"lse is torch.float64 \(15,\), not float32",
        ),
        (
            lambda c: _replace(c, 2, torch.zeros(15, dtype=torch.bfloat16)),
            r"rest is torch.bfloat16 \(15,\), not float32",
        ),
        (
            lambda c: _replace(c, 0, torch.zeros(15, 4)),
            r"ids are torch.float32 \(15, 4\), not int32",
        ),
        (
            lambda c: _replace(c, 1, torch.zeros(15, 3)),
            r"logprobs are torch.float32 \(15, 3\), not float \(15, 4\)",
        ),
    ],
    ids=[
        "lse-missing",
        "lse-dense",
        "lse-short",
        "lse-2d",
        "lse-fp64",
        "rest-bf16",
        "ids-float",
        "logprobs-shape",
    ],  # fmt: skip
)
def test_garbage_topk_fields_are_refused_in_one_line_naming_the_request_key(edit, message):
    with pytest.raises(ValueError, match=message) as exc:
        proto.topk_from_columns(edit(_topk_columns()), 3, 5, "rq:7")
    assert str(exc.value).startswith("top-k targets of request 'rq:7': ")
    assert "\n" not in str(exc.value)


def test_topk_fields_of_another_batch_shape_are_refused():
    with pytest.raises(ValueError, match="15 positions, but the result says 3 rows x 4 tokens"):
        proto.topk_from_columns(_topk_columns(), 3, 4, "rq:7")


# ----------------------------------------------------------------------------- through a queue


def test_records_of_any_batch_size_and_length_share_one_partition(tmp_path):
    """A queue partition keeps one trailing shape per field: requests of B rows and hidden
    states [B, U, d] must not pin it (the last micro-batch of the data is smaller)."""
    from services.queue.client import QueueClient
    from tests.services.queue.conftest import ServerProcess

    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    try:
        with QueueClient(server.address, timeout_s=10) as client:
            part = proto.request_partition("p", 0)
            shapes = [(2, 5), (1, 3), (4, 9)]
            for i, (B, U) in enumerate(shapes):
                rows = [torch.arange(U)] + [torch.arange(1)] * (B - 1)
                client.put(part, [f"k:{i}"], proto.request_fields(rows, rank=1))
                hidden = proto.hidden_column(torch.full((B, U, 8), float(i), dtype=torch.bfloat16))
                result = _ring_result(
                    transport="hidden", descriptor=None, handle=None, rows=B, length=U
                )
                client.put(part, [f"k:{i}"], {"result1": result.blob(), "hidden1": hidden})
            got = client.claim(
                part,
                "trainer1",
                ["result1"],
                8,
                fields=["result1", "hidden1", *proto.REQUEST_FIELDS],
            )
            assert got["keys"] == ["k:0", "k:1", "k:2"]
            for i, (key, (B, U)) in enumerate(zip(got["keys"], shapes)):
                request = proto.decode_request(key, got["fields"], i, pad_id=PAD)
                assert tuple(request.ids_BU.shape) == (B, U) and request.rank == 1
                row = got["fields"]["result1"].row(i)
                result = proto.Result.from_blob(_column(row), key)
                assert (result.rows, result.length) == (B, U)
                hidden = got["fields"]["hidden1"]
                one = _column(hidden.row(i))
                assert torch.equal(
                    proto.hidden_from_column(one, B, U, key),
                    torch.full((B, U, 8), float(i), dtype=torch.bfloat16),
                )
    finally:
        server.stop()


def test_a_further_teachers_requests_have_a_partition_of_their_own():
    assert proto.request_partition("train", 0, teacher=0) == "train.teacher0"
    assert proto.request_partition("train", 2, teacher=1) == "train.t1.teacher2"
    assert proto.request_partition("train", 2, teacher=1) != proto.request_partition("train", 2)
