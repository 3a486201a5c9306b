"""The aligner's fast path for gap-free tilings gives the general path's outputs bit for bit."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.align import ALIGNMENT_FIELDS, TokenAligner, tiled
from xtoken_core.align import aligner as aligner_mod
from xtoken_core.tokenizers import ROLE_BOS, ROLE_CONTENT, ROLE_EOS, load_tokenizer

ALIGNER = TokenAligner()
ROLES = st.sampled_from([ROLE_CONTENT, ROLE_CONTENT, 1, 2, 3, 4])


@st.composite
def tiled_side(draw, length, first=0):
    """Spans tiling [first, length) with zero-width tokens (any role) before any token."""
    inner = list(range(first + 1, length))
    picks = draw(st.lists(st.sampled_from(inner), max_size=12)) if inner else []
    cuts = sorted({first, length} | set(picks))
    spans, roles = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        for role in draw(st.lists(ROLES, max_size=2)):
            spans.append([a, a])
            roles.append(role)
        spans.append([a, b])
        roles.append(ROLE_CONTENT)
    for role in draw(st.lists(ROLES, max_size=2)):  # trailing zero-width tokens (EOS, ...)
        spans.append([length, length])
        roles.append(role)
    return np.array(spans, np.int64).reshape(-1, 2), np.array(roles, np.int8)


@st.composite
def tiled_pairs(draw):
    """Two tilings of one text, the student truncated (keeping some content), both right-padded."""
    length = draw(st.integers(1, 30))
    s_spans, s_roles = draw(tiled_side(length))
    t_spans, t_roles = draw(tiled_side(draw(st.integers(1, length))))
    first_content = int(np.flatnonzero(s_spans[:, 1] > s_spans[:, 0])[0])
    s_keep = draw(st.integers(first_content + 1, len(s_spans)))
    s_pad, t_pad = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    return s_spans[:s_keep], s_roles[:s_keep], t_spans, t_roles, s_pad, t_pad


def general_path(s_spans, t_spans, s_mask, t_mask, s_roles, t_roles):
    """The general path only (``_align`` over ``_Side``), bypassing the fast path."""
    return aligner_mod._align(
        aligner_mod._Side(s_spans, s_mask, s_roles, "student"),
        aligner_mod._Side(t_spans, t_mask, t_roles, "teacher"),
    )


def assert_same(fast, slow):
    for name in ALIGNMENT_FIELDS:
        a, b = getattr(fast, name), getattr(slow, name)
        assert type(a) is type(b), name
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a, b), f"{name}: fast {a} != general {b}"


def padded(spans, roles, pad):
    """Right-pad with garbage spans (masked off), as a batch row would be."""
    n = len(spans)
    spans = np.concatenate([spans, np.full((pad, 2), 7, np.int64)])
    roles = np.concatenate([roles, np.zeros(pad, np.int8)])
    return spans, roles, np.arange(n + pad) < n


@settings(max_examples=300, deadline=None)
@given(pair=tiled_pairs(), with_roles=st.booleans())
def test_fast_path_matches_general_path_on_random_tilings(pair, with_roles):
    s_spans, s_roles, t_spans, t_roles, s_pad, t_pad = pair
    s_spans, s_roles, s_mask = padded(s_spans, s_roles, s_pad)
    t_spans, t_roles, t_mask = padded(t_spans, t_roles, t_pad)
    if not with_roles:
        s_roles, t_roles = np.zeros_like(s_roles), np.zeros_like(t_roles)
    s_fast = tiled.tiled_side(s_spans, s_mask, s_roles if with_roles else None)
    t_fast = tiled.tiled_side(t_spans, t_mask, t_roles if with_roles else None)
    assert s_fast is not None and t_fast is not None, "a gap-free tiling takes the fast path"
    got = ALIGNER.align_sample(
        s_spans,
        t_spans,
        s_mask,
        t_mask,
        s_roles if with_roles else None,
        t_roles if with_roles else None,
    )
    assert_same(got, general_path(s_spans, t_spans, s_mask, t_mask, s_roles, t_roles))


@pytest.mark.parametrize(
    "s_name,t_name", [("qwen3", "mistral"), ("mistral", "llama3"), ("llama3", "deepseek")]
)
@pytest.mark.parametrize("caps", [(None, None), (40, 55), (55, 40)])
def test_fast_path_matches_general_path_on_real_tokenizers(s_name, t_name, caps):
    text = "  Hello wörld!\n\tdef f(x):  return x**2  # 你好 🇺🇸 e\u0301\n" * 4
    student = load_tokenizer(s_name).encode(text).truncated(caps[0])
    teacher = load_tokenizer(t_name).encode(text).truncated(caps[1])
    s = tiled.tiled_side(student.spans, None, student.roles)
    t = tiled.tiled_side(teacher.spans, None, teacher.roles)
    fast = tiled.align_tiled(s, t)
    assert fast is not None, "real tokenizer output takes the fast path"
    ones_s, ones_t = np.ones(len(student), bool), np.ones(len(teacher), bool)
    slow = general_path(student.spans, teacher.spans, ones_s, ones_t, student.roles, teacher.roles)
    assert_same(fast, slow)


def test_straddling_region_is_invalid_and_the_tail_is_one_sided():
    # Student "abcdef" as ab|cdef, teacher truncated after "abc" as a|bc: E = 3 is inside
    # the student's "cdef"; no tail beyond it on the student side.
    sample = ALIGNER.align_sample(np.array([[0, 2], [2, 6]]), np.array([[0, 1], [1, 3]]))
    assert sample.pair_valid.tolist() == [False]
    assert sample.student_chunk_id.tolist() == [0, 0]
    assert sample.teacher_chunk_id.tolist() == [0, 0]
    # Student "ab|cd|ef", teacher "a|b": chunk [0, 2) is valid, the rest is the one-sided tail.
    sample = ALIGNER.align_sample(np.array([[0, 2], [2, 4], [4, 6]]), np.array([[0, 1], [1, 2]]))
    assert sample.pair_valid.tolist() == [True, False]
    assert sample.student_chunk_id.tolist() == [0, -1, -1]
    assert sample.teacher_chunk_id.tolist() == [0, 0]


def test_specials_at_the_start_and_end_take_their_own_chunk_slots():
    # Student: BOS, "ab", EOS; teacher: BOS, "a", "b" (no EOS): BOS pairs, EOS is one-sided.
    sample = ALIGNER.align_sample(
        np.array([[0, 0], [0, 2], [2, 2]]),
        np.array([[0, 0], [0, 1], [1, 2]]),
        student_roles=[ROLE_BOS, ROLE_CONTENT, ROLE_EOS],
        teacher_roles=[ROLE_BOS, ROLE_CONTENT, ROLE_CONTENT],
    )
    assert sample.student_chunk_id.tolist() == [0, 1, -1]
    assert sample.teacher_chunk_id.tolist() == [0, 1, 1]
    assert sample.pair_valid.tolist() == [True, True, False]
    assert not sample.student_exact_partition_mask.any()
