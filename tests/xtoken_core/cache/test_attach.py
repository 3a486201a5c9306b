"""A collated sample's cached targets (``attach_targets``): a sample the cache holds carries its
targets marked cached; one it lacks is refused, or with ``online`` carries zero targets of its
own length marked not cached, and travels in a padded batch beside cached ones."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from xtoken_core.cache.attach import attach_targets, cached_of_batch, topk_of_batch
from xtoken_core.data.sample import pad_samples, validate_sample

K = 3


class _Reader:
    """A cache of the keys of ``rows`` (key -> teacher ids), K = 3."""

    def __init__(self, rows: dict[str, list[int]]) -> None:
        self.directory, self.k, self.rows = "/cache", K, rows

    def get(self, key: str):
        ids = np.asarray(self.rows[key], dtype=np.int32)  # KeyError: not cached
        U = len(ids)
        return types.SimpleNamespace(
            teacher_ids_U=ids,
            ids_UK=np.tile(np.arange(K, dtype=np.int32), (U, 1)),
            logprobs_UK=np.full((U, K), -1.0, dtype=np.float32),
            rest_U=np.full(U, -2.0, dtype=np.float32),
            lse_U=np.full(U, 5.0, dtype=np.float32),
        )


def _sample(teacher_ids: list[int]) -> dict[str, torch.Tensor]:
    """A one-teacher jagged sample of two student tokens and ``teacher_ids``."""
    U = len(teacher_ids)
    return {
        "input_ids": torch.tensor([1, 2]),
        "input_lengths": torch.tensor(2),
        "token_mask": torch.ones(2, dtype=torch.bool),
        "sample_mask": torch.tensor(1.0),
        "teacher_input_ids": torch.tensor(teacher_ids),
        "teacher_input_lengths": torch.tensor(U),
        "teacher_token_mask": torch.ones(U, dtype=torch.bool),
        "alignment_pair_valid": torch.ones(1, dtype=torch.bool),
        "alignment_pair_is_correct": torch.ones(1, dtype=torch.bool),
        "alignment_student_exact_partition_mask": torch.ones(2, dtype=torch.bool),
        "alignment_teacher_exact_partition_mask": torch.ones(U, dtype=torch.bool),
        "alignment_student_chunk_id": torch.zeros(2, dtype=torch.int64),
        "alignment_teacher_chunk_id": torch.zeros(U, dtype=torch.int64),
        "alignment_num_chunks": torch.tensor(1),
    }


def test_a_cached_sample_carries_its_targets_marked_cached():
    sample = attach_targets(_sample([7, 8, 9]), "a", _Reader({"a": [7, 8, 9]}))
    validate_sample(sample)
    assert sample["teacher_topk_cached"].item() is True
    assert sample["teacher_topk_ids"].shape == (3, K)
    assert torch.equal(sample["teacher_topk_lse"], torch.full((3,), 5.0))


def test_a_sample_the_cache_lacks_is_refused_unless_online():
    with pytest.raises(KeyError, match=r"lacks sample 'b'.* data.teacher_cache_missing: online"):
        attach_targets(_sample([4, 5]), "b", _Reader({}))


def test_online_a_sample_the_cache_lacks_carries_zero_targets_marked_not_cached():
    sample = attach_targets(_sample([4, 5]), "b", _Reader({}), online=True)
    validate_sample(sample)
    assert sample["teacher_topk_cached"].item() is False
    assert sample["teacher_topk_ids"].shape == (2, K) and not sample["teacher_topk_ids"].any()
    assert sample["teacher_topk_logprobs"].shape == (2, K)
    assert sample["teacher_topk_rest"].shape == (2,) and sample["teacher_topk_lse"].shape == (2,)


def test_a_batch_of_cached_and_missing_samples_pads_and_says_which_rows_are_cached():
    reader = _Reader({"a": [7, 8, 9], "c": [3]})
    samples = [
        attach_targets(_sample(ids), key, reader, online=True)
        for key, ids in (("a", [7, 8, 9]), ("b", [4, 5]), ("c", [3]))
    ]
    batch = pad_samples(samples, student_pad_id=0, teacher_pad_id=0)
    assert cached_of_batch(batch).tolist() == [True, False, True]
    targets = topk_of_batch(batch)
    assert targets.ids_NK.shape == (3, 3, K)
    assert torch.equal(targets.lse_N[0], torch.full((3,), 5.0))
