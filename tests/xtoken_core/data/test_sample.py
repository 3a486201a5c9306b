"""Sample schema: field table, pad values, validation and padded materialization."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.data import sample as S


def _sample(t, u, c, *, start=0):
    return {
        "input_ids": torch.arange(start, start + t, dtype=torch.int64),
        "input_lengths": torch.tensor(t),
        "token_mask": torch.ones(t, dtype=torch.bool),
        "sample_mask": torch.tensor(1.0 if t else 0.0),
        "teacher_input_ids": torch.arange(100, 100 + u, dtype=torch.int64),
        "teacher_input_lengths": torch.tensor(u),
        "teacher_token_mask": torch.ones(u, dtype=torch.bool),
        "alignment_pair_valid": torch.ones(c, dtype=torch.bool),
        "alignment_pair_is_correct": torch.ones(c, dtype=torch.bool),
        "alignment_student_exact_partition_mask": torch.ones(t, dtype=torch.bool),
        "alignment_teacher_exact_partition_mask": torch.ones(u, dtype=torch.bool),
        "alignment_student_chunk_id": torch.arange(t, dtype=torch.int64).clamp(max=max(c - 1, 0)),
        "alignment_teacher_chunk_id": torch.arange(u, dtype=torch.int64).clamp(max=max(c - 1, 0)),
        "alignment_num_chunks": torch.tensor(c),
    }


def test_schema_covers_every_alignment_field_and_each_axis_has_a_length_field():
    alignment = {n for n in S.FIELD_NAMES if n.startswith(S.ALIGNMENT_PREFIX)}
    assert alignment == {
        "alignment_" + f
        for f in (
            "pair_valid",
            "pair_is_correct",
            "student_exact_partition_mask",
            "teacher_exact_partition_mask",
            "student_chunk_id",
            "teacher_chunk_id",
            "num_chunks",
        )
    }
    for axis, length_field in S.LENGTH_FIELD.items():
        assert S.FIELDS_BY_NAME[length_field].axis == S.SAMPLE
        assert S.fields_on_axis(axis)
    with pytest.raises(ValueError, match="unknown axis"):
        S.fields_on_axis("vocab")


def test_pad_values_resolve_the_tokenizer_pad_ids():
    pads = S.pad_values(student_pad_id=7, teacher_pad_id=9)
    assert pads["input_ids"] == 7 and pads["teacher_input_ids"] == 9
    assert pads["alignment_student_chunk_id"] == -1 and pads["token_mask"] is False
    assert "input_lengths" not in pads


def test_round_up_never_returns_zero():
    assert [S.round_up(n, 3) for n in (0, 1, 3, 4)] == [3, 3, 3, 6]
    assert S.round_up(0, 1) == 1


def test_pad_samples_pads_right_to_multiples_with_schema_pad_values():
    batch = S.pad_samples(
        [_sample(5, 2, 2), _sample(0, 0, 0), _sample(1, 7, 1, start=50)],
        student_pad_id=3,
        teacher_pad_id=4,
        make_seq_div_by_student=4,
        make_seq_div_by_teacher=3,
    )
    assert batch["input_ids"].shape == (3, 8) and batch["teacher_input_ids"].shape == (3, 9)
    assert batch["alignment_pair_valid"].shape == (3, 2)
    assert batch["input_ids"][0].tolist() == [0, 1, 2, 3, 4, 3, 3, 3]
    assert batch["input_ids"][1].tolist() == [3] * 8
    assert batch["teacher_input_ids"][2].tolist() == list(range(100, 107)) + [4, 4]
    assert batch["alignment_student_chunk_id"][1].tolist() == [-1] * 8
    assert batch["token_mask"].sum(1).tolist() == [5, 0, 1]
    assert batch["sample_mask"].tolist() == [1.0, 0.0, 1.0]
    assert batch["input_lengths"].tolist() == [5, 0, 1]
    for spec in S.SAMPLE_FIELDS:
        assert batch[spec.name].dtype == spec.dtype


def test_all_empty_batch_still_has_width_one():
    batch = S.pad_samples([_sample(0, 0, 0)], student_pad_id=0, teacher_pad_id=0)
    assert batch["input_ids"].shape == (1, 1) and batch["alignment_pair_valid"].shape == (1, 1)
    assert not batch["token_mask"].any()


def test_validate_sample_names_the_bad_field():
    good = _sample(3, 2, 2)
    S.validate_sample(good)
    with pytest.raises(ValueError, match="lacks fields"):
        S.validate_sample({k: v for k, v in good.items() if k != "token_mask"})
    with pytest.raises(ValueError, match="'input_ids': expected a torch.int64"):
        S.validate_sample({**good, "input_ids": good["input_ids"].int()})
    with pytest.raises(ValueError, match="'alignment_teacher_chunk_id' has 3 entries"):
        S.validate_sample({**good, "alignment_teacher_chunk_id": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="expected 0-d"):
        S.validate_sample({**good, "input_lengths": torch.tensor([3])})


def test_pad_samples_rejects_empty_input_and_bad_divisors():
    with pytest.raises(ValueError, match="at least one sample"):
        S.pad_samples([], student_pad_id=0, teacher_pad_id=0)
    with pytest.raises(ValueError, match="make_seq_div_by_teacher must be >= 1"):
        S.pad_samples(
            [_sample(1, 1, 1)], student_pad_id=0, teacher_pad_id=0, make_seq_div_by_teacher=0
        )


def _random_sample(t, u, c, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        **_sample(t, u, c),
        "input_ids": torch.randint(0, 1 << 40, (t,), generator=g),
        "alignment_pair_valid": torch.rand(c, generator=g) > 0.3,
        "alignment_student_exact_partition_mask": torch.rand(t, generator=g) > 0.5,
        "alignment_teacher_chunk_id": torch.randint(-1, max(c, 1), (u,), generator=g),
    }


def _reference_pad(samples, pads, widths):
    """The obviously-correct padding: a rectangle of pad values, each row written into it."""
    batch = {}
    for spec in S.SAMPLE_FIELDS:
        rows = [s[spec.name] for s in samples]
        if spec.axis == S.SAMPLE:
            batch[spec.name] = torch.stack(rows)
            continue
        out = torch.full((len(rows), widths[spec.axis]), pads[spec.name], dtype=spec.dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        batch[spec.name] = out
    return batch


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.integers(0, 9) | st.integers(60, 300),
            st.integers(0, 9) | st.integers(60, 300),
            st.integers(0, 7),
        ),
        min_size=1,
        max_size=6,
    ),
    div_s=st.integers(1, 8),
    div_t=st.integers(1, 5),
    pad_ids=st.sampled_from([(0, 0), (3, 151_643), (-1, 2**53 + 1), (2**62 + 1, 7)]),
)
def test_pad_samples_is_bitwise_the_row_by_row_reference_on_odd_shapes(
    shapes, div_s, div_t, pad_ids
):
    """Odd lengths, empty rows, long rows, divisors, pad ids a float64 cannot hold."""
    samples = [_random_sample(t, u, c, i) for i, (t, u, c) in enumerate(shapes)]
    widths = {
        S.STUDENT_TOKEN: S.round_up(max(t for t, _, _ in shapes), div_s),
        S.TEACHER_TOKEN: S.round_up(max(u for _, u, _ in shapes), div_t),
        S.CHUNK: S.round_up(max(c for _, _, c in shapes), 1),
    }
    pads = S.pad_values(student_pad_id=pad_ids[0], teacher_pad_id=pad_ids[1])
    want = _reference_pad(samples, pads, widths)
    got = S.pad_samples(
        samples,
        student_pad_id=pad_ids[0],
        teacher_pad_id=pad_ids[1],
        make_seq_div_by_student=div_s,
        make_seq_div_by_teacher=div_t,
    )
    assert list(got) == list(S.FIELD_NAMES)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
