"""TokenAligner properties on demo-corpus texts (whole, and sliced at random byte/char cuts), all pairs."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtoken_core.align import TokenAligner
from xtoken_core.data.corpus import build_demo_corpus, iter_texts
from xtoken_core.tokenizers import ROLE_CONTENT, load_tokenizer

NAMES = ["qwen3", "deepseek", "mistral", "llama3"]
ORDERED_PAIRS = list(itertools.permutations(NAMES, 2))
ALIGNER = TokenAligner()
POOL_ASCII = 60  # ASCII texts drawn (seeded) beside every non-ASCII text of the corpus


class _Pool(list):
    """The text pool, with a short repr (hypothesis prints fixture values on failure)."""

    def __repr__(self) -> str:
        return f"<{len(self)} demo-corpus texts>"


@pytest.fixture(scope="session")
def corpus_texts(tmp_path_factory):
    """A deterministic pool of demo-corpus texts: every non-ASCII one plus seeded ASCII ones."""
    corpus = build_demo_corpus(tmp_path_factory.mktemp("demo"))
    texts = [text for _, text in iter_texts(corpus.train_path)]
    non_ascii = [t for t in texts if not t.isascii()]
    ascii_ = [t for t in texts if t.isascii()]
    pool = non_ascii + random.Random(0).sample(ascii_, min(POOL_ASCII, len(ascii_)))
    assert len(non_ascii) >= 20, "the demo corpus should hold some non-ASCII texts"
    return _Pool(pool)


@st.composite
def corpus_slices(draw, pool):
    """A corpus text, whole or cut at random character or byte positions (lossy at the cuts)."""
    text = draw(st.sampled_from(pool))
    mode = draw(st.sampled_from(["whole", "chars", "bytes"]))
    if mode == "whole":
        return text
    if mode == "chars":
        a = draw(st.integers(0, len(text)))
        b = draw(st.integers(a, len(text)))
        return text[a:b]
    raw = text.encode("utf-8")
    a = draw(st.integers(0, len(raw)))
    b = draw(st.integers(a, len(raw)))
    # A cut inside a multi-byte character leaves U+FFFD, itself a character to tokenize.
    return raw[a:b].decode("utf-8", errors="replace")


caps = st.one_of(st.none(), st.integers(0, 300))


def assert_alignment_properties(sample, student, teacher):
    """The aligner's contract on one sample (vectorized; raises AssertionError).

    * chunk ids are in [-1, C) and non-decreasing over the tokens of each side;
    * every valid chunk holds tokens on both sides whose spans tile identical bytes;
    * chunks are ordered and disjoint in bytes;
    * every content token is in exactly one two-sided chunk, or is one-sided (chunk id -1) and
      then overlaps no byte of a valid chunk.
    """
    c = int(sample.num_chunks)
    assert sample.pair_valid.shape == (c,) and sample.pair_is_correct.shape == (c,)
    text_bytes = student.text.encode("utf-8")
    assert teacher.text == student.text
    ranges = []
    for x, ids in ((student, sample.student_chunk_id), (teacher, sample.teacher_chunk_id)):
        assert ids.shape == (len(x),)
        assert ((ids >= -1) & (ids < c)).all()
        assigned = ids[ids >= 0]
        assert (np.diff(assigned) >= 0).all(), "chunk ids must be ordered on each side"
        # Per chunk: lowest start, highest end and bytes covered by this side's tokens.
        sel = ids >= 0
        lo = np.full(c, np.iinfo(np.int64).max)
        hi = np.full(c, -1)
        np.minimum.at(lo, ids[sel], x.spans[sel, 0])
        np.maximum.at(hi, ids[sel], x.spans[sel, 1])
        cover = np.bincount(ids[sel], weights=x.spans[sel, 1] - x.spans[sel, 0], minlength=c)
        count = np.bincount(ids[sel], minlength=c)
        ranges.append((lo, hi, cover.astype(np.int64), count))
    (s_lo, s_hi, s_cover, s_count), (t_lo, t_hi, t_cover, t_count) = ranges

    valid = sample.pair_valid
    assert (s_count[valid] > 0).all() and (t_count[valid] > 0).all(), "valid chunk is two-sided"
    assert np.array_equal(s_count > 0, t_count > 0), "a chunk with ids on one side only"
    assert np.array_equal(s_lo[valid], t_lo[valid]) and np.array_equal(s_hi[valid], t_hi[valid])
    width = s_hi - s_lo
    assert np.array_equal(s_cover[valid], width[valid]), "student tokens tile the chunk"
    assert np.array_equal(t_cover[valid], width[valid]), "teacher tokens tile the chunk"
    for k in np.flatnonzero(valid & (width > 0))[:64]:  # byte-for-byte on a few (cheap)
        s_tok = np.flatnonzero(sample.student_chunk_id == k)
        t_tok = np.flatnonzero(sample.teacher_chunk_id == k)
        s_text = b"".join(text_bytes[a:b] for a, b in student.spans[s_tok])
        t_text = b"".join(text_bytes[a:b] for a, b in teacher.spans[t_tok])
        assert s_text == t_text == text_bytes[s_lo[k] : s_hi[k]]

    # Ordered and disjoint: the byte ranges of chunks holding bytes follow chunk order.
    has = s_count > 0
    lo_c = np.minimum(s_lo, t_lo)[has]
    hi_c = np.maximum(s_hi, t_hi)[has]
    assert (lo_c[1:] >= hi_c[:-1]).all(), "chunks overlap or are out of byte order"

    # One-sided content tokens never overlap a valid chunk's bytes.
    v_lo, v_hi = s_lo[valid & (width > 0)], s_hi[valid & (width > 0)]
    for x, ids in ((student, sample.student_chunk_id), (teacher, sample.teacher_chunk_id)):
        alone = (ids == -1) & (x.roles == ROLE_CONTENT) & (x.spans[:, 1] > x.spans[:, 0])
        for a, b in x.spans[alone][:256]:
            j = np.searchsorted(v_hi, a, side="right")
            assert j == len(v_lo) or v_lo[j] >= b, "a one-sided token overlaps a valid chunk"
    # Exact tokens are 1:1 valid chunks with equal spans.
    s_ex, t_ex = sample.student_exact_partition_mask, sample.teacher_exact_partition_mask
    assert s_ex.sum() == t_ex.sum()
    assert valid[sample.student_chunk_id[s_ex]].all()
    assert np.array_equal(student.spans[s_ex], teacher.spans[t_ex])


def encode(name, text, cap):
    return load_tokenizer(name).encode(text).truncated(cap)


@pytest.mark.parametrize("s_name,t_name", ORDERED_PAIRS)
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_demo_corpus_slices_align_exactly_for_every_ordered_pair(
    corpus_texts, s_name, t_name, data
):
    text = data.draw(corpus_slices(corpus_texts))
    s_cap, t_cap = data.draw(caps), data.draw(caps)
    student, teacher = encode(s_name, text, s_cap), encode(t_name, text, t_cap)
    sample = ALIGNER.align_tokenized(student, teacher)
    assert_alignment_properties(sample, student, teacher)
    if s_cap is None and t_cap is None and text.strip():
        # Untruncated: every content token is in a two-sided chunk.
        for x, ids in ((student, sample.student_chunk_id), (teacher, sample.teacher_chunk_id)):
            assert (ids[x.roles == ROLE_CONTENT] >= 0).all()
    if "qwen3" not in (s_name, t_name) and s_cap is None and t_cap is None:
        # No normalizer on either side and no truncation: every content chunk is exact.
        content_chunks = sample.student_chunk_id[
            (student.roles == ROLE_CONTENT) & (sample.student_chunk_id >= 0)
        ]
        assert sample.pair_valid[content_chunks].all()


@pytest.mark.parametrize("name", NAMES)
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_demo_corpus_slices_align_to_identity_with_the_same_tokenizer(corpus_texts, name, data):
    text = data.draw(corpus_slices(corpus_texts))
    cap = data.draw(caps)
    student = teacher = encode(name, text, cap)
    sample = ALIGNER.align_tokenized(student, teacher)
    assert_alignment_properties(sample, student, teacher)
    assert np.array_equal(sample.student_chunk_id, sample.teacher_chunk_id)
    assert sample.pair_valid.all() and (sample.student_chunk_id >= 0).all()
    nonempty = student.spans[:, 1] > student.spans[:, 0]
    # Every non-empty token is its own exact chunk (an empty dummy "▁" joins its neighbour).
    assert len(np.unique(sample.student_chunk_id[nonempty])) == nonempty.sum()
    assert sample.student_exact_partition_mask[nonempty].sum() >= nonempty.sum() - 1
