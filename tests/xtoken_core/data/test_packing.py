"""Document packing: rows filled with whole documents on both sides, positions restarting per
document, chunk ids that never cross a document, the loss's view without cross-document targets,
and the collator's packed rows (real tokenizers)."""

from __future__ import annotations

import functools

import pytest
import torch

from xtoken_core.data import packing
from xtoken_core.data import sample as S

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "def add(a, b):\n    return a + b\n",
    "Über-naïve café prices: 12,50 € each, plus tax. " * 3,
    "A short one.",
    "Numbers such as 3.14159 and 2718 split into digits differently.",
]


@functools.cache
def _collator(pack: bool, ctx: int = 48):
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.tokenizers import load_tokenizer

    return CrossTokenizerCollator(
        student_tokenizer=load_tokenizer("mistral"),
        teacher_tokenizer=load_tokenizer("smollm2"),
        aligner=TokenAligner(),
        ctx_length_student=ctx,
        ctx_length_teacher=ctx,
        pack=pack,
    )


def test_pack_rows_places_every_document_once_within_both_capacities():
    s = [5, 9, 3, 10, 1, 7, 0, 4]
    u = [6, 2, 8, 9, 1, 7, 0, 4]
    rows = packing.pack_rows(s, u, 10, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(s)))
    for row in rows:
        assert row == sorted(row)
        assert sum(s[i] for i in row) <= 10 and sum(u[i] for i in row) <= 10
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)
    assert 6 in rows[0]  # a document of no tokens rides in the first row
    # no two of documents 2 (3, 8), 3 (10, 9) and 5 (7, 7) share a row: 5 rows is the least
    assert len(rows) == 5


def test_pack_rows_fills_full_rows_when_the_lengths_allow():
    rows = packing.pack_rows([6, 4, 3, 7, 5, 5], [6, 4, 3, 7, 5, 5], 10, 10)
    assert sorted(map(sorted, rows)) == [[0, 1], [2, 3], [4, 5]]


def test_pack_rows_refuses_a_document_longer_than_a_row():
    with pytest.raises(ValueError, match="document 1 has 3 student / 11 teacher tokens"):
        packing.pack_rows([2, 3], [2, 11], 10, 10)
    with pytest.raises(ValueError, match="2 student lengths but 1 teacher"):
        packing.pack_rows([2, 3], [2], 10, 10)
    assert packing.pack_rows([], [], 4, 4) == []


def test_a_packed_row_holds_each_document_as_it_was_with_offset_chunk_ids():
    collator = _collator(pack=False)
    docs = collator.collate_samples(TEXTS)
    row = packing.join_documents(docs)
    S.validate_sample(row)
    assert S.is_packed(row)
    t = u = c = 0
    for doc in docs:
        if float(doc["sample_mask"]) == 0.0:  # the empty text adds no token
            continue
        n, m = int(doc["input_lengths"]), int(doc["teacher_input_lengths"])
        k = int(doc["alignment_num_chunks"])
        assert torch.equal(row["input_ids"][t : t + n], doc["input_ids"])
        assert torch.equal(row["teacher_input_ids"][u : u + m], doc["teacher_input_ids"])
        assert torch.equal(row["position_ids"][t : t + n], torch.arange(n, dtype=torch.int32))
        assert torch.equal(
            row["teacher_position_ids"][u : u + m], torch.arange(m, dtype=torch.int32)
        )
        for side, start, length in (("student", t, n), ("teacher", u, m)):
            ids = doc[f"alignment_{side}_chunk_id"]
            want = torch.where(ids >= 0, ids + c, ids)
            assert torch.equal(row[f"alignment_{side}_chunk_id"][start : start + length], want)
        assert torch.equal(row["alignment_pair_valid"][c : c + k], doc["alignment_pair_valid"])
        t, u, c = t + n, u + m, c + k
    assert (int(row["input_lengths"]), int(row["teacher_input_lengths"])) == (t, u)
    assert int(row["alignment_num_chunks"]) == c and float(row["sample_mask"]) == 1.0


def _document_of(position_ids: torch.Tensor) -> torch.Tensor:
    return (position_ids == 0).long().cumsum(0) - 1


def test_no_chunk_of_a_collated_packed_row_spans_two_documents():
    rows = _collator(pack=True).pack_samples(TEXTS)
    assert sorted(i for indices, _ in rows for i in indices) == list(range(len(TEXTS)))
    assert len(rows) < len(TEXTS)
    for _, row in rows:
        student_doc = _document_of(row["position_ids"])
        teacher_doc = _document_of(row["teacher_position_ids"])
        for chunk in range(int(row["alignment_num_chunks"])):
            on_student = student_doc[row["alignment_student_chunk_id"] == chunk].unique()
            on_teacher = teacher_doc[row["alignment_teacher_chunk_id"] == chunk].unique()
            assert len(on_student) <= 1 and len(on_teacher) <= 1
            if len(on_student) and len(on_teacher):
                assert on_student.item() == on_teacher.item()  # the same document on both sides


def test_packed_collation_keeps_every_chunk_of_the_unpacked_one():
    docs = _collator(pack=False).collate_samples(TEXTS)
    rows = [row for _, row in _collator(pack=True).pack_samples(TEXTS)]
    for field in ("alignment_num_chunks", "input_lengths", "teacher_input_lengths"):
        counted = [d for d in docs if float(d["sample_mask"]) != 0.0]
        assert sum(int(r[field]) for r in rows) == sum(int(d[field]) for d in counted)
    valid = sum(int(r["alignment_pair_valid"].sum()) for r in rows)
    assert valid == sum(int(d["alignment_pair_valid"].sum()) for d in docs)


def test_the_collator_call_pads_the_packed_rows():
    collator = _collator(pack=True)
    batch = collator(TEXTS)
    rows = collator.collate_samples(TEXTS)
    expected = S.pad_samples(rows, **collator.pad_kwargs())
    assert set(batch) == set(S.FIELD_NAMES + S.PACKED_FIELD_NAMES)
    for name, value in expected.items():
        assert torch.equal(batch[name], value), name
    assert batch["input_ids"].shape[1] <= 48


def test_padding_of_packed_rows_writes_position_zero_and_a_mix_is_refused():
    collator = _collator(pack=True)
    rows = collator.collate_samples(TEXTS)
    batch = S.pad_samples(rows, **collator.pad_kwargs())
    assert batch["position_ids"].dtype == torch.int32
    padding = ~batch["token_mask"]
    assert padding.any() and (batch["position_ids"][padding] == 0).all()
    unpacked = _collator(pack=False).collate_samples(TEXTS[:1])
    with pytest.raises(ValueError, match="1 of 2 samples are packed rows"):
        S.pad_samples([rows[0], unpacked[0]], **collator.pad_kwargs())
    half = dict(rows[0])
    del half["teacher_position_ids"]
    with pytest.raises(ValueError, match="teacher_position_ids"):
        S.validate_sample(half)


def test_document_targets_drop_the_targets_that_cross_a_document():
    collator = _collator(pack=True)
    batch = collator(TEXTS)
    view = packing.document_targets(batch)
    starts = batch["position_ids"] == 0
    assert not (view["token_mask"] & starts).any()
    assert torch.equal(view["token_mask"], batch["token_mask"] & ~starts)
    assert (view["alignment_student_chunk_id"][starts] == -1).all()
    assert (view["alignment_teacher_chunk_id"][batch["teacher_position_ids"] == 0] == -1).all()
    inside = ~starts
    assert torch.equal(
        view["alignment_student_chunk_id"][inside], batch["alignment_student_chunk_id"][inside]
    )
    assert view["position_ids"] is batch["position_ids"]  # the attention reads them untouched
    unpacked = _collator(pack=False)(TEXTS)
    assert packing.document_targets(unpacked) is unpacked


def test_a_row_key_names_its_documents():
    key = packing.row_key(["a/data.jsonl:3", "a/data.jsonl:7"])
    assert key == "a/data.jsonl:3|a/data.jsonl:7"
    assert packing.document_keys(key) == ["a/data.jsonl:3", "a/data.jsonl:7"]
    assert packing.document_keys("a/data.jsonl:3") == ["a/data.jsonl:3"]


def test_pack_rows_of_several_teachers_fits_every_teachers_row():
    s = [5, 9, 3, 10, 1, 7, 0, 4]
    u = [6, 2, 8, 9, 1, 7, 0, 4]
    v = [6, 2, 2, 2, 2, 2, 0, 6]
    rows = packing.pack_rows_per_teacher(s, [u, v], 10, [10, 10])
    assert sorted(i for row in rows for i in row) == list(range(len(s)))
    for row in rows:
        assert sum(s[i] for i in row) <= 10 and sum(u[i] for i in row) <= 10
        assert sum(v[i] for i in row) <= 10
    assert not any({0, 7} <= set(row) for row in rows)  # together 12 tokens of teacher 1
    assert any({0, 7} <= set(row) for row in packing.pack_rows(s, u, 10, 10))
    assert packing.pack_rows_per_teacher(s, [u], 10, [10]) == packing.pack_rows(s, u, 10, 10)
    with pytest.raises(ValueError, match="document 1 has 3 student / 2 teacher / 11 teacher1"):
        packing.pack_rows_per_teacher([2, 3], [[2, 2], [2, 11]], 10, [10, 10])
    with pytest.raises(ValueError, match="2 teachers' lengths but 1 teacher contexts"):
        packing.pack_rows_per_teacher([2], [[2], [2]], 10, [10])
