"""Collator worker logic without processes or sockets: packing samples into one put."""

from __future__ import annotations

import pytest
import torch

from services.collator.config import CollatorConfig, CorpusConfig
from services.collator.worker import (
    CollatorWorker,
    WorkerConfig,
    put_nbytes,
    samples_to_put_fields,
)
from tests.services.collator.conftest import CTX, STUDENT, TEACHER
from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import columns_to_samples
from xtoken_core.wire import JaggedColumn

TEXTS = [
    ("a.jsonl:1", "def f(x):\n    return x + 1\n"),
    ("a.jsonl:2", "Ünïcödé text, emoji \U0001f600 and tabs\t."),
    ("a.jsonl:3", ""),
    ("a.jsonl:4", "same length"),
    ("a.jsonl:5", "same length"),
]


class FakeClient:
    """Records puts like a queue client would send them."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, list[str], dict]] = []

    def put(self, partition, keys, fields, *, timeout_s=None):
        self.puts.append((partition, list(keys), dict(fields)))
        return {"written": len(keys), "new_samples": len(keys), "duplicates": 0}

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def worker():
    config = WorkerConfig(
        queue="tcp://127.0.0.1:1",
        partition="p",
        student=STUDENT,
        teacher=TEACHER,
        ctx_student=CTX,
        ctx_teacher=CTX,
    )
    return CollatorWorker(config, client=FakeClient())


def test_put_fields_round_trip_to_the_collated_samples(worker):
    samples = worker.collator.collate_samples([t for _, t in TEXTS])
    fields = samples_to_put_fields(samples)
    assert set(fields) == set(schema.FIELD_NAMES)
    back = columns_to_samples(fields)
    assert len(back) == len(samples)
    for got, want in zip(back, samples):
        for name in schema.FIELD_NAMES:
            assert got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name


def test_per_token_fields_stay_jagged_even_when_all_rows_have_one_length(worker):
    samples = worker.collator.collate_samples(["same length", "same length"])
    fields = samples_to_put_fields(samples)
    for spec in schema.SAMPLE_FIELDS:
        if spec.axis == schema.SAMPLE:
            assert isinstance(fields[spec.name], torch.Tensor)
            assert fields[spec.name].shape == (2,)
        else:
            assert isinstance(fields[spec.name], JaggedColumn), spec.name
            assert fields[spec.name].num_rows == 2


def test_put_nbytes_counts_values_and_offsets():
    fields = {
        "a": JaggedColumn(torch.arange(5), torch.tensor([0, 2, 5])),
        "b": torch.zeros(2, dtype=torch.float32),
    }
    assert put_nbytes(fields) == 5 * 8 + 3 * 8 + 2 * 4


def test_process_sends_one_put_with_the_batch_keys(worker):
    worker.client.puts.clear()
    counts = worker.process(TEXTS)
    assert counts["samples"] == len(TEXTS)
    assert counts["written"] == len(TEXTS)
    assert len(worker.client.puts) == 1
    partition, keys, fields = worker.client.puts[0]
    assert partition == "p"
    assert keys == [k for k, _ in TEXTS]
    assert counts["nbytes"] == put_nbytes(fields)
    assert fields["sample_mask"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_samples_to_put_fields_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="at least one sample"):
        samples_to_put_fields([])


def test_samples_to_put_fields_names_a_missing_field(worker):
    sample = dict(worker.collator.collate_one("x"))
    del sample["alignment_num_chunks"]
    with pytest.raises(ValueError, match="alignment_num_chunks"):
        samples_to_put_fields([sample])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"workers": 0}, "--workers"), ({"batch": 0}, "--batch"), ({"limit": 0}, "limit=0")],
)
def test_collator_config_rejects_bad_counts(kwargs, match):
    worker = WorkerConfig(queue="tcp://127.0.0.1:1", partition="p", student="a", teacher="b")
    limit = kwargs.pop("limit", None)
    with pytest.raises(ValueError, match=match):
        CollatorConfig(data=CorpusConfig("x.jsonl", limit), worker=worker, **kwargs)


def test_worker_config_rejects_a_zero_context_length():
    with pytest.raises(ValueError, match="--ctx-teacher"):
        WorkerConfig(queue="q", partition="p", student="a", teacher="b", ctx_teacher=0)


@pytest.fixture(scope="module")
def packed_worker():
    config = WorkerConfig(
        queue="tcp://127.0.0.1:1",
        partition="p",
        student=STUDENT,
        teacher=TEACHER,
        ctx_student=32,
        ctx_teacher=32,
        pack=True,
    )
    return CollatorWorker(config, client=FakeClient())


def test_a_packed_put_holds_rows_keyed_by_their_texts(packed_worker):
    from xtoken_core.data.packing import document_keys

    packed_worker.client.puts.clear()
    counts = packed_worker.process(TEXTS)
    _, keys, fields = packed_worker.client.puts[0]
    assert counts["texts"] == len(TEXTS) and counts["samples"] == len(keys) < len(TEXTS)
    assert sorted(k for key in keys for k in document_keys(key)) == [k for k, _ in TEXTS]
    for name in schema.PACKED_FIELD_NAMES:
        assert isinstance(fields[name], JaggedColumn) and fields[name].num_rows == len(keys)
    for row in columns_to_samples(fields):
        schema.validate_sample(row)
        assert int(row["input_lengths"]) <= 32 and int(row["teacher_input_lengths"]) <= 32


def test_a_packed_put_is_a_fixed_number_of_frames_whatever_its_rows(packed_worker):
    from xtoken_core.wire.message import encode_message

    sizes = []
    for items in (TEXTS[:1], TEXTS, TEXTS * 3):
        items = [(f"{k}#{i}", t) for i, (k, t) in enumerate(items)]
        keys, fields = packed_worker.collate(items)
        body = {"partition": "p", "keys": keys, "fields": fields}
        frames = encode_message("put", body, inline_max_bytes=0)
        jagged = sum(isinstance(v, JaggedColumn) for v in fields.values())
        assert jagged == len(schema.FIELD_NAMES) - 4 + 2  # + the two position fields
        sizes.append(len(frames))
    # header + body, a values and an offsets frame per jagged field, a frame per dense field
    assert sizes == [2 + 2 * jagged + 4] * 3


@pytest.mark.parametrize("pack", [False, True], ids=["one-text-a-sample", "packed"])
def test_a_worker_of_several_teachers_puts_every_teachers_fields(pack):
    """Teacher 0's fields under their names, teacher i's as teacher{i}_...; a text's tokens of
    each teacher are what a one-teacher worker of its tokenizer puts (packed rows fit every
    teacher's context, so they may hold other documents than one teacher's would)."""
    ctx = 32 if pack else CTX
    settings = dict(queue="tcp://127.0.0.1:1", partition="p", student=STUDENT, ctx_student=ctx,
                    ctx_teacher=ctx, pack=pack)  # fmt: skip
    several = CollatorWorker(
        WorkerConfig(teacher=TEACHER, extra_teachers=("smollm2",), **settings), client=FakeClient()
    )
    _, fields = several.collate(TEXTS)
    assert set(fields) == set(schema.field_names(2, packed=pack))
    rows = columns_to_samples(fields)
    for row in rows:
        schema.validate_sample(row, 2)
    if pack:
        return
    alone = CollatorWorker(WorkerConfig(teacher="smollm2", **settings), client=FakeClient())
    _, theirs = alone.collate(TEXTS)
    for row, own in zip(rows, columns_to_samples(theirs), strict=True):
        assert torch.equal(row["teacher1_input_ids"], own["teacher_input_ids"])


def test_the_extra_teachers_flag_names_each_tokenizer():
    with pytest.raises(ValueError, match="--extra-teachers"):
        WorkerConfig(queue="q", partition="p", student="a", teacher="b", extra_teachers=("",))
