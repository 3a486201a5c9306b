"""A collated sample's cached teacher targets as the top-K fields it carries
(``xtoken_core.data.sample.TOPK_FIELDS``): what a run that trains from a teacher cache puts
beside each sample's other fields.

The cache is keyed by the collator's sample key and holds the teacher ids the builder made of
the text (the teacher's tokenizer with its special tokens, cut at ``ctx_teacher``: the
collator's own tokenization); a sample whose teacher ids differ from the cached ones is refused,
so targets never meet the tokens of another tokenization. A sample the cache lacks is refused,
or, for a run whose live teacher serves what the cache lacks (``online``), carries zero targets
and ``teacher_topk_cached`` False (``xtoken_core.data.sample.TOPK_CACHED``).

Legend: U teacher tokens of the sample, K ids kept per position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from xtoken_core.data.sample import TOPK_CACHED, TOPK_FIELDS, teacher_field_name

if TYPE_CHECKING:
    from xtoken_core.wire.topk import TopK

__all__ = ["attach_targets", "cached_of_batch", "topk_of_batch"]


def attach_targets(
    sample: dict[str, torch.Tensor],
    key: str,
    reader: Any,
    teacher: int = 0,
    *,
    online: bool = False,
) -> dict[str, torch.Tensor]:
    """Add teacher ``teacher``'s cached top-K targets of sample ``key`` to ``sample``.

    Args:
        sample: a jagged sample (``CrossTokenizerCollator.collate_one``), changed in place.
        key: its sample key (the cache's key of the text).
        reader: a :class:`xtoken_core.cache.reader.CacheReader` of that teacher's cache.
        teacher: the teacher's index (0: ``teacher_topk_ids``; i: ``teacher{i}_topk_ids``).
        online: a sample the cache lacks gets zero targets and ``teacher_topk_cached`` False
            (the trainer asks the live teacher for it) instead of being refused.

    Returns:
        ``sample``, with ``[U, K]`` int32 ids, ``[U, K]`` float32 log-probs, ``[U]`` float32
        rest and log-partition, and the 0-d bool ``teacher_topk_cached``.

    Raises:
        KeyError: the cache does not hold ``key`` and ``online`` is off (names it and the
            cache).
        ValueError: the cached teacher ids differ from the sample's (names the key and where).
    """
    ids_U = sample[teacher_field_name("teacher_input_ids", teacher)]
    try:
        row = reader.get(key)
    except KeyError:
        if not online:
            raise KeyError(
                f"the teacher cache {reader.directory} lacks sample {key!r}: run `xtoken cache "
                "build` over this corpus into it (it writes only what is missing), or set "
                "data.teacher_cache_missing: online"
            ) from None
        U, K = int(ids_U.shape[0]), int(reader.k)
        for spec in TOPK_FIELDS:
            shape = (U, K) if spec.inner else (U,)
            sample[teacher_field_name(spec.name, teacher)] = torch.zeros(shape, dtype=spec.dtype)
        sample[teacher_field_name(TOPK_CACHED.name, teacher)] = torch.tensor(False)
        return sample
    cached_U = torch.from_numpy(row.teacher_ids_U).to(ids_U.dtype)
    if cached_U.shape != ids_U.shape or not torch.equal(cached_U, ids_U):
        U, C = int(ids_U.shape[0]), int(cached_U.shape[0])
        at = next((i for i in range(min(U, C)) if int(cached_U[i]) != int(ids_U[i])), min(U, C))
        raise ValueError(
            f"sample {key!r}: the teacher cache {reader.directory} holds {C} teacher tokens, "
            f"the run's teacher {teacher} makes {U}, differing from token {at} on: a cache of "
            "another corpus file at this path, tokenizer or ctx_teacher; build the cache again"
        )
    values = (row.ids_UK, row.logprobs_UK, row.rest_U, row.lse_U)
    for spec, value in zip(TOPK_FIELDS, values, strict=True):
        sample[teacher_field_name(spec.name, teacher)] = torch.from_numpy(value).to(spec.dtype)
    sample[teacher_field_name(TOPK_CACHED.name, teacher)] = torch.tensor(True)
    return sample


def topk_of_batch(batch: Mapping[str, torch.Tensor], teacher: int = 0) -> TopK:
    """The ``topk`` transport's targets of teacher ``teacher`` in a padded batch: ``[B, U, K]``
    ids, ``[B, U, K]`` log-probs, ``[B, U]`` rest and log-partition (an
    ``xtoken_core.wire.topk.TopK`` of them decodes to ``[B, U, W]`` logits).

    Args:
        batch: ``xtoken_core.data.sample.pad_samples`` of samples that carry the targets.
        teacher: the teacher's index.

    Raises:
        KeyError: the batch carries no cached targets of that teacher.
    """
    from xtoken_core.wire.topk import TopK

    return TopK(*(batch[teacher_field_name(f.name, teacher)] for f in TOPK_FIELDS))


def cached_of_batch(batch: Mapping[str, torch.Tensor], teacher: int = 0) -> torch.Tensor:
    """``[B]`` bool: which samples of a padded batch carry teacher ``teacher``'s targets from its
    cache (False: the cache lacked the sample; its targets are zeros, not to be read).

    Args:
        batch: ``xtoken_core.data.sample.pad_samples`` of samples that carry the targets.
        teacher: the teacher's index.

    Raises:
        KeyError: the batch carries no cached targets of that teacher.
    """
    return batch[teacher_field_name(TOPK_CACHED.name, teacher)]
