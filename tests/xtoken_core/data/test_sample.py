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


def _two_teacher_sample(t, u0, c0, u1, c1):
    """A sample of two teachers: teacher 1's fields built like teacher 0's with its own U and C,
    ids from 500 and chunk ids reversed so no field equals teacher 0's by accident."""
    sample = _sample(t, u0, c0)
    other = _sample(t, u1, c1)
    other["teacher_input_ids"] = torch.arange(500, 500 + u1, dtype=torch.int64)
    other["alignment_student_chunk_id"] = other["alignment_student_chunk_id"].flip(0)
    for spec in S.teacher_fields(0):
        sample[S.teacher_field_name(spec.name, 1)] = other[spec.name]
    return sample


def test_teacher_field_names_follow_the_losses_per_teacher_keys():
    names = S.field_names(2)
    assert names[: len(S.FIELD_NAMES)] == S.FIELD_NAMES
    assert names[len(S.FIELD_NAMES) :] == (
        "teacher1_input_ids",
        "teacher1_input_lengths",
        "teacher1_token_mask",
        "teacher1_alignment_pair_valid",
        "teacher1_alignment_pair_is_correct",
        "teacher1_alignment_student_exact_partition_mask",
        "teacher1_alignment_teacher_exact_partition_mask",
        "teacher1_alignment_student_chunk_id",
        "teacher1_alignment_teacher_chunk_id",
        "teacher1_alignment_num_chunks",
    )
    assert S.field_names(1, packed=True) == S.FIELD_NAMES + S.PACKED_FIELD_NAMES
    assert S.field_names(3, packed=True)[-1] == "teacher2_position_ids"
    spec = {f.name: f for f in S.sample_fields(2)}
    assert spec["teacher1_input_ids"].axis == "teacher1_token"
    assert spec["teacher1_input_ids"].pad == "teacher1_pad_id"
    assert spec["teacher1_alignment_pair_valid"].axis == "teacher1_chunk"
    assert spec["teacher1_alignment_student_chunk_id"].axis == S.STUDENT_TOKEN
    assert S.fields_on_axis("teacher1_token", 2) == (
        "teacher1_input_ids",
        "teacher1_token_mask",
        "teacher1_alignment_teacher_exact_partition_mask",
        "teacher1_alignment_teacher_chunk_id",
        "teacher1_position_ids",
    )
    with pytest.raises(ValueError, match="'input_ids' is not a per-teacher field"):
        S.teacher_field_name("input_ids", 1)
    with pytest.raises(ValueError, match="num_teachers must be an int >= 1, got 0"):
        S.sample_fields(0)


def test_num_teachers_counts_only_per_teacher_field_names():
    assert S.num_teachers_of(_sample(2, 2, 1)) == 1
    assert S.num_teachers_of(_two_teacher_sample(2, 2, 1, 3, 1)) == 2
    assert S.num_teachers_of({**_sample(2, 2, 1), "teacher2_token_mask": torch.ones(1)}) == 3
    assert S.num_teachers_of({**_sample(2, 2, 1), "teacher1_prompt_length": torch.ones(1)}) == 1


def test_padding_two_teacher_samples_gives_each_teacher_its_own_widths_and_pads():
    samples = [_two_teacher_sample(5, 2, 2, 9, 4), _two_teacher_sample(3, 7, 1, 1, 1)]
    batch = S.pad_samples(
        samples,
        student_pad_id=3,
        teacher_pad_id=(4, 11),
        make_seq_div_by_student=4,
        make_seq_div_by_teacher=(3, 5),
    )
    assert tuple(batch) == S.field_names(2)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["teacher_input_ids"].shape == (2, 9)  # 7 -> multiple of 3
    assert batch["teacher1_input_ids"].shape == (2, 10)  # 9 -> multiple of 5
    assert batch["alignment_pair_valid"].shape == (2, 2)
    assert batch["teacher1_alignment_pair_valid"].shape == (2, 4)
    assert batch["teacher1_alignment_student_chunk_id"].shape == (2, 8)
    assert batch["teacher1_input_ids"][1].tolist() == [500] + [11] * 9
    assert batch["teacher_input_ids"][0].tolist() == [100, 101] + [4] * 7
    assert batch["teacher1_alignment_teacher_chunk_id"][1].tolist() == [0] + [-1] * 9
    assert batch["teacher1_input_lengths"].tolist() == [9, 1]
    one = S.pad_samples(
        [{k: s[k] for k in S.FIELD_NAMES} for s in samples],
        student_pad_id=3,
        teacher_pad_id=4,
        make_seq_div_by_student=4,
        make_seq_div_by_teacher=3,
    )
    for name, value in one.items():
        assert torch.equal(batch[name], value), name
    # one divisor for every teacher
    same = S.pad_samples(samples, student_pad_id=3, teacher_pad_id=(4, 11))
    assert same["teacher1_input_ids"].shape == (2, 9)


def test_validation_names_the_missing_field_of_a_teacher():
    good = _two_teacher_sample(3, 2, 2, 4, 3)
    S.validate_sample(good)
    S.validate_sample(good, 2)
    broken = {k: v for k, v in good.items() if k != "teacher1_token_mask"}
    with pytest.raises(ValueError, match=r"lacks fields \['teacher1_token_mask'\]"):
        S.validate_sample(broken)
    with pytest.raises(ValueError, match=r"lacks fields \['teacher1_input_ids', "):
        S.validate_sample(_sample(3, 2, 2), 2)
    with pytest.raises(ValueError, match="fields of teacher 1 but 1 teacher"):
        S.validate_sample(good, 1)
    with pytest.raises(ValueError, match="'teacher1_alignment_teacher_chunk_id' has 3 entries"):
        S.validate_sample(
            {**good, "teacher1_alignment_teacher_chunk_id": torch.zeros(3, dtype=torch.int64)}
        )
    with pytest.raises(ValueError, match="'teacher1_alignment_pair_valid' has 2 entries"):
        S.validate_sample(
            {**good, "teacher1_alignment_pair_valid": torch.ones(2, dtype=torch.bool)}
        )
    packed = {**good, "position_ids": torch.zeros(3, dtype=torch.int32)}
    packed["teacher_position_ids"] = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lacks fields \['teacher1_position_ids'\]"):
        S.validate_sample(packed)


def test_padding_several_teachers_needs_their_pad_ids_and_divisors_per_teacher():
    samples = [_two_teacher_sample(3, 2, 2, 4, 3)]
    with pytest.raises(ValueError, match="carry 2 teachers but teacher_pad_id is one int"):
        S.pad_samples(samples, student_pad_id=0, teacher_pad_id=0)
    with pytest.raises(ValueError, match=r"lacks fields \['teacher2_input_ids'"):
        S.pad_samples(samples, student_pad_id=0, teacher_pad_id=(0, 1, 2))
    with pytest.raises(ValueError, match="make_seq_div_by_teacher has 3 entries for 2 teachers"):
        S.pad_samples(
            samples, student_pad_id=0, teacher_pad_id=(0, 1), make_seq_div_by_teacher=(1, 2, 3)
        )
    with pytest.raises(ValueError, match="make_seq_div_by_teacher must be >= 1, got 0"):
        S.pad_samples(
            samples, student_pad_id=0, teacher_pad_id=(0, 1), make_seq_div_by_teacher=(1, 0)
        )
    mixed = [samples[0], _sample(3, 2, 2)]
    with pytest.raises(ValueError, match=r"lacks fields \['teacher1_input_ids'"):
        S.pad_samples(mixed, student_pad_id=0, teacher_pad_id=(0, 1))
    pads = S.pad_values(student_pad_id=1, teacher_pad_id=[2, 3])
    assert pads["teacher_input_ids"] == 2 and pads["teacher1_input_ids"] == 3
    assert pads["teacher1_position_ids"] == 0 and "teacher1_input_lengths" not in pads
