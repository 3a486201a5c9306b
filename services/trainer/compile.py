"""Regional ``torch.compile`` of the student: each decoder layer compiled on its own, once per run.

Why regional: the decoder layers are where the time goes and they all run the same code, so one
compile serves every layer (Dynamo keys its cache on the code; the layers' parameters are inputs)
and a compile takes seconds; the embedding and the output layer stay eager. The cost: each layer
call pays Dynamo's guards and the autograd wrapper on the host; at 1 x 4096 on an H100 the host
then launches the forward slower than the GPU runs it (benchmarks/results/e2e_pipeline.md). The
whole backbone as one region was tried: its compile with symbolic lengths took minutes.

Why ``dynamic=True``: micro-batches come with every length up to the context; a graph compiled
for one length would be compiled again for the next (and Dynamo stops after 8). Compiled with
symbolic sizes from the first call, one graph serves a range of lengths; Inductor still guards
some choices on a length's range (about a factor of two around the length it was compiled at:
``2560 <= T <= 5119`` after a compile at 4096), so the trainer's start-up step compiles the
ladder of lengths ``max_length, max_length / 2, ...`` (:func:`warm_lengths`) and a run's batches
find their graph already built. Dynamo also specializes a size of 1: a last partial micro-batch
of a single sample is compiled once more.

CUDA graphs (``trainer.compute.cuda_graphs``): each compiled layer's forward and backward are
recorded once per length and replayed (Inductor's CUDA graph trees, ``mode="reduce-overhead"``): one
launch per layer call instead of one per kernel, so the host no longer sets the pace. A replay
reuses its output buffers, so every micro-batch's forward starts a new generation
(:func:`mark_step`); nothing of a micro-batch's graph outputs may be kept past its backward.

A layer that Dynamo cannot trace or Inductor cannot build fails at its first call; the trainer
then falls back to eager (:func:`uncompile`) with one warning.
"""

from __future__ import annotations

from typing import Any

import torch

from xtoken_core.models.layers import decoder_layers

__all__ = [
    "CompileCounts",
    "compile_cache_counts",
    "compile_phase_seconds",
    "compile_student",
    "compiled_graphs",
    "compiled_kernels",
    "decoder_layers",
    "mark_step",
    "uncompile",
    "warm_lengths",
]


def compile_student(
    module: torch.nn.Module, *, backend: str = "inductor", cuda_graphs: bool = False
) -> int:
    """Compile each decoder layer of the student in place (``nn.Module.compile``).

    Args:
        module: a Hugging Face causal LM.
        backend: the ``torch.compile`` backend (tests use ``aot_eager``, which traces the same
            graphs without building kernels).
        cuda_graphs: record and replay each layer's kernels as CUDA graphs (Inductor only).

    Returns:
        The number of layers compiled (0: no decoder layers found, nothing compiled).
    """
    layers = decoder_layers(module)
    mode = "reduce-overhead" if cuda_graphs else None
    for layer in layers:
        layer.compile(backend=backend, dynamic=True, mode=mode)
    return len(layers)


def mark_step() -> None:
    """Start a new generation of CUDA graph replays (before each micro-batch's forward): the
    outputs of the previous one are no longer read."""
    torch.compiler.cudagraph_mark_step_begin()


def warm_lengths(max_length: int, shortest: int = 64) -> list[int]:
    """The start-up step's lengths: ``max_length`` halved down to ``shortest``
    (``trainer.compute.warm_shortest``); ``max_length`` alone where it is shorter."""
    lengths = [max_length]
    while lengths[-1] // 2 >= shortest:
        lengths.append(lengths[-1] // 2)
    return lengths


def uncompile(module: torch.nn.Module) -> None:
    """Undo :func:`compile_student`: everything runs eagerly again (and Dynamo forgets what it
    compiled in this process)."""
    import torch._dynamo

    for layer in decoder_layers(module):
        layer._compiled_call_impl = None  # where nn.Module.compile keeps it; no public undo
    torch._dynamo.reset()


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (a later increase is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


#: Inductor's on-disk caches as named in Dynamo's counters: (their name here, counter group,
#: counter prefix); each counts ``hit``, ``miss`` and ``bypass`` (not cacheable)
_CACHES = (
    ("fx_graph", "inductor", "fxgraph_cache_"),
    ("aot_autograd", "aot_autograd", "autograd_cache_"),
)


def compile_cache_counts() -> dict[str, dict[str, int]]:
    """Lookups of Inductor's on-disk caches in this process so far: ``{"fx_graph": {"hit",
    "miss", "bypass"}, "aot_autograd": {...}}``. A compile whose graphs hit both caches skips
    Inductor's code generation (another run of the same model on this machine compiled them)."""
    from torch._dynamo.utils import counters

    return {
        name: {k: int(counters[group][prefix + k]) for k in ("hit", "miss", "bypass")}
        for name, group, prefix in _CACHES
    }


def compile_phase_seconds() -> dict[str, float]:
    """Seconds this process spent so far in each phase PyTorch's compiler times
    (``torch._dynamo.utils.compilation_time_metrics``: Dynamo's tracing, AOTAutograd, Inductor's
    code generation, cache loads, the wait for kernel compiles, CUDA graph recording...), summed
    over its calls; phases nest, so they do not add up to a total."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: float(sum(times)) for name, times in compilation_time_metrics.items()}


_triton_compiles = 0  # Triton kernels compiled since the hook went in
_triton_hooked = False


def compiled_kernels() -> int:
    """Triton kernels JIT-compiled in this process since the first call (Triton's
    ``jit_post_compile_hook``, chained to a hook already set); 0 without Triton. A later
    increase is a kernel first needed then: seconds on its step with an empty Triton cache."""
    global _triton_hooked
    if not _triton_hooked:
        _triton_hooked = True
        try:
            import triton
        except ImportError:
            return 0
        knobs = triton.knobs.runtime
        before = knobs.jit_post_compile_hook

        def counted(*args: Any, **kwargs: Any) -> Any:
            global _triton_compiles
            _triton_compiles += 1
            return before(*args, **kwargs) if before is not None else False

        knobs.jit_post_compile_hook = counted
    return _triton_compiles


class CompileCounts:
    """What was compiled after the start-up: Dynamo graphs since the start-up step, and Triton
    kernels since the first step (which compiles those the loss needs)."""

    def __init__(self) -> None:
        self._graphs: int | None = None
        self._kernels: int | None = None

    def after_start_up(self) -> None:
        """Count from here the graphs Dynamo builds (after the start-up step)."""
        self._graphs = compiled_graphs()

    def after_step(self) -> None:
        """Count from here the Triton kernels compiled (after the first step; later ones count
        nothing)."""
        if self._kernels is None:
            self._kernels = compiled_kernels()

    def since(self) -> int | None:
        """Graphs and kernels compiled since (None: no start-up step was counted)."""
        if self._graphs is None:
            return None
        kernels = 0 if self._kernels is None else compiled_kernels() - self._kernels
        return compiled_graphs() - self._graphs + kernels
