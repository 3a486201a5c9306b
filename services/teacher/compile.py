"""Regional ``torch.compile`` of the teacher's decoder layers, and the fall back to eager.

Each decoder layer is compiled on its own (regional compilation): the layers of a model run one
code object, so one graph serves all of them and the compile time does not grow with depth; the
embedding, the mask construction and the final norm stay eager. Every teacher forward runs under
``torch.inference_mode`` (the logits are data: no autograd bookkeeping, no version counters).

CUDA graphs (``teacher.cuda_graphs``): each compiled layer is recorded once per row count and
length and replayed (Inductor's CUDA graph trees, ``mode="reduce-overhead"``), so the host
launches one graph per layer instead of one kernel at a time. A replay reuses its output buffers:
every forward starts a new generation, and the final norm (eager) copies the last layer's output
out of them before the next forward runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from xtoken_core.models.layers import LAYER_PATHS, decoder_layers

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RegionalCompile:
    """Runs the teacher's forwards under inference mode, through compiled decoder layers if asked.

    The layers compile on the first forward (``torch.compile`` is lazy); that forward's seconds
    are logged. If dynamo or the compiler backend fails (on that forward or a later one), the
    layers go back to eager for good, one warning naming ``teacher.compile`` says why, and the
    forward is run again eagerly: the teacher keeps serving.

    Args:
        model: the teacher causal LM.
        enabled: compile its decoder layers (see :func:`services.teacher.config.resolve_compile`).
        cuda_graphs: replay the compiled layers as CUDA graphs (see :func:`services.teacher.config.resolve_cuda_graphs`).
    """

    def __init__(self, model: torch.nn.Module, enabled: bool, cuda_graphs: bool = False) -> None:
        self.layers = (decoder_layers(model) or None) if enabled else None
        self.cuda_graphs = cuda_graphs and enabled
        self.active = False
        self.compile_s: float | None = None  # seconds of the first compiled forward
        if not enabled:
            return
        if self.layers is None:
            logger.warning(
                "[teacher] teacher.compile: %s has no decoder layers at %s; the teacher runs "
                "eager (set teacher.compile=false to silence this)",
                type(model).__name__,
                " / ".join(LAYER_PATHS),
            )
            return
        for layer in self.layers:
            # dynamic=True: a request's rows and length change from request to request; symbolic
            # sizes from the first compile mean a new length never recompiles (the default would
            # compile static shapes first and recompile on the second length; padding every
            # request to max_length would keep shapes static but spend max_length tokens of
            # compute on every row). Sizes 0/1, "padded or not" (an attention mask or None) and
            # Inductor's guards on a length's range (about a factor of two around the length a
            # graph was built at; services/trainer/compile.py) give a layer another graph: a
            # handful over the first requests of a run. fullgraph=True: a layer that graph-breaks
            # fails loudly here, and falls back to eager, instead of running slowly in pieces.
            layer.compile(
                dynamic=True,
                fullgraph=True,
                mode="reduce-overhead" if self.cuda_graphs else None,
            )
        self.active = True

    def run(self, forward: Callable[[], T]) -> T:
        """``forward()`` under ``torch.inference_mode``; on a compile failure, eagerly again.

        Args:
            forward: a teacher forward (its outputs are inference tensors: read them, or write
                them into normal tensors such as a ring slot; never modify them in place
                outside inference mode).

        Returns:
            What ``forward`` returns.

        Raises:
            Whatever the eager ``forward`` raises (a compile failure alone is not raised).
        """
        if not self.active:
            with torch.inference_mode():
                return forward()
        start = time.perf_counter()
        if self.cuda_graphs:  # the previous forward's graph outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        try:
            with torch.inference_mode():
                out = forward()
        except torch._dynamo.exc.TorchDynamoException as e:  # dynamo, inductor, the backend
            self._to_eager(e)
            with torch.inference_mode():
                return forward()
        if self.compile_s is None:
            self.compile_s = time.perf_counter() - start
            logger.info("[teacher] compiled the teacher in %.1f s", self.compile_s)
        return out

    def _to_eager(self, error: BaseException) -> None:
        assert self.layers is not None
        for layer in self.layers:
            # nn.Module.compile keeps the compiled call here and has no public undo
            layer._compiled_call_impl = None
        self.active = self.cuda_graphs = False
        first_line = (str(error).strip().splitlines() or [""])[0]
        logger.warning(
            "[teacher] teacher.compile: compiling the decoder layers failed (%s: %s); the "
            "teacher runs eager (set teacher.compile=false to skip compiling)",
            type(error).__name__,
            first_line,
        )
