"""``torch.compile`` of the student's decoder stack, once per run.

What is compiled: the backbone (the embedding, every decoder layer and the final norm; the output
layer stays eager, the loss reads its logits), as one region. Compiling each layer on its own
(one graph serves all, as they run the same code) compiles faster but runs slower here: each
layer call pays Dynamo's guards and the autograd wrapper on the host, and at 1 x 4096 on an H100
the host then launches the layers' kernels slower than the GPU runs them (a compiled forward of
43 ms of GPU time for 11 ms of FLOPs). Under FSDP each layer is its own region: FSDP's hooks run
at the layers' edges, inside a whole-stack graph they would break it.

Why ``dynamic=True``: micro-batches come with every length up to the context; a graph compiled
for one length would be compiled again for the next (and Dynamo stops after 8). Compiled with
symbolic sizes from the first call, one graph serves a range of lengths; Inductor still guards
some choices on a length's range (about a factor of two around the length it was compiled at),
so the trainer's start-up step compiles the ladder of lengths ``max_length, max_length / 2, ...``
(:func:`warm_lengths`) and a run's batches find their graph already built. Dynamo also
specializes a size of 1: a last partial micro-batch of a single sample is compiled once more.

A region that Dynamo cannot trace or Inductor cannot build fails at its first call; the trainer
then falls back to eager (:func:`uncompile`) with one warning.
"""

from __future__ import annotations

import torch

__all__ = [
    "compile_student",
    "compiled_graphs",
    "decoder_layers",
    "uncompile",
    "warm_lengths",
]


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


def compile_regions(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`compile_student` compiles: the backbone, else the decoder layers."""
    backbone = getattr(module, "model", None) or getattr(module, "transformer", None)
    if isinstance(backbone, torch.nn.Module) and decoder_layers(module):
        return [backbone]
    return decoder_layers(module)


def compile_student(
    module: torch.nn.Module, *, per_layer: bool = False, backend: str = "inductor"
) -> int:
    """Compile the student's decoder stack in place (``nn.Module.compile``).

    Args:
        module: a Hugging Face causal LM.
        per_layer: one region per decoder layer (FSDP) instead of the whole backbone.
        backend: the ``torch.compile`` backend (tests use ``aot_eager``, which traces the same
            graphs without building kernels).

    Returns:
        The number of regions compiled (0: no decoder layers found, nothing compiled).
    """
    regions = decoder_layers(module) if per_layer else compile_regions(module)
    for region in regions:
        region.compile(backend=backend, dynamic=True)
    return len(regions)


def warm_lengths(max_length: int, shortest: int = 64) -> list[int]:
    """The start-up step's lengths: ``max_length`` halved down to ``shortest``."""
    lengths = [max_length]
    while lengths[-1] // 2 >= shortest:
        lengths.append(lengths[-1] // 2)
    return lengths


def uncompile(module: torch.nn.Module) -> None:
    """Undo :func:`compile_student`: everything runs eagerly again (and Dynamo forgets what it
    compiled in this process)."""
    import torch._dynamo

    for region in [*compile_regions(module), *decoder_layers(module)]:
        region._compiled_call_impl = None  # where nn.Module.compile keeps it; no public undo
    torch._dynamo.reset()


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (a later increase is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
