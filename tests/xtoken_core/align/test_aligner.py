"""TokenAligner on real tokenizer pairs: exact chunks, ordering, coverage, specials, truncation."""

import itertools
import unicodedata

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.align import ALIGNMENT_FIELDS, AlignmentBatch, TokenAligner, alignment_stats
from xtoken_core.tokenizers import ROLE_BOS, ROLE_EOS, ROLE_SPECIAL, load_tokenizer

NAMES = ["qwen3", "deepseek", "mistral", "llama3"]
PAIRS = list(itertools.combinations(NAMES, 2))
ALIGNER = TokenAligner()
FRAGMENTS = [
    " ",
    "   ",
    "\t\t",
    "\n\n",
    "\r\n",
    "🇺🇸",
    "🇯🇵🇫🇷",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "你好世界",
    "日本語のテキスト",
    "e\u0301",
    "n\u0303o",
    "שלום עולם",
    "مرحبا بالعالم",
    "12345678901234567890",
    "3.14159",
    "def f(x):\n\treturn x ** 2  # sq\n",
    '{"k": [1, 2]}',
    "ﬁ",
    "Ａ",
    "\u212b",
    "▁",
    "<s>",
    "<|endoftext|>",
    "don't",
    "HELLO",
]
NAMED_TEXTS = {
    "empty": "",
    "whitespace_only": " \t \n ",
    "space_runs": "a     b\t\t\tc\n\n\n\nd  \r\n  e",
    "emoji_zwj_and_flags": "family 👨‍👩‍👧‍👦 flags 🇺🇸🇯🇵 rainbow 🏳️‍🌈!",
    "cjk": "我们今天去公园散步。東京は晴れです。한국어 텍스트",
    "combining_marks": "Cafe\u0301 n\u0303 a\u0308\u0301 Zalgo: Z\u0351\u0300\u0306a\u0302",
    "rtl": "שלום, עולם! مرحبا بالعالم 123",
    "long_digits": "π ≈ 3." + "1415926535" * 30,
    "code": "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
    "long_word": "x" * 19_000 + "yz" * 500,
}
texts = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=10),
    ),
    max_size=8,
).map("".join)


def check_alignment(sample, student, teacher):
    """Invariants every alignment must satisfy (raises AssertionError)."""
    c = sample.num_chunks
    assert len(sample.pair_valid) == c == len(sample.pair_is_correct)
    assert np.array_equal(sample.pair_valid, sample.pair_is_correct)
    s_ids, t_ids = sample.student_chunk_id, sample.teacher_chunk_id
    assert len(s_ids) == len(student) and len(t_ids) == len(teacher)
    for ids in (s_ids, t_ids):
        got = ids[ids >= 0]
        assert (np.diff(got) >= 0).all(), "chunks must be ordered on each side"
        assert (got < c).all()
    prev_end = -1
    for k in range(c):
        s_tok, t_tok = np.flatnonzero(s_ids == k), np.flatnonzero(t_ids == k)
        if not sample.pair_valid[k]:
            continue
        assert len(s_tok) and len(t_tok), "a valid chunk has tokens on both sides"
        s_sp, t_sp = student.spans[s_tok], teacher.spans[t_tok]
        lo, hi = s_sp[:, 0].min(), s_sp[:, 1].max()
        assert (lo, hi) == (t_sp[:, 0].min(), t_sp[:, 1].max()), "valid chunk: same bytes"
        for sp in (s_sp, t_sp):  # tokens tile the chunk's bytes on both sides
            assert (sp[:, 1] - sp[:, 0]).sum() == hi - lo
        assert lo >= prev_end, "chunks are disjoint and ordered in bytes"
        prev_end = hi
    # Every content token up to the shorter side's end is in a chunk; the tail is one-sided.
    s_end = student.spans[student.roles == 0, 1].max(initial=0)
    t_end = teacher.spans[teacher.roles == 0, 1].max(initial=0)
    end = min(s_end, t_end)
    for x, ids in ((student, s_ids), (teacher, t_ids)):
        content = x.roles == 0
        inside = content & (x.spans[:, 0] < end)
        assert (ids[inside] >= 0).all(), "content before the common end must be chunked"
        tail = content & (x.spans[:, 0] >= end) & (x.spans[:, 1] > x.spans[:, 0])
        assert (ids[tail] == -1).all(), "the tail past the shorter side is one-sided"
    # Exact tokens are 1:1 chunks with identical spans.
    for k in np.unique(s_ids[sample.student_exact_partition_mask]):
        s_tok, t_tok = np.flatnonzero(s_ids == k), np.flatnonzero(t_ids == k)
        assert len(s_tok) == len(t_tok) == 1 and sample.pair_valid[k]
        assert np.array_equal(student.spans[s_tok[0]], teacher.spans[t_tok[0]])
        assert sample.teacher_exact_partition_mask[t_tok[0]]
    assert sample.student_exact_partition_mask.sum() == sample.teacher_exact_partition_mask.sum()


def align_pair(text, s_name, t_name, s_cap=None, t_cap=None):
    s_tok, t_tok = load_tokenizer(s_name), load_tokenizer(t_name)
    student = s_tok.encode(text).truncated(s_cap)
    teacher = t_tok.encode(text).truncated(t_cap)
    return ALIGNER.align_tokenized(student, teacher), student, teacher


@pytest.mark.parametrize("s_name,t_name", PAIRS)
@settings(max_examples=25, deadline=None)
@given(text=texts)
def test_random_text_alignment_is_exact_for_every_tokenizer_pair(s_name, t_name, text):
    sample, student, teacher = align_pair(text, s_name, t_name)
    check_alignment(sample, student, teacher)
    if s_name != "qwen3" and t_name != "qwen3":  # no normalizer: every content chunk is valid
        content_chunks = np.unique(sample.student_chunk_id[student.roles == 0])
        assert sample.pair_valid[content_chunks[content_chunks >= 0]].all()


COMBINING_MARKS = ["\u0301", "\u0303", "\u0308", "\u0327", "\u0351", "\u0300\u0306"]


def chunk_text(tok, enc, token_idx):
    """What a chunk's tokens stand for as text, NFC-normalized (Qwen3's normalizer composes
    characters, so its tokens spell the NFC form of the bytes their spans cover)."""
    pieces = [tok.token_bytes(int(i)) for i in enc.ids[token_idx]]
    first_content = np.flatnonzero(enc.roles == 0)[:1]
    if tok._dummy_prefix and len(first_content) and first_content[0] in token_idx:
        k = int(np.flatnonzero(token_idx == first_content[0])[0])
        pieces[k] = pieces[k][1:] if pieces[k][:1] == b" " else pieces[k]  # the dummy "▁"
    return unicodedata.normalize("NFC", b"".join(pieces).decode("utf-8", "surrogateescape"))


def check_valid_chunks_stand_for_their_bytes(sample, s_tok, student, t_tok, teacher):
    """Every valid chunk's tokens, on both sides, spell the bytes their spans cover."""
    text_bytes = student.text.encode("utf-8")
    for k in np.flatnonzero(sample.pair_valid):
        s_idx = np.flatnonzero(sample.student_chunk_id == k)
        t_idx = np.flatnonzero(sample.teacher_chunk_id == k)
        lo, hi = student.spans[s_idx, 0].min(), student.spans[s_idx, 1].max()
        covered = unicodedata.normalize("NFC", text_bytes[lo:hi].decode("utf-8", "surrogateescape"))
        for tok, enc, idx in ((s_tok, student, s_idx), (t_tok, teacher, t_idx)):
            want = covered
            if tok._dummy_prefix:  # SentencePiece reads a literal "▁" in the text as a space
                want = want.replace("\u2581", " ")
            assert chunk_text(tok, enc, idx) == want, (tok.name, k, lo, hi)


def test_combining_mark_at_the_end_under_nfc_is_one_chunk_like_mid_text():
    # Qwen3 composes " n\u0303" to " ñ" and splits it " \xc3" + "\xb1": those two tokens are
    # one group covering all 4 bytes, at the end of the text as in the middle of it.
    for text in (" n\u0303", " n\u0303 x"):
        sample, student, teacher = align_pair(text, "qwen3", "deepseek")
        assert sample.pair_valid.tolist()[:1] == [True]
        assert student.spans[:2].tolist() == [[0, 4], [4, 4]]
        assert sample.student_chunk_id[:2].tolist() == [0, 0]
        assert sample.teacher_chunk_id[:2].tolist() == [0, 0]
        check_alignment(sample, student, teacher)
        check_valid_chunks_stand_for_their_bytes(
            sample, load_tokenizer("qwen3"), student, load_tokenizer("deepseek"), teacher
        )


@pytest.mark.parametrize("s_name,t_name", PAIRS)
@settings(max_examples=25, deadline=None)
@given(
    text=texts,
    marks=st.lists(st.sampled_from(COMBINING_MARKS), min_size=1, max_size=3).map("".join),
)
def test_valid_chunks_cover_identical_bytes_with_combining_marks_at_the_end(
    s_name, t_name, text, marks
):
    sample, student, teacher = align_pair(text + marks, s_name, t_name)
    check_alignment(sample, student, teacher)
    check_valid_chunks_stand_for_their_bytes(
        sample, load_tokenizer(s_name), student, load_tokenizer(t_name), teacher
    )


@pytest.mark.parametrize("s_name,t_name", PAIRS)
@settings(max_examples=25, deadline=None)
@given(text=texts)
def test_valid_chunks_stand_for_the_bytes_they_cover(s_name, t_name, text):
    sample, student, teacher = align_pair(text, s_name, t_name)
    check_valid_chunks_stand_for_their_bytes(
        sample, load_tokenizer(s_name), student, load_tokenizer(t_name), teacher
    )


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(text=texts)
def test_same_tokenizer_on_both_sides_gives_identity_alignment(name, text):
    sample, student, teacher = align_pair(text, name, name)
    check_alignment(sample, student, teacher)
    assert np.array_equal(sample.student_chunk_id, sample.teacher_chunk_id)
    assert sample.pair_valid.all()
    nonempty = student.spans[:, 1] > student.spans[:, 0]
    # Every non-empty token is a chunk of its own, joined by nothing but empty pieces (a "▁", or a
    # combining mark whose bytes the tokenizer's offsets gave to the token before: " e\u0301▁e\u0301"
    # ends in two of them); a chunk is an exact 1:1 partition when it is one non-empty token.
    chunk = sample.student_chunk_id
    assert np.bincount(chunk, weights=nonempty.astype(float)).max(initial=0) <= 1
    assert sample.num_chunks >= nonempty.sum()
    alone = np.bincount(chunk)[chunk] == 1
    assert np.array_equal(sample.student_exact_partition_mask, nonempty & alone)


def test_combining_marks_around_a_literal_space_piece_align_as_identity_under_sentencepiece():
    # the case that found the bound above too tight: two empty pieces, each joined to its token
    sample, student, _ = align_pair(" e\u0301\u2581e\u0301", "mistral", "mistral")
    assert student.spans.tolist() == [[0, 0], [0, 0], [0, 2], [2, 4], [4, 10], [10, 10]]
    assert (
        sample.student_chunk_id.tolist() == sample.teacher_chunk_id.tolist() == [0, 1, 1, 2, 3, 3]
    )
    assert sample.student_exact_partition_mask.tolist() == [False, False, False, True, False, False]


@pytest.mark.parametrize("case", sorted(NAMED_TEXTS))
def test_named_edge_case_aligns_exactly_for_every_pair(case):
    text = NAMED_TEXTS[case]
    for s_name, t_name in PAIRS:
        sample, student, teacher = align_pair(text, s_name, t_name)
        check_alignment(sample, student, teacher)
        assert sample.num_chunks >= 0 and sample.pair_valid.sum() >= (1 if text.strip() else 0)


@pytest.mark.parametrize("s_cap,t_cap", [(7, 30), (30, 7), (1, 50), (12, 12), (0, 5)])
def test_different_truncation_points_leave_a_one_sided_tail(s_cap, t_cap):
    text = "The quick brown fox jumps over the lazy dog. 🦊 狐狸跳过了懒狗。 " * 3
    for s_name, t_name in PAIRS:
        sample, student, teacher = align_pair(text, s_name, t_name, s_cap, t_cap)
        check_alignment(sample, student, teacher)
        longer = teacher if s_cap < t_cap else student
        ids = sample.teacher_chunk_id if s_cap < t_cap else sample.student_chunk_id
        if s_cap != t_cap:
            assert (ids[-3:] == -1).all()
            assert len(longer) > 3


def test_bos_pairs_with_bos_and_unmatched_specials_are_one_sided():
    sample, student, teacher = align_pair("Hello world", "mistral", "llama3")
    assert student.roles[0] == ROLE_BOS and teacher.roles[0] == ROLE_BOS
    assert sample.student_chunk_id[0] == sample.teacher_chunk_id[0] == 0
    assert sample.pair_valid[0] and not sample.student_exact_partition_mask[0]
    sample, student, teacher = align_pair("Hello world", "qwen3", "llama3")  # Qwen adds no BOS
    assert sample.teacher_chunk_id[0] == -1
    assert not sample.pair_valid[0]  # the BOS's one-sided slot comes first
    assert sample.student_chunk_id[0] == 1


def test_eos_pairs_by_role_at_the_same_byte_position():
    # Student: "ab" + EOS; teacher: "a","b" + EOS + an unpairable special.
    s_spans = np.array([[0, 2], [2, 2]])
    t_spans = np.array([[0, 1], [1, 2], [2, 2], [2, 2]])
    sample = ALIGNER.align_sample(
        s_spans, t_spans, student_roles=[0, ROLE_EOS], teacher_roles=[0, 0, ROLE_EOS, ROLE_SPECIAL]
    )
    assert sample.student_chunk_id.tolist() == [0, 1]
    assert sample.teacher_chunk_id.tolist() == [0, 0, 1, -1]
    assert sample.pair_valid.tolist() == [True, True, False]


def test_bytes_dropped_by_one_side_make_the_chunk_invalid():
    # Student drops two spaces (bytes 5..7); the teacher covers them.
    s_spans = np.array([[0, 5], [7, 12]])
    t_spans = np.array([[0, 5], [5, 6], [6, 12]])
    sample = ALIGNER.align_sample(s_spans, t_spans)
    assert sample.pair_valid.tolist() == [True, False]
    assert sample.student_chunk_id.tolist() == [0, 1]
    assert sample.teacher_chunk_id.tolist() == [0, 1, 1]


def test_masked_tokens_get_chunk_id_minus_one():
    spans = np.array([[0, 1], [1, 2], [2, 3]])
    sample = ALIGNER.align_sample(spans, spans, student_mask=[True, True, False])
    assert sample.student_chunk_id.tolist() == [0, 1, -1]
    assert sample.teacher_chunk_id.tolist() == [0, 1, -1]  # past the student's end: one-sided


def test_overlapping_spans_are_rejected():
    with pytest.raises(ValueError, match="ordered and disjoint"):
        ALIGNER.align_sample(np.array([[0, 3], [2, 4]]), np.array([[0, 4]]))


def _padded(tokenized, width):
    b = len(tokenized)
    ids = np.zeros((b, width), np.int64)
    spans = np.zeros((b, width, 2), np.int64)
    mask = np.zeros((b, width), bool)
    roles = np.zeros((b, width), np.int8)
    for i, x in enumerate(tokenized):
        n = len(x)
        ids[i, :n], spans[i, :n], mask[i, :n], roles[i, :n] = x.ids, x.spans, True, x.roles
    return torch.from_numpy(ids), torch.from_numpy(spans), torch.from_numpy(mask), roles


@pytest.mark.parametrize("texts_", [["just one text"], list(NAMED_TEXTS.values())[:8] + ["", "z"]])
def test_batch_align_matches_per_sample_alignment(texts_):
    s_tok, t_tok = load_tokenizer("deepseek"), load_tokenizer("mistral")
    students, teachers, from_texts = ALIGNER.align_texts(texts_, s_tok, t_tok, 64, 80)
    s_ids, s_spans, s_mask, s_roles = _padded(students, 70)
    t_ids, t_spans, t_mask, t_roles = _padded(teachers, 81)
    batch = ALIGNER.align(s_ids, t_ids, s_spans, t_spans, s_mask, t_mask, s_roles, t_roles)
    batch.validate()
    assert batch.student_chunk_id.shape == (len(texts_), 70)
    assert batch.teacher_chunk_id.shape == (len(texts_), 81)
    assert batch.max_pairs >= 1 and batch.batch_size == len(texts_)
    assert (batch.student_chunk_id[~s_mask] == -1).all() and (
        batch.teacher_chunk_id[~t_mask] == -1
    ).all()
    for i, (student, teacher) in enumerate(zip(students, teachers)):
        sample = ALIGNER.align_tokenized(student, teacher)
        check_alignment(sample, student, teacher)
        n = sample.num_chunks
        assert batch.num_chunks[i] == n
        assert batch.pair_valid[i, :n].numpy().tolist() == sample.pair_valid.tolist()
        assert not batch.pair_valid[i, n:].any()
        assert (
            batch.student_chunk_id[i, : len(student)].tolist() == sample.student_chunk_id.tolist()
        )
        assert torch.equal(
            from_texts.student_chunk_id[i, : len(student)],
            batch.student_chunk_id[i, : len(student)],
        )


def test_alignment_batch_has_the_contract_fields_and_dtypes():
    _, _, batch = ALIGNER.align_texts(
        ["a b c", ""], load_tokenizer("qwen3"), load_tokenizer("llama3")
    )
    flat = batch.to_flat_dict()
    assert sorted(flat) == sorted("alignment_" + f for f in ALIGNMENT_FIELDS)
    for name in (
        "pair_valid",
        "pair_is_correct",
        "student_exact_partition_mask",
        "teacher_exact_partition_mask",
    ):
        assert getattr(batch, name).dtype == torch.bool
    for name in ("student_chunk_id", "teacher_chunk_id", "num_chunks"):
        assert getattr(batch, name).dtype == torch.int64
    again = AlignmentBatch.from_flat_dict({**flat, "input_ids": torch.zeros(1)})
    for name in ALIGNMENT_FIELDS:
        assert torch.equal(getattr(again, name), getattr(batch, name))
    with pytest.raises(ValueError, match="alignment_num_chunks"):
        AlignmentBatch.from_flat_dict(
            {k: v for k, v in flat.items() if k != "alignment_num_chunks"}
        )


def test_empty_batch_entries_keep_max_pairs_at_least_one():
    _, _, batch = ALIGNER.align_texts(["", ""], load_tokenizer("qwen3"), load_tokenizer("deepseek"))
    assert batch.max_pairs == 1 and batch.num_chunks.tolist() == [0, 0]
    batch.validate()


def test_sample_flat_dict_is_jagged_with_contract_dtypes():
    sample, student, teacher = align_pair("Hello there", "qwen3", "mistral")
    flat = sample.to_flat_dict()
    assert flat["alignment_student_chunk_id"].shape == (len(student),)
    assert flat["alignment_teacher_chunk_id"].shape == (len(teacher),)
    assert flat["alignment_pair_valid"].shape == (sample.num_chunks,)
    assert (
        flat["alignment_num_chunks"].dtype == torch.int64
        and flat["alignment_num_chunks"].dim() == 0
    )


def test_alignment_stats_counts_chunks_and_one_sided():
    _, _, batch = ALIGNER.align_texts(
        ["Hello world"], load_tokenizer("qwen3"), load_tokenizer("llama3")
    )
    stats = alignment_stats(batch)
    assert stats["one_sided"] == 1.0  # Llama's BOS has no partner
    assert stats["chunks"] == stats["valid_chunks"] + 1
    assert stats["one_to_one_fraction"] == 1.0  # "Hello", " world" are the same tokens


@st.composite
def two_tilings(draw):
    """Two random tilings of [0, L) (the teacher possibly truncated earlier)."""
    length = draw(st.integers(0, 40))
    inner = list(range(1, length))
    s_cuts = sorted(
        {0, length} | set(draw(st.lists(st.sampled_from(inner), max_size=20)) if inner else [])
    )
    t_cuts = sorted(
        {0, length} | set(draw(st.lists(st.sampled_from(inner), max_size=20)) if inner else [])
    )
    t_keep = draw(st.integers(1, max(1, len(t_cuts))))
    return s_cuts, t_cuts[:t_keep]


def _spans(cuts):
    return np.array([[a, b] for a, b in zip(cuts[:-1], cuts[1:])], dtype=np.int64).reshape(-1, 2)


@settings(max_examples=150, deadline=None)
@given(tilings=two_tilings())
def test_valid_chunk_boundaries_are_exactly_the_common_token_boundaries(tilings):
    s_cuts, t_cuts = tilings
    sample = ALIGNER.align_sample(_spans(s_cuts), _spans(t_cuts))
    end = min(s_cuts[-1], t_cuts[-1])
    common = sorted(set(s_cuts) & set(t_cuts) & set(range(end + 1)))
    s_spans = _spans(s_cuts)
    got = []
    for k in np.flatnonzero(sample.pair_valid):
        sp = s_spans[sample.student_chunk_id == k]
        got.append((int(sp[:, 0].min()), int(sp[:, 1].max())))
    assert got == list(zip(common[:-1], common[1:]))


@settings(max_examples=60, deadline=None)
@given(tilings=two_tilings(), offset=st.sampled_from([10**6, 10**12]))
def test_spans_at_far_byte_offsets_align_like_spans_at_zero(tilings, offset):
    # Far offsets take the binary-search path instead of marking the byte axis: same result.
    s_cuts, t_cuts = tilings
    near = ALIGNER.align_sample(_spans(s_cuts), _spans(t_cuts))
    far = ALIGNER.align_sample(_spans(s_cuts) + offset, _spans(t_cuts) + offset)
    assert far.num_chunks == near.num_chunks
    for name in ("pair_valid", "student_chunk_id", "teacher_chunk_id"):
        assert np.array_equal(getattr(far, name), getattr(near, name))
    assert np.array_equal(far.student_exact_partition_mask, near.student_exact_partition_mask)


@pytest.mark.parametrize(
    "s_spans,t_spans,side",
    [
        ([[-1, 2], [2, 4]], [[0, 4]], "student"),
        ([[-3, -1], [-1, 4]], [[-3, 4]], "student"),
        ([[-2, -2], [0, 4]], [[0, 4]], "student"),
        ([[0, 2], [2, 4]], [[-5, 4]], "teacher"),
        ([[0, 1]], [[-1, 0], [0, 1]], "teacher"),
    ],
)
def test_negative_span_starts_are_rejected_naming_the_side(s_spans, t_spans, side):
    with pytest.raises(ValueError, match=rf"{side}.*negative start"):
        ALIGNER.align_sample(np.array(s_spans), np.array(t_spans))


def test_negative_spans_of_masked_tokens_are_ignored():
    sample = ALIGNER.align_sample(
        np.array([[0, 2], [-1, -1]]), np.array([[0, 2]]), student_mask=[True, False]
    )
    assert sample.student_chunk_id.tolist() == [0, -1]
