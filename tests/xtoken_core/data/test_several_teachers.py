"""CrossTokenizerCollator of several teachers with real tokenizers (student mistral, teachers
qwen3 and smollm2): teacher i's fields, under its ``teacher{i}_`` names, are exactly what a
one-teacher collator of teacher i's tokenizer makes (jagged, padded, packed, sampled); teachers
of one tokenizer share the tokenization, the alignment and the tensors; bad settings are refused
in one line."""

from __future__ import annotations

import functools

import pytest
import torch

from xtoken_core.align import TokenAligner
from xtoken_core.data import packing
from xtoken_core.data import sample as S
from xtoken_core.data.collator import CrossTokenizerCollator
from xtoken_core.tokenizers import load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "def add(a, b):\n    return a + b  # sum\n",
    "Über-naïve café prices: 12,50 € each, plus tax. 日本語のテキスト。 " * 2,
    "emoji 🙂🙃 and ½ ≠ 0.5",
    "Numbers such as 3.14159 and 2718 split into digits differently.",
]
TEACHERS = ("qwen3", "smollm2")
CTX_STUDENT, CTX_TEACHERS, DIVS = 40, (36, 28), (3, 5)


def _tok(name):
    return load_tokenizer(name)


@functools.cache
def _one(teacher: str, ctx: int, div: int, *, pack: bool = False, agrees: str | None = None):
    """The one-teacher collator of ``teacher`` with the settings the several-teacher one gives
    that teacher."""
    return CrossTokenizerCollator(
        student_tokenizer=_tok("mistral"),
        teacher_tokenizer=_tok(teacher),
        aligner=TokenAligner(),
        ctx_length_student=CTX_STUDENT,
        ctx_length_teacher=ctx,
        make_seq_div_by_student=4,
        make_seq_div_by_teacher=div,
        pack=pack,
        kd_where_agrees=_tok(agrees) if agrees else None,
    )


def _make_several(**settings) -> CrossTokenizerCollator:
    """The two-teacher collator of these tests (``settings``: more of its arguments)."""
    return CrossTokenizerCollator(
        student_tokenizer=_tok("mistral"),
        teacher_tokenizers=[_tok(name) for name in TEACHERS],
        aligner=TokenAligner(),
        ctx_length_student=CTX_STUDENT,
        ctx_length_teacher=list(CTX_TEACHERS),
        make_seq_div_by_student=4,
        make_seq_div_by_teacher=DIVS,
        **settings,
    )


@functools.cache
def _several(pack: bool = False) -> CrossTokenizerCollator:
    return _make_several(pack=pack)


def _ones(pack: bool = False):
    return [_one(t, c, d, pack=pack) for t, c, d in zip(TEACHERS, CTX_TEACHERS, DIVS)]


def _as_teacher(one: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """A one-teacher sample or batch under teacher i's names (the student fields shared)."""
    per_teacher = {f.name for f in S.TEACHER_FIELDS}
    return {(S.teacher_field_name(k, i) if k in per_teacher else k): v for k, v in one.items()}


def _assert_teacher_equals(several: dict, one: dict, i: int) -> None:
    renamed = _as_teacher(one, i)
    assert renamed, "nothing compared"
    for name, value in renamed.items():
        assert name in several, name
        assert several[name].dtype == value.dtype, name
        assert torch.equal(several[name], value), name


def test_each_teachers_jagged_fields_are_a_one_teacher_collators_under_its_names():
    several = _several().collate_samples(TEXTS)
    ones = [c.collate_samples(TEXTS) for c in _ones()]
    for b, sample in enumerate(several):
        assert tuple(sample) == S.field_names(2)
        S.validate_sample(sample, 2)
        for i in range(2):
            _assert_teacher_equals(sample, ones[i][b], i)
    # the teachers differ, so the test can tell one teacher's fields from the other's
    assert not torch.equal(several[0]["teacher_input_ids"], several[0]["teacher1_input_ids"])


def test_teacher_zero_of_several_keeps_the_one_teacher_names_and_values():
    sample = _several().collate_one(TEXTS[3])
    one = _ones()[0].collate_one(TEXTS[3])
    assert tuple(sample)[: len(S.FIELD_NAMES)] == S.FIELD_NAMES
    for name in S.FIELD_NAMES:
        assert torch.equal(sample[name], one[name]), name
    assert int(sample["teacher_input_lengths"]) == CTX_TEACHERS[0]  # truncated per teacher
    assert int(sample["teacher1_input_lengths"]) == CTX_TEACHERS[1]


def test_the_padded_batch_gives_each_teacher_its_own_widths_and_pad_ids():
    collator = _several()
    batch = collator(TEXTS)
    assert tuple(batch) == S.field_names(2)
    for i, one in enumerate(_ones()):
        _assert_teacher_equals(batch, one(TEXTS), i)
    u0, u1 = batch["teacher_input_ids"].shape[1], batch["teacher1_input_ids"].shape[1]
    assert u0 % DIVS[0] == 0 and u1 % DIVS[1] == 0
    assert u0 - DIVS[0] < int(batch["teacher_input_lengths"].max()) <= u0
    assert u1 - DIVS[1] < int(batch["teacher1_input_lengths"].max()) <= u1
    assert batch["teacher1_alignment_pair_valid"].shape[1] == int(
        batch["teacher1_alignment_num_chunks"].max()
    )
    assert batch["teacher1_alignment_student_chunk_id"].shape == batch["input_ids"].shape
    smollm2_pad = collator.teacher_pad_ids[1]
    assert (batch["teacher1_input_ids"][~batch["teacher1_token_mask"]] == smollm2_pad).all()
    assert collator.teacher_pad_ids == tuple(c.teacher_pad_id for c in _ones())
    assert collator.teacher_pad_ids[0] != smollm2_pad


def test_jagged_samples_of_several_teachers_pad_to_exactly_the_collated_batch():
    collator = _several()
    padded = S.pad_samples(collator.collate_samples(TEXTS), **collator.pad_kwargs())
    batch = collator(TEXTS)
    assert list(padded) == list(batch)
    for name, value in batch.items():
        assert torch.equal(padded[name], value), name


def test_packed_rows_hold_each_teachers_documents_as_one_teacher_rows_of_the_same_texts():
    rows = _several(pack=True).pack_samples(TEXTS)
    docs = [c.collate_samples(TEXTS) for c in _ones()]
    assert sorted(i for indices, _ in rows for i in indices) == list(range(len(TEXTS)))
    for indices, row in rows:
        assert tuple(row) == S.field_names(2, packed=True)
        S.validate_sample(row, 2)
        assert int(row["input_lengths"]) <= CTX_STUDENT
        for i in range(2):
            assert int(row[S.teacher_field_name("teacher_input_lengths", i)]) <= CTX_TEACHERS[i]
            one_row = packing.join_documents([docs[i][d] for d in indices])
            _assert_teacher_equals(row, one_row, i)
    assert len(rows) < len(TEXTS) - 1, "documents were packed together"


def test_document_targets_cut_every_teachers_targets_at_its_own_document_starts():
    collator = _several(pack=True)
    rows = collator.pack_samples(TEXTS)
    batch = S.pad_samples([row for _, row in rows], **collator.pad_kwargs())
    view = packing.document_targets(batch)
    docs = [c.collate_samples(TEXTS) for c in _ones()]
    for i, one in enumerate(_ones()):
        one_rows = [packing.join_documents([docs[i][d] for d in indices]) for indices, _ in rows]
        one_view = packing.document_targets(S.pad_samples(one_rows, **one.pad_kwargs()))
        _assert_teacher_equals(view, one_view, i)
    starts = batch["teacher1_position_ids"] == 0
    assert (view["teacher1_alignment_teacher_chunk_id"][starts] == -1).all()
    assert not torch.equal(
        view["teacher1_alignment_teacher_chunk_id"], batch["teacher1_alignment_teacher_chunk_id"]
    )


def test_sampled_rows_give_each_teacher_the_one_teacher_sample():
    mistral = _tok("mistral")
    rows = [mistral.encode(t).ids.tolist() for t in TEXTS]
    g = torch.Generator().manual_seed(0)
    rows.append([1] + torch.randint(3, mistral.vocab_size, (30,), generator=g).tolist())
    several = _several().collate_sampled(rows)
    ones = [c.collate_sampled(rows) for c in _ones()]
    for b, sample in enumerate(several):
        S.validate_sample(sample, 2)
        for i in range(2):
            _assert_teacher_equals(sample, ones[i][b], i)
    student, *teachers = _several().tokenize_sampled(rows)
    assert len(teachers) == 2 and all(len(t) == len(rows) for t in teachers)


class _Counting:
    """A tokenizer or aligner that counts the calls of one method and delegates the rest."""

    def __init__(self, inner, method: str) -> None:
        self._inner, self._method, self.calls = inner, method, 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def test_teachers_of_one_tokenizer_share_the_tokenization_alignment_and_tensors():
    qwen = _Counting(_tok("qwen3"), "encode_batch")
    smollm = _Counting(_tok("smollm2"), "encode_batch")
    aligner = _Counting(TokenAligner(), "align_tokenized")
    collator = CrossTokenizerCollator(
        student_tokenizer=_tok("mistral"),
        teacher_tokenizers=[qwen, smollm, qwen],
        aligner=aligner,
        ctx_length_student=CTX_STUDENT,
        ctx_length_teacher=CTX_TEACHERS[0],
    )
    samples = collator.collate_samples(TEXTS)
    assert (qwen.calls, smollm.calls) == (1, 1)
    assert aligner.calls == 2 * len(TEXTS)  # qwen3 and smollm2, not qwen3 twice
    for sample in samples:
        for f in S.TEACHER_FIELDS[:-1]:  # every per-teacher field of an unpacked sample
            assert sample[S.teacher_field_name(f.name, 2)] is sample[f.name], f.name
    assert not torch.equal(samples[0]["teacher1_input_ids"], samples[0]["teacher_input_ids"])
    batch = collator(TEXTS)
    assert (qwen.calls, smollm.calls) == (2, 2)
    assert batch["teacher2_alignment_teacher_chunk_id"] is batch["alignment_teacher_chunk_id"]
    packed = packing.join_documents(samples)
    assert packed["teacher2_alignment_student_chunk_id"] is packed["alignment_student_chunk_id"]
    assert packed["teacher2_position_ids"] is packed["teacher_position_ids"]
    # the same tokenizer with another context: encoded once, truncated and aligned on its own
    other_ctx = CrossTokenizerCollator(
        student_tokenizer=_tok("mistral"),
        teacher_tokenizers=[qwen, qwen],
        aligner=TokenAligner(),
        ctx_length_student=CTX_STUDENT,
        ctx_length_teacher=[CTX_TEACHERS[0], 8],
    )
    calls = qwen.calls
    sample = other_ctx.collate_one(TEXTS[3])
    assert qwen.calls == calls + 1
    assert int(sample["teacher_input_lengths"]) == CTX_TEACHERS[0]
    assert int(sample["teacher1_input_lengths"]) == 8


def test_kd_where_agrees_narrows_every_teacher_or_each_its_own():
    def several(agrees):
        return _make_several(kd_where_agrees=agrees)

    llama = _tok("llama3")
    everyone = several(llama).collate_samples(TEXTS)
    only_second = several([None, llama]).collate_samples(TEXTS)
    plain = [c.collate_samples(TEXTS) for c in _ones()]
    narrowed = [
        _one(t, c, d, agrees="llama3").collate_samples(TEXTS)
        for t, c, d in zip(TEACHERS, CTX_TEACHERS, DIVS)
    ]
    for b in range(len(TEXTS)):
        for i in range(2):
            _assert_teacher_equals(everyone[b], narrowed[i][b], i)
        _assert_teacher_equals(only_second[b], plain[0][b], 0)
        _assert_teacher_equals(only_second[b], narrowed[1][b], 1)
    assert any(
        not torch.equal(p["alignment_pair_valid"], n["alignment_pair_valid"])
        for p, n in zip(plain[1], narrowed[1])
    ), "llama3 agreement narrowed nothing: the test cannot tell"
    batch = several(llama)(TEXTS)
    _assert_teacher_equals(batch, _one("smollm2", 28, 5, agrees="llama3")(TEXTS), 1)


def test_pad_kwargs_of_one_teacher_stay_ints_and_of_several_are_per_teacher():
    assert _ones()[0].pad_kwargs() == {
        "student_pad_id": _ones()[0].student_pad_id,
        "teacher_pad_id": _ones()[0].teacher_pad_id,
        "make_seq_div_by_student": 4,
        "make_seq_div_by_teacher": DIVS[0],
    }
    kwargs = _several().pad_kwargs()
    assert kwargs["teacher_pad_id"] == tuple(c.teacher_pad_id for c in _ones())
    assert kwargs["make_seq_div_by_teacher"] == DIVS
    assert _several().field_names() == S.field_names(2)
    assert _several(pack=True).field_names() == S.field_names(2, packed=True)
    pads = _several().pad_values()
    assert pads["teacher1_input_ids"] == _ones()[1].teacher_pad_id
    assert pads["teacher1_alignment_teacher_chunk_id"] == -1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"teacher_tokenizers": []}, r"teacher_tokenizers is empty; give at least one"),
        ({"teacher_tokenizers": ["qwen3", None]}, r"teacher_tokenizers\[1\] is None; give"),
        ({"teacher_tokenizers": None}, r"teacher_tokenizer is None; give the teacher"),
        (
            {"teacher_tokenizers": ["qwen3"], "teacher_tokenizer": "qwen3"},
            "not both",
        ),
        ({"ctx_length_teacher": [36, 28, 5]}, r"ctx_length_teacher has 3 entries for 2 teachers"),
        ({"ctx_length_teacher": [36, 0]}, r"ctx_length_teacher\[1\] must be an int >= 1"),
        ({"make_seq_div_by_teacher": [2]}, r"make_seq_div_by_teacher has 1 entries for 2"),
        ({"kd_where_agrees": ["llama3"]}, r"kd_where_agrees has 1 entries for 2 teachers"),
        ({"student_tokenizer": None}, r"student_tokenizer is None"),
    ],
)
def test_bad_teacher_settings_are_refused_in_one_line(overrides, message):
    kwargs = dict(
        student_tokenizer=_tok("mistral"),
        teacher_tokenizers=[_tok(name) for name in TEACHERS],
        aligner=TokenAligner(),
        ctx_length_student=CTX_STUDENT,
        ctx_length_teacher=list(CTX_TEACHERS),
    )
    for key, value in overrides.items():
        if isinstance(value, list):
            value = [_tok(v) if isinstance(v, str) else v for v in value]
        elif isinstance(value, str):
            value = _tok(value)
        kwargs[key] = value
    with pytest.raises(ValueError, match=message) as info:
        CrossTokenizerCollator(**kwargs)
    assert "\n" not in str(info.value)


def test_pack_sample_needs_one_tokenization_per_teacher():
    collator = _several()
    student, first, second = collator.tokenize(["abc"])
    with pytest.raises(ValueError, match="got 1 teacher tokenizations for 2 teachers"):
        collator.pack_sample(student[0], first[0])
    sample = collator.pack_sample(student[0], first[0], second[0])
    S.validate_sample(sample, 2)
