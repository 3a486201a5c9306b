"""pad_batch: claimed jagged fields padded with the schema's pad values, equal to pad_samples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.data import sample as schema
from xtoken_core.data.batch import pad_batch
from xtoken_core.data.sample import pad_samples
from xtoken_core.wire import JaggedColumn


def make_sample(t: int, u: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    """A jagged sample of the schema with random values; some tokens belong to no chunk."""
    g = torch.Generator().manual_seed(seed)

    def chunk_ids(n: int) -> torch.Tensor:
        if c == 0:
            return torch.full((n,), -1, dtype=torch.int64)
        ids = torch.randint(0, c, (n,), generator=g).sort().values
        return torch.where(torch.rand(n, generator=g) < 0.2, -1, ids)

    return {
        "input_ids": torch.randint(1, 500, (t,), generator=g),
        "input_lengths": torch.tensor(t),
        "token_mask": torch.ones(t, dtype=torch.bool),
        "sample_mask": torch.tensor(1.0 if t else 0.0),
        "teacher_input_ids": torch.randint(1, 500, (u,), generator=g),
        "teacher_input_lengths": torch.tensor(u),
        "teacher_token_mask": torch.ones(u, dtype=torch.bool),
        "alignment_pair_valid": torch.rand(c, generator=g) > 0.3,
        "alignment_pair_is_correct": torch.rand(c, generator=g) > 0.5,
        "alignment_student_exact_partition_mask": torch.rand(t, generator=g) > 0.5,
        "alignment_teacher_exact_partition_mask": torch.rand(u, generator=g) > 0.5,
        "alignment_student_chunk_id": chunk_ids(t),
        "alignment_teacher_chunk_id": chunk_ids(u),
        "alignment_num_chunks": torch.tensor(c),
    }


def columns(samples, layout: str = "column") -> dict:
    """The fields of a claim of ``samples``: jagged columns (or nested tensors), [B] stacks."""
    out = {}
    for spec in schema.SAMPLE_FIELDS:
        rows = [s[spec.name] for s in samples]
        if spec.axis == schema.SAMPLE:
            out[spec.name] = torch.stack(rows)
        elif layout == "nested":
            out[spec.name] = JaggedColumn.from_rows(rows).to_nested()
        else:
            out[spec.name] = JaggedColumn.from_rows(rows)
    return out


def assert_batches_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 5)), min_size=1, max_size=5
    ),
    div_s=st.integers(1, 4),
    div_t=st.integers(1, 3),
    layout=st.sampled_from(["column", "nested"]),
)
def test_pad_batch_equals_pad_samples_for_the_same_samples(shapes, div_s, div_t, layout):
    samples = [make_sample(t, u, c, i) for i, (t, u, c) in enumerate(shapes)]
    got = pad_batch(
        columns(samples, layout),
        student_pad_id=7,
        teacher_pad_id=9,
        make_seq_div_by_student=div_s,
        make_seq_div_by_teacher=div_t,
    )
    want = pad_samples(
        samples,
        student_pad_id=7,
        teacher_pad_id=9,
        make_seq_div_by_student=div_s,
        make_seq_div_by_teacher=div_t,
    )
    assert_batches_equal(got, want)


def test_chunk_ids_pad_with_minus_one_masks_with_false_and_ids_with_the_pad_ids():
    samples = [make_sample(2, 1, 1, 0), make_sample(5, 4, 3, 1)]
    got = pad_batch(columns(samples), student_pad_id=7, teacher_pad_id=9)
    assert got["alignment_student_chunk_id"][0, 2:].tolist() == [-1, -1, -1]
    assert got["alignment_teacher_chunk_id"][0, 1:].tolist() == [-1, -1, -1]
    assert got["input_ids"][0, 2:].tolist() == [7, 7, 7]
    assert got["teacher_input_ids"][0, 1:].tolist() == [9, 9, 9]
    assert not got["token_mask"][0, 2:].any() and not got["alignment_pair_valid"][0, 1:].any()


def test_dense_columns_of_equal_rows_pad_to_the_axis_width_like_jagged_ones():
    samples = [make_sample(3, 3, 2, 0), make_sample(3, 3, 2, 1)]
    fields = columns(samples)
    dense = {
        spec.name: torch.stack([s[spec.name] for s in samples]) for spec in schema.SAMPLE_FIELDS
    }  # equal rows: what a claim may return as [B, L]
    kw = dict(student_pad_id=1, teacher_pad_id=2, make_seq_div_by_student=4)
    assert_batches_equal(pad_batch(dense, **kw), pad_batch(fields, **kw))
    assert pad_batch(dense, **kw)["input_ids"].shape == (2, 4)


def test_names_select_fields_and_widths_still_follow_the_whole_axis():
    samples = [make_sample(2, 6, 1, 0), make_sample(4, 2, 3, 1)]
    fields = columns(samples)
    got = pad_batch(
        fields, student_pad_id=0, teacher_pad_id=0, names=["alignment_teacher_chunk_id"]
    )
    assert list(got) == ["alignment_teacher_chunk_id"]
    assert got["alignment_teacher_chunk_id"].shape == (2, 6)


def test_fields_outside_the_schema_pad_with_zero_or_their_given_value():
    samples = [make_sample(2, 2, 1, 0), make_sample(3, 1, 1, 1)]
    fields = columns(samples)
    fields["hidden"] = JaggedColumn.from_rows([torch.ones(1, 4), torch.ones(3, 4)])
    fields["handle"] = torch.tensor([5, 6])
    got = pad_batch(fields, student_pad_id=0, teacher_pad_id=0)
    assert got["hidden"].shape == (2, 3, 4) and got["hidden"][0, 1:].eq(0).all()
    assert got["handle"] is fields["handle"]
    custom = pad_batch(
        fields,
        student_pad_id=0,
        teacher_pad_id=0,
        pad_values={"hidden": -2.0, "alignment_student_chunk_id": -5},
    )
    assert custom["hidden"][0, 1:].eq(-2).all()
    assert custom["alignment_student_chunk_id"][0, 2] == -5


def test_a_second_teachers_alignment_pads_like_the_first_chunk_ids_with_minus_one():
    samples = [make_sample(2, 2, 1, 0), make_sample(3, 1, 1, 1)]
    fields = columns(samples)
    fields["teacher1_alignment_teacher_chunk_id"] = JaggedColumn.from_rows(
        [torch.tensor([0, 0, 1]), torch.tensor([0])]
    )
    fields["teacher1_alignment_teacher_exact_partition_mask"] = JaggedColumn.from_rows(
        [torch.ones(3, dtype=torch.bool), torch.ones(1, dtype=torch.bool)]
    )
    got = pad_batch(fields, student_pad_id=7, teacher_pad_id=7)
    assert got["teacher1_alignment_teacher_chunk_id"][1].tolist() == [0, -1, -1]
    assert got["teacher1_alignment_teacher_exact_partition_mask"][1].tolist() == [
        True,
        False,
        False,
    ]
    assert schema.default_pad("teacher2_alignment_student_chunk_id") == -1
    assert schema.default_pad("teacher_input_ids") == 0  # a schema field, not per teacher


def test_rows_that_disagree_with_their_length_field_are_refused_naming_both():
    samples = [make_sample(2, 2, 1, 0), make_sample(3, 1, 1, 1)]
    fields = columns(samples)
    fields["token_mask"] = JaggedColumn.from_rows([torch.ones(3, dtype=torch.bool)] * 2)
    with pytest.raises(ValueError, match=r"'token_mask'.*\[3, 3\].*'input_lengths'.*\[2, 3\]"):
        pad_batch(fields, student_pad_id=0, teacher_pad_id=0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"alignment_student_chunk_id": JaggedColumn.from_rows([torch.zeros(2), torch.zeros(3)])},
         "expected torch.int64, got torch.float32"),
        ({"input_lengths": torch.tensor([2, 3, 4])}, "3 rows but 'input_ids' has 2"),
        ({"sample_mask": JaggedColumn.from_rows([torch.ones(1), torch.ones(1)])},
         "per-sample"),
        ({"scalar": torch.tensor(1.0)}, "0-d tensor"),
    ],
)  # fmt: skip
def test_malformed_batches_are_refused_naming_the_field(change, match):
    fields = {**columns([make_sample(2, 2, 1, 0), make_sample(3, 1, 1, 1)]), **change}
    with pytest.raises(ValueError, match=match):
        pad_batch(fields, student_pad_id=0, teacher_pad_id=0)


def test_unknown_names_and_bad_divisors_are_refused():
    fields = columns([make_sample(2, 2, 1, 0)])
    with pytest.raises(ValueError, match="no field \\['logits'\\]"):
        pad_batch(fields, student_pad_id=0, teacher_pad_id=0, names=["logits"])
    with pytest.raises(ValueError, match="make_seq_div_by_teacher must be >= 1"):
        pad_batch(fields, student_pad_id=0, teacher_pad_id=0, make_seq_div_by_teacher=0)
