"""Vocabulary sizes of models and the check that a model, its tokenizer and a projection agree."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# rows of a preset student's output layer are a multiple of this (Qwen, Llama and Megatron pad
# theirs alike): a matrix product whose output rows are not a multiple of 8 elements cannot use
# the GPU's fast kernels (``benchmarks/results/teacher_cache.md``)
PRESET_VOCAB_MULTIPLE = 128


def preset_vocab_size(tokenizer_vocab: int, multiple: int = PRESET_VOCAB_MULTIPLE) -> int:
    """The output-layer rows of a preset student built for a tokenizer of ``tokenizer_vocab``
    ids: rounded up to a multiple of ``multiple`` (151,669 -> 151,680). The ids
    past the tokenizer have no text; their logits are never a label and never sampled.

    Args:
        tokenizer_vocab: the tokenizer's ``vocab_size``.
        multiple: the rounding (> 0).

    Raises:
        ValueError: a size is not a positive int.
    """
    _check_int("tokenizer_vocab", tokenizer_vocab)
    _check_int("multiple", multiple)
    return -(-tokenizer_vocab // multiple) * multiple


def model_vocab_size(model: torch.nn.Module) -> int:
    """Number of logits the model produces per position (rows of its output layer).

    Args:
        model: a transformers causal LM.

    Returns:
        The output layer's out_features (``config.vocab_size`` where it has no output layer
        with a weight); an output layer split by vocab rows over a tensor-parallel group (its
        ``whole_out_features`` set) counts the whole vocab.

    Raises:
        ValueError: the model has neither an output layer nor a ``config.vocab_size``.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    whole = getattr(head, "whole_out_features", None)
    if isinstance(whole, int):
        return whole
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    raise ValueError(
        f"cannot tell the vocab size of {type(model).__name__}: it has no output layer and no "
        "config.vocab_size; pass a transformers causal LM"
    )


def _check_int(what: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


def check_vocab(
    name: str, model_vocab: int, tokenizer_vocab: int, projection_vocab: int | None = None
) -> None:
    """Check that a model can score every id of its tokenizer and of a projection matrix.

    The model may have more logits than the tokenizer has ids (an output layer padded to a
    round size, e.g. Qwen's 151,936 for 151,669 ids), never fewer.

    Args:
        name: which side ("student", "teacher", or a model spec), for the message.
        model_vocab: logits per position (``model_vocab_size(model)``).
        tokenizer_vocab: the tokenizer's ``vocab_size`` (every id it produces is below it).
        projection_vocab: the projection matrix's size along this model's axis (student rows or
            teacher columns), or None when there is no projection.

    Raises:
        ValueError: a size is not a positive int, the model has fewer logits than the tokenizer
            has ids, or the projection addresses ids past the model's logits. The message names
            both sizes and the fix.
    """
    _check_int(f"{name} model_vocab", model_vocab)
    _check_int(f"{name} tokenizer_vocab", tokenizer_vocab)
    _check_int(f"{name} projection_vocab", projection_vocab, allow_none=True)
    if model_vocab < tokenizer_vocab:
        raise ValueError(
            f"{name}: the model has {model_vocab} logits but its tokenizer has {tokenizer_vocab} "
            f"ids (ids >= {model_vocab} would have no logit); use the tokenizer the model was "
            f"trained with, or build a preset with vocab_size={tokenizer_vocab}"
        )
    if projection_vocab is not None and projection_vocab > model_vocab:
        raise ValueError(
            f"{name}: the projection matrix addresses {projection_vocab} ids but the model has "
            f"{model_vocab} logits (tokenizer: {tokenizer_vocab} ids); rebuild the projection "
            "for this model's tokenizer, or pass the matching model"
        )
