"""The alignment as the loss reads it: the next-token shift, chunk sizes and means, validity."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.losses.alignment import (
    chunk_mean_scatter,
    chunk_sizes,
    chunk_validity,
    shift_chunk_ids,
    valid_chunk_mask,
)
from xtoken_core.losses.backends import reference


def test_shift_moves_each_chunk_id_one_position_left_and_ends_with_minus_one():
    chunk_id = torch.tensor([[0, 0, 1, 2, -1], [3, 4, 4, 4, 5]])
    assert shift_chunk_ids(chunk_id).tolist() == [[0, 1, 2, -1, -1], [4, 4, 4, 5, -1]]


def test_chunk_average_is_the_mean_over_the_chunk_positions():
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [7.0, 7.0]]])
    chunk_id = torch.tensor([[0, 0, -1, 2]])
    avg, sizes = reference.chunk_average_log_probs(x, chunk_id, 3)
    assert avg.tolist() == [[[2.0, 3.0], [0.0, 0.0], [7.0, 7.0]]]
    assert sizes.tolist() == [[2.0, 0.0, 1.0]]
    assert chunk_sizes(chunk_id, 3).tolist() == [[2.0, 0.0, 1.0]]


def test_scatter_chunk_mean_equals_the_one_hot_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    chunk_id = torch.randint(-1, 4, (2, 9), generator=g)
    expected, _ = reference.chunk_average_log_probs(x, chunk_id, 4)
    torch.testing.assert_close(chunk_mean_scatter(x, chunk_id, 4), expected)


def test_valid_chunk_needs_both_sides_non_empty_and_pair_valid():
    s_sizes = torch.tensor([[1.0, 0.0, 2.0, 1.0]])
    t_sizes = torch.tensor([[1.0, 1.0, 0.0, 3.0]])
    pair_valid = torch.tensor([[True, True, True, False]])
    assert valid_chunk_mask(s_sizes, t_sizes, pair_valid).tolist() == [[True, False, False, False]]


def test_chunk_validity_drops_masked_samples_and_incorrect_pairs_on_request():
    ids = torch.tensor([[0, 0, 1, 2], [0, 1, 1, 2]])  # shifted ids
    pair_valid = torch.ones(2, 3, dtype=torch.bool)
    is_correct = torch.tensor([[True, False, True], [True, True, True]])
    sample_mask = torch.tensor([1, 0])
    valid = chunk_validity(ids, ids, pair_valid, sample_mask_B=sample_mask)
    assert valid.tolist() == [[True, True, True], [False, False, False]]
    exact = chunk_validity(
        ids, ids, pair_valid, pair_is_correct_BC=is_correct, exact_token_match_only=True
    )
    assert exact.tolist() == [[True, False, True], [True, True, True]]
    with pytest.raises(ValueError, match="pair_is_correct"):
        chunk_validity(ids, ids, pair_valid, exact_token_match_only=True)


def test_a_teacher_with_alignment_keys_of_its_own_reads_only_them_and_needs_them_all():
    from xtoken_core.losses.alignment import alignment_from_batch

    def fields(prefix: str, chunk: int) -> dict:
        return {
            f"{prefix}pair_valid": torch.ones(1, 2, dtype=torch.bool),
            f"{prefix}student_chunk_id": torch.full((1, 3), chunk),
            f"{prefix}teacher_chunk_id": torch.full((1, 4), chunk),
        }

    batch = {**fields("alignment_", 0), **fields("teacher1_alignment_", 1)}
    assert alignment_from_batch(batch, 0).student_chunk_id.unique().tolist() == [0]
    assert alignment_from_batch(batch, 1).student_chunk_id.unique().tolist() == [1]
    del batch["teacher1_alignment_teacher_chunk_id"]  # never teacher 0's in its place
    with pytest.raises(ValueError, match=r"lacks \['teacher1_alignment_teacher_chunk_id'\]"):
        alignment_from_batch(batch, 1)
