"""Where a Hugging Face causal LM keeps its decoder layers (what the trainer shards and compiles,
and the teacher compiles)."""

from __future__ import annotations

import torch

__all__ = ["LAYER_PATHS", "decoder_layers"]

# Llama / Qwen / Mistral / Gemma, GPT-2, GPT-NeoX
LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, at the first of :data:`LAYER_PATHS` it has.

    Args:
        model: a Hugging Face causal LM.

    Returns:
        The layers in order; empty for a model of another layout.
    """
    for path in LAYER_PATHS:
        node: object = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if isinstance(node, torch.nn.ModuleList) and len(node) > 0:
            return list(node)
    return []
