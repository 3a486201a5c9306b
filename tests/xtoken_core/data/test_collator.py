"""CrossTokenizerCollator with real tokenizers and the real aligner: keys, shapes, padding,
truncation, empty texts, and jagged collate_one == the padded batch."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtoken_core.align import TokenAligner
from xtoken_core.data import sample as S
from xtoken_core.data.collator import CrossTokenizerCollator, resolve_pad_id
from xtoken_core.tokenizers import load_tokenizer

LONG = (
    "The quick brown fox jumps over the lazy dog. Naïve café owners serve crème brûlée; "
    "日本語のテキストも少し。 def f(x):\n    return x ** 2  # squares\n" * 3
)
TEXTS = ["Hello, world!", LONG, "", "  leading spaces\tand tabs\n\n", "emoji 🙂🙃 and ½ ≠ 0.5"]


@pytest.fixture(scope="module")
def tokenizers():
    return load_tokenizer("qwen3"), load_tokenizer("mistral")


def _collator(tokenizers, **overrides):
    student, teacher = tokenizers
    kwargs = dict(
        student_tokenizer=student,
        teacher_tokenizer=teacher,
        aligner=TokenAligner(),
        ctx_length_student=64,
        ctx_length_teacher=64,
    )
    kwargs.update(overrides)
    return CrossTokenizerCollator(**kwargs)


def test_batch_has_every_key_with_schema_dtype_and_shape(tokenizers):
    collator = _collator(tokenizers, make_seq_div_by_student=3, make_seq_div_by_teacher=5)
    batch = collator(TEXTS)
    assert list(batch) == list(S.FIELD_NAMES)
    b = len(TEXTS)
    t, u = batch["input_ids"].shape[1], batch["teacher_input_ids"].shape[1]
    c = batch["alignment_pair_valid"].shape[1]
    assert t % 3 == 0 and u % 5 == 0
    assert t - 3 < int(batch["input_lengths"].max()) <= t
    assert u - 5 < int(batch["teacher_input_lengths"].max()) <= u
    assert c == max(1, int(batch["alignment_num_chunks"].max()))
    want = {S.STUDENT_TOKEN: (b, t), S.TEACHER_TOKEN: (b, u), S.CHUNK: (b, c), S.SAMPLE: (b,)}
    for spec in S.SAMPLE_FIELDS:
        assert batch[spec.name].dtype == spec.dtype, spec.name
        assert tuple(batch[spec.name].shape) == want[spec.axis], spec.name


def test_padding_uses_pad_ids_and_masks_mark_real_tokens(tokenizers):
    collator = _collator(tokenizers, make_seq_div_by_student=7, make_seq_div_by_teacher=2)
    batch = collator(TEXTS)
    student, teacher = tokenizers
    assert collator.student_pad_id == student.pad_id
    assert collator.teacher_pad_id == teacher.eos_id  # mistral has no pad id: eos is used
    for prefix, pad_id in (("", collator.student_pad_id), ("teacher_", collator.teacher_pad_id)):
        mask = batch[f"{prefix}token_mask"]
        assert mask.sum(1).tolist() == batch[f"{prefix}input_lengths"].tolist()
        assert (batch[f"{prefix}input_ids"][~mask] == pad_id).all()
    for side, mask_key in (("student", "token_mask"), ("teacher", "teacher_token_mask")):
        chunk_id = batch[f"alignment_{side}_chunk_id"]
        assert (chunk_id[~batch[mask_key]] == -1).all()
        assert (chunk_id < batch["alignment_num_chunks"].unsqueeze(1)).all()
        assert not batch[f"alignment_{side}_exact_partition_mask"][~batch[mask_key]].any()


def test_ids_are_the_tokenizer_ids_truncated_per_side(tokenizers):
    student, teacher = tokenizers
    collator = _collator(tokenizers, ctx_length_student=7, ctx_length_teacher=11)
    batch = collator([LONG, "Hello, world!"])
    full_s, full_t = student.encode(LONG).ids, teacher.encode(LONG).ids
    assert len(full_s) > 7 and len(full_t) > 11
    assert batch["input_lengths"][0] == 7 and batch["teacher_input_lengths"][0] == 11
    assert batch["input_ids"][0, :7].tolist() == full_s[:7].tolist()
    assert batch["teacher_input_ids"][0, :11].tolist() == full_t[:11].tolist()
    short_s = student.encode("Hello, world!").ids
    assert batch["input_ids"][1, : len(short_s)].tolist() == short_s.tolist()
    assert batch["sample_mask"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("ctx", [(1, 1), (1, 40), (40, 1), (13, 9), (500, 500)])
def test_truncation_never_drops_a_sample_and_alignment_stays_consistent(tokenizers, ctx):
    collator = _collator(tokenizers, ctx_length_student=ctx[0], ctx_length_teacher=ctx[1])
    batch = collator(TEXTS)
    assert batch["input_ids"].shape[0] == len(TEXTS)
    assert int(batch["input_lengths"].max()) <= ctx[0]
    assert int(batch["teacher_input_lengths"].max()) <= ctx[1]
    assert batch["sample_mask"].tolist() == [0.0 if t == "" else 1.0 for t in TEXTS]
    # Each valid pair has tokens on both sides.
    for row in range(len(TEXTS)):
        for c in torch.nonzero(batch["alignment_pair_valid"][row]).flatten().tolist():
            assert (batch["alignment_student_chunk_id"][row] == c).any()
            assert (batch["alignment_teacher_chunk_id"][row] == c).any()


def test_empty_text_keeps_its_slot_with_zero_sample_mask(tokenizers):
    collator = _collator(tokenizers, make_seq_div_by_student=4)
    batch = collator(["", "abc", ""])
    assert batch["sample_mask"].tolist() == [0.0, 1.0, 0.0]
    assert batch["input_lengths"].tolist()[0] == 0  # qwen3 adds no specials
    assert not batch["token_mask"][0].any()
    assert batch["input_ids"].shape == (3, 4)
    only_empty = collator([""])
    assert only_empty["input_ids"].shape == (1, 4), "widths are never 0"
    assert only_empty["alignment_pair_valid"].shape == (1, 1)
    assert not only_empty["alignment_pair_valid"].any()


def test_batch_of_one_matches_its_row_in_a_batch_of_many(tokenizers):
    collator = _collator(tokenizers, ctx_length_student=20, ctx_length_teacher=30)
    many = collator(TEXTS)
    for row, text in enumerate(TEXTS):
        one = collator([{"text": text, "id": row}])
        for spec in S.SAMPLE_FIELDS:
            if spec.axis == S.SAMPLE:
                assert torch.equal(one[spec.name][0], many[spec.name][row]), spec.name
            else:
                n = one[spec.name].shape[1]
                assert torch.equal(one[spec.name][0], many[spec.name][row, :n]), spec.name


def _assert_jagged_equals_padded(collator, texts):
    batch = collator(texts)
    samples = [collator.collate_one(t) for t in texts]
    many = collator.collate_samples(texts)
    for sample, other in zip(samples, many, strict=True):
        S.validate_sample(sample)
        assert all(torch.equal(sample[k], other[k]) for k in S.FIELD_NAMES)
    rebuilt = S.pad_samples(samples, **collator.pad_kwargs())
    assert list(rebuilt) == list(batch)
    for name in batch:
        assert rebuilt[name].dtype == batch[name].dtype, name
        assert torch.equal(rebuilt[name], batch[name]), name


@pytest.mark.parametrize("divs", [(1, 1), (3, 5), (8, 7)])
def test_jagged_samples_pad_to_exactly_the_collated_batch(tokenizers, divs):
    collator = _collator(
        tokenizers,
        ctx_length_student=33,
        ctx_length_teacher=17,
        make_seq_div_by_student=divs[0],
        make_seq_div_by_teacher=divs[1],
    )
    _assert_jagged_equals_padded(collator, TEXTS)


def test_jagged_sample_has_its_own_lengths_and_no_padding(tokenizers):
    collator = _collator(tokenizers)
    sample = collator.collate_one({"text": "Hello, world!"})
    t, u = int(sample["input_lengths"]), int(sample["teacher_input_lengths"])
    assert sample["input_ids"].shape == (t,) and sample["teacher_input_ids"].shape == (u,)
    assert sample["alignment_pair_valid"].shape == (int(sample["alignment_num_chunks"]),)
    assert sample["token_mask"].all() and sample["teacher_token_mask"].all()
    assert sample["teacher_input_ids"][0] == tokenizers[1].bos_id


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    texts=st.lists(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
        min_size=1,
        max_size=4,
    ),
    ctx=st.tuples(st.integers(1, 12), st.integers(1, 12)),
)
def test_jagged_equals_padded_for_any_text(tokenizers, texts, ctx):
    collator = _collator(
        tokenizers,
        ctx_length_student=ctx[0],
        ctx_length_teacher=ctx[1],
        make_seq_div_by_student=3,
        make_seq_div_by_teacher=2,
    )
    _assert_jagged_equals_padded(collator, texts)


@pytest.mark.parametrize(
    "bad",
    [
        {"ctx_length_student": 0},
        {"ctx_length_teacher": -1},
        {"make_seq_div_by_student": 0},
        {"make_seq_div_by_teacher": 2.0},
        {"ctx_length_student": True},
    ],
)
def test_constructor_rejects_bad_lengths_and_divisors(tokenizers, bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        _collator(tokenizers, **bad)


def test_bad_batches_are_rejected_with_the_item_index(tokenizers):
    collator = _collator(tokenizers)
    with pytest.raises(ValueError, match="empty batch"):
        collator([])
    with pytest.raises(ValueError, match="batch item 1: .* got NoneType"):
        collator(["ok", {"body": "x"}])
    with pytest.raises(ValueError, match="batch item 0: .* got int"):
        collator([3])


def test_pad_id_falls_back_to_eos_then_zero():
    assert resolve_pad_id(types.SimpleNamespace(pad_id=5, eos_id=2)) == 5
    assert resolve_pad_id(types.SimpleNamespace(pad_id=None, eos_id=2)) == 2
    assert resolve_pad_id(types.SimpleNamespace(pad_id=None, eos_id=None)) == 0
    assert resolve_pad_id(object()) == 0


def _agreeing_student_tokens(student_tok, other_tok, text):
    """Student token indices that are one token of ``other_tok`` over the same bytes: their
    byte spans match a span of the other tokenization exactly (brute force, no aligner)."""
    s = student_tok.encode_batch([text], False)[0]
    o = other_tok.encode_batch([text], False)[0]
    other_spans = {tuple(int(x) for x in sp) for sp, role in zip(o.spans, o.roles) if sp[1] > sp[0]}
    return {i for i, sp in enumerate(s.spans) if tuple(int(x) for x in sp) in other_spans}


@pytest.mark.parametrize("text", [LONG, "Hello, world!", "emoji 🙂🙃 and ½ ≠ 0.5", ""])
def test_kd_where_another_tokenizer_agrees_keeps_exactly_its_one_to_one_tokens(tokenizers, text):
    """Same tokenizer both sides (qwen3: identity chunks, every one valid); with
    ``kd_where_agrees=mistral`` a chunk stays valid exactly where its token is also one mistral
    token over the same bytes; ids, lengths and chunk ids are unchanged."""
    qwen, mistral = tokenizers
    plain = _collator((qwen, qwen), ctx_length_student=512, ctx_length_teacher=512)
    narrowed = _collator(
        (qwen, qwen), ctx_length_student=512, ctx_length_teacher=512, kd_where_agrees=mistral
    )
    a, b = plain.collate_one(text), narrowed.collate_one(text)
    for name in S.FIELD_NAMES:
        if name != "alignment_pair_valid":
            assert torch.equal(a[name], b[name]), name
    chunk_T = b["alignment_student_chunk_id"].tolist()
    valid = b["alignment_pair_valid"].tolist()
    kept = {i for i, c in enumerate(chunk_T) if c >= 0 and valid[c]}
    assert kept == _agreeing_student_tokens(qwen, mistral, text)
    assert bool(a["alignment_pair_valid"].all())
    if text == LONG:  # CJK and code: mistral cuts some of them otherwise
        assert 0 < len(kept) < len(chunk_T)
    batch = narrowed([text, "Hello, world!"])  # the padded batch narrows alike
    assert batch["alignment_pair_valid"][0, : len(valid)].tolist() == valid
