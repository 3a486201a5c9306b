"""Splitting a causal LM into its backbone (final hidden states) and its output layer.

The ``hidden`` teacher transport ships the teacher's final hidden states [B, U, d] instead of
its logits [B, U, W]; the trainer applies the output layer itself (see ``load_output_layer``).

Shape legend: B batch, U tokens, d hidden size, W vocab (logits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Config fields that change logits after the output layer: with one of them set,
# lm_head(hidden) is not the model's logits, so the split is refused.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma-2/3: tanh soft-capping
    "logit_scale": 1.0,  # Cohere
    "logits_scaling": 1.0,  # Granite
}


@torch.no_grad()
def head_into(lm_head: torch.nn.Module, hidden_BUd: torch.Tensor, out_BUW: torch.Tensor) -> None:
    """Write ``lm_head(hidden_BUd)`` into ``out_BUW`` (a slot of the teacher's logit ring).

    A plain ``nn.Linear`` whose weight has the dtype of ``hidden_BUd`` and ``out_BUW`` writes each
    row's ``[U, W]`` product straight into ``out_BUW[b]`` (one matmul each): no ``[B, U, W]``
    temporary, which at 1 x 4096 x 128k vocab is a GiB, and no copy of it. Any other head (or
    dtype, or a row that is not contiguous) computes ``lm_head(hidden_BUd)`` and copies it; an
    ``out_BUW`` on another GPU gets the product staged on that GPU first.

    Args:
        lm_head: the output layer of :func:`split_lm_head`.
        hidden_BUd: [B, U, d] final hidden states.
        out_BUW: [B, U, W] destination (no gradient flows: the teacher's logits are data).
    """
    if out_BUW.is_cuda and hidden_BUd.is_cuda and out_BUW.device != hidden_BUd.device:
        # another GPU's memory (a tensor-parallel rank writing its columns of rank 0's ring slot):
        # a contiguous peer copy to that GPU (a memcpy, no kernel reads across devices), then
        # the strided write by a kernel of that GPU
        staged_BUW = lm_head(hidden_BUd).to(out_BUW.device)
        with torch.cuda.device(out_BUW.device):
            out_BUW.copy_(staged_BUW)
        return
    weight = getattr(lm_head, "weight", None)
    direct = (
        type(lm_head) is torch.nn.Linear
        and weight.dtype == hidden_BUd.dtype == out_BUW.dtype
        and all(out_BUW[b].is_contiguous() for b in range(out_BUW.shape[0]))
    )
    if not direct:
        out_BUW.copy_(lm_head(hidden_BUd))
        return
    for b in range(out_BUW.shape[0]):
        torch.matmul(hidden_BUd[b], weight.t(), out=out_BUW[b])
        if lm_head.bias is not None:
            out_BUW[b] += lm_head.bias


def split_lm_head(
    model: torch.nn.Module,
) -> tuple[Callable[..., torch.Tensor], torch.nn.Module]:
    """Split a causal LM into ``backbone(ids, attention_mask) -> hidden_BUd`` and its output layer.

    ``lm_head(backbone(ids_BU, mask_BU))`` equals ``model(ids_BU, attention_mask=mask_BU).logits``
    (within rounding). Both parts share the model's parameters (nothing is copied).

    Args:
        model: a transformers causal LM (``base_model`` + ``get_output_embeddings()``).

    Returns:
        (backbone, lm_head): ``backbone(input_ids_BU, attention_mask_BU=None,
        position_ids_BU=None)`` returns the final hidden states after the last norm, [B, U, d]
        (packed rows: the positions restarting per document and their document mask,
        :mod:`xtoken_core.models.documents`); ``lm_head`` maps [..., d] -> [..., W].

    Raises:
        ValueError: the model has no separate output layer or base model, or its config
            transforms the logits after the output layer (e.g. soft-capping).
    """
    get_head = getattr(model, "get_output_embeddings", None)
    lm_head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if not isinstance(lm_head, torch.nn.Module) or not isinstance(base, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no output layer (get_output_embeddings) or no base model; "
            "pass a transformers causal LM such as LlamaForCausalLM"
        )
    if base is model:
        raise ValueError(
            f"{type(model).__name__} is a bare backbone, not a causal LM with an output layer; "
            "load it with AutoModelForCausalLM"
        )
    config = getattr(model, "config", None)
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, attr, neutral)
        if value != neutral:
            raise ValueError(
                f"{type(model).__name__} sets config.{attr}={value!r}, which changes logits after "
                "the output layer; split_lm_head supports plain linear output layers only"
            )

    def backbone(
        input_ids_BU: torch.Tensor,
        attention_mask_BU: Any = None,
        position_ids_BU: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, U, d] (after the last norm) of ``input_ids_BU``."""
        kwargs = {} if position_ids_BU is None else {"position_ids": position_ids_BU}
        out = base(
            input_ids=input_ids_BU, attention_mask=attention_mask_BU, use_cache=False, **kwargs
        )
        return out.last_hidden_state

    return backbone, lm_head
