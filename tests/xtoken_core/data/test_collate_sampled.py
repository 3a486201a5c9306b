"""CrossTokenizerCollator.collate_sampled: token ids the student sampled become a sample exactly
as a collator makes one of text: the student ids as sampled (cut at valid UTF-8), the teacher
ids of the decoded text, an exact byte alignment. Property tests over random sequences of both
kinds of tokenizer, invalid UTF-8 tails included."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from xtoken_core.align import TokenAligner
from xtoken_core.data import sample as schema
from xtoken_core.data.collator import CrossTokenizerCollator
from xtoken_core.tokenizers import load_tokenizer

# (student, teacher): a byte-level BPE student with a SentencePiece teacher, and the other way
PAIRS = [("qwen3", "mistral"), ("mistral", "qwen3")]
CTX = 48


@functools.cache
def collator(student: str, teacher: str) -> CrossTokenizerCollator:
    return CrossTokenizerCollator(
        student_tokenizer=load_tokenizer(student),
        teacher_tokenizer=load_tokenizer(teacher),
        aligner=TokenAligner(),
        ctx_length_student=CTX,
        ctx_length_teacher=CTX,
    )


@functools.cache
def high_byte_ids(name: str) -> list[int]:
    """Single-byte tokens >= 0x80 (continuation or lead bytes: invalid or incomplete UTF-8)."""
    t = load_tokenizer(name)
    return [i for i in range(t.vocab_size) if len(b := t.token_bytes(i)) == 1 and b[0] >= 0x80]


@st.composite
def sampled(draw, name: str) -> list[int]:
    """A prompt's tokens (a text's first tokens) and a random continuation that often ends in
    (or holds) bytes that are no UTF-8."""
    t = load_tokenizer(name)
    prompt = t.encode(draw(st.text(max_size=40))).ids.tolist()[: draw(st.integers(0, 16))]
    pick = st.one_of(st.integers(0, t.vocab_size - 1), st.sampled_from(high_byte_ids(name)))
    return prompt + draw(st.lists(pick, max_size=40))


def covered_bytes(spans: np.ndarray, chunk_id: np.ndarray, c: int) -> set[int]:
    """The byte offsets the tokens of chunk ``c`` cover."""
    out: set[int] = set()
    for start, end in spans[chunk_id == c]:
        out.update(range(int(start), int(end)))
    return out


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_sampled_sequence_becomes_a_valid_exactly_aligned_sample(student, teacher, data):
    col = collator(student, teacher)
    ids = data.draw(sampled(student))
    (s,), (t,) = col.tokenize_sampled([ids])
    (sample,) = col.collate_sampled([ids])
    schema.validate_sample(sample)
    assert sample["input_ids"].tolist() == ids[: len(s)]  # the student's ids as sampled
    want = col.teacher_tokenizer.encode(s.text).ids[:CTX].tolist()
    assert sample["teacher_input_ids"].tolist() == want  # the decoded text, tokenized again
    assert float(sample["sample_mask"]) == (1.0 if s.text else 0.0)
    # every valid chunk covers the same bytes of the text on both sides
    s_chunk = sample["alignment_student_chunk_id"].numpy()
    t_chunk = sample["alignment_teacher_chunk_id"].numpy()
    for c in np.flatnonzero(sample["alignment_pair_valid"].numpy()):
        assert covered_bytes(s.spans, s_chunk, c) == covered_bytes(t.spans, t_chunk, c), c


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=60))
@example(text="a▁b")
def test_the_student_tokenization_of_a_text_gives_the_collators_sample_of_it(
    student, teacher, text
):
    col = collator(student, teacher)
    ids = col.student_tokenizer.encode(text).ids.tolist()
    assume(len(ids) <= CTX)  # a longer text's sample holds teacher tokens past the student's
    # SentencePiece reads a literal "▁" as a space (both are the same ids), so its ids can
    # only stand for one of the two texts: the property holds for texts the ids spell
    (spelled,), _ = col.tokenize_sampled([ids])
    assume(spelled.text == text)
    (got,) = col.collate_sampled([ids])
    (want,) = col.collate_samples([text])
    for name in schema.FIELD_NAMES:
        assert torch.equal(got[name], want[name]), name


def test_a_sentencepiece_students_ids_of_a_literal_word_boundary_mean_a_space():
    col = collator("mistral", "qwen3")
    ids = col.student_tokenizer.encode("a▁b").ids.tolist()
    assert ids == col.student_tokenizer.encode("a b").ids.tolist()
    (spelled,), (teacher,) = col.tokenize_sampled([ids])
    assert spelled.text == "a b"
    assert teacher.ids_N.tolist() == col.teacher_tokenizer.encode("a b").ids.tolist()


def test_an_id_outside_the_student_vocabulary_is_refused_naming_it():
    col = collator("mistral", "qwen3")
    bad = col.student_tokenizer.vocab_size + 5
    with pytest.raises(ValueError, match=rf"token id {bad} is out of range"):
        col.collate_sampled([[1, 2, bad]])
