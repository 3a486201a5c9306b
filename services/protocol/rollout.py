"""The on-policy sample record: what a rollout worker puts and a trainer claims.

A rollout worker puts into ``<partition>.rollout`` (:func:`~services.protocol.names.
rollout_partition`) samples with every field of a collated sample
(``xtoken_core.data.sample.SAMPLE_FIELDS``: the student ids as sampled, the teacher ids of the
decoded text, the alignment) and the per-sample fields of :data:`ROLLOUT_FIELDS`. Keys are
``<pass>:<corpus key>`` of the prompt's text (``p0:<12 hex>/data.jsonl:17``): a worker restarted
after a crash makes the same keys again, so a sample is stored once (puts are idempotent, and a
consumed key is refused).

Trainers claim them under task :data:`~services.protocol.names.ROLLOUT_TASK`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Per-sample (0-d in a sample, [N] in a put) int64 fields of an on-policy sample:
ROLLOUT_FIELDS = (
    # the version of the weights that sampled it (the trainer's step when it published them)
    "policy_version",
    # student tokens of the prompt: the tokens from here on were sampled
    "prompt_lengths",
    # the first teacher token whose prediction counts as the continuation's (the ones before it
    # lie wholly in the prompt)
    "teacher_prompt_lengths",
    # bytes of the text the teacher tokens from teacher_prompt_lengths on cover
    "scored_bytes",
)


def rollout_values(
    *, policy_version: int, prompt_length: int, teacher_prompt_length: int, scored_bytes: int
) -> dict[str, torch.Tensor]:
    """The :data:`ROLLOUT_FIELDS` of one sample as 0-d int64 tensors.

    Args:
        policy_version: the version of the weights that sampled it.
        prompt_length: student tokens of the prompt.
        teacher_prompt_length: teacher tokens wholly in the prompt.
        scored_bytes: bytes covered by the teacher tokens after them.

    Returns:
        ``{field: 0-d tensor}``.
    """
    values = (policy_version, prompt_length, teacher_prompt_length, scored_bytes)
    return {
        name: torch.tensor(int(v), dtype=torch.int64) for name, v in zip(ROLLOUT_FIELDS, values)
    }


def is_rollout_sample(sample: Mapping[str, torch.Tensor]) -> bool:
    """Whether a claimed sample is an on-policy one (it carries :data:`ROLLOUT_FIELDS`)."""
    return all(name in sample for name in ROLLOUT_FIELDS)


def rollout_key(pass_index: int, corpus_key: str) -> str:
    """The key of the sample made of the prompt of text ``corpus_key`` in pass ``pass_index``
    over the prompts."""
    return f"p{pass_index}:{corpus_key}"
