"""Regional ``torch.compile`` of the student: each decoder layer compiled on its own, once per run.

Why regional: the decoder layers are where the time goes and they are all the same code, so one
compile serves every layer (Dynamo keys its cache on the code, the layers' parameters are inputs);
the embedding, the rotary tables and the output layer stay eager, and so does whatever a Hugging
Face model does around its layers (masks, caches, outputs), which a whole-model compile would
have to trace through and would break on.

Why ``dynamic=True``: micro-batches come with every length up to the context; a graph compiled
for one length would be compiled again for the next (and Dynamo stops after 8). Compiled with
symbolic sizes from the first call, one graph serves every length. Dynamo still specializes a
size of 1, so a batch size of 1 and of more than 1 are two graphs (a run's micro-batches have one
size, but a last partial one of a single sample is compiled once more).

A layer that Dynamo cannot trace or Inductor cannot build fails at its first call; the trainer
then falls back to eager (:func:`uncompile`) with one warning.
"""

from __future__ import annotations

import torch

__all__ = ["compile_layers", "compiled_graphs", "decoder_layers", "uncompile"]


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (none: an unknown layout)."""
    for name in ("model.layers", "transformer.h", "gpt_neox.layers"):
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def compile_layers(module: torch.nn.Module, *, backend: str = "inductor") -> int:
    """Compile each decoder layer of ``module`` in place (``nn.Module.compile``).

    Args:
        module: a Hugging Face causal LM.
        backend: the ``torch.compile`` backend (tests use ``aot_eager``, which traces the same
            graphs without building kernels).

    Returns:
        The number of layers compiled (0: no decoder layers found, nothing compiled).
    """
    layers = decoder_layers(module)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def uncompile(module: torch.nn.Module) -> None:
    """Undo :func:`compile_layers`: every layer runs eagerly again (and Dynamo forgets what it
    compiled in this process)."""
    import torch._dynamo

    for layer in decoder_layers(module):
        layer._compiled_call_impl = None
    torch._dynamo.reset()


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (a later increase is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
