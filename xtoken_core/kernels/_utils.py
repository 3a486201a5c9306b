"""Shared helpers for the Triton kernels: optional import, interpreter mode, lazy per-mode JIT."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xtoken_core import envs

try:  # Triton is optional: without it every kernel falls back to its PyTorch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

# Reductions go through ``tl.reduce`` with Triton's own combine functions instead of
# ``tl.sum`` / ``tl.max``: those are jitted library functions, fixed to compiled or interpreted
# when triton is imported, so they fail in a kernel interpreted after a plain import. The
# interpreter recognises these combine functions by identity and reduces with numpy.
SUM_COMBINE = tl.standard._sum_combine if tl is not None else None
MAX_COMBINE = tl.standard._elementwise_max if tl is not None else None

#: log2(e): the kernels work in base 2 (``exp2``), ``x2 = x * LOG2E``.
LOG2E = 1.4426950408889634

__all__ = [
    "LOG2E",
    "MAX_COMBINE",
    "SUM_COMBINE",
    "LazyJit",
    "cdiv",
    "interpret_mode",
    "lazy_jit",
    "next_power_of_2",
    "queue_mark",
    "read_later",
    "tl",
    "triton",
    "use_triton",
]


def interpret_mode() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``), read now.

    Returns:
        True when the environment variable is set to a true value.
    """
    return envs.triton_interpret()


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel should run on ``tensor``: Triton is importable and the tensor is on CUDA,
    or the Triton interpreter is on (then CPU tensors run interpreted).

    Args:
        tensor: the kernel's main input.

    Returns:
        True to launch the Triton kernel, False to use the PyTorch reference.
    """
    if triton is None:
        return False
    return tensor.is_cuda or interpret_mode()


def cdiv(a: int, b: int) -> int:
    """Ceiling division, the number of blocks of size ``b`` that cover ``a`` (launch grids).

    Args:
        a: extent (>= 0).
        b: block size (> 0).

    Returns:
        ``ceil(a / b)``.
    """
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``.

    Args:
        n: a non-negative integer.

    Returns:
        The power of two.
    """
    return 1 << max(int(n) - 1, 0).bit_length()


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def queue_mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream (None off CUDA): a point in the queued
    work for :func:`read_later` ``after``."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def read_later(
    *xs: torch.Tensor,
    after: torch.cuda.Event | None = None,
    dtype: torch.dtype | None = None,
    as_list: bool = True,
) -> Callable[[], list | torch.Tensor]:
    """Queue the copy of small tensors to the host; the returned function waits for that copy
    alone and gives its values (``tolist``: one tensor as it is shaped; several flattened and
    concatenated, as ``dtype`` or the dtype they promote to; ``as_list=False``: that host
    tensor itself, for long pieces a Python list would be slow to make).

    On CUDA each tensor is copied as it is into pinned memory on a side stream (copies only, no
    kernel: a kernel there would wait for SMs behind the current stream's running kernels),
    behind the work queued so far on the current stream (or the point ``after``, from
    :func:`queue_mark`) and ahead of none queued after it: the host can wait for the copy while
    the GPU runs that later work, which therefore must not write ``xs``. Elsewhere the values
    are read at once.
    """

    def values(parts) -> list | torch.Tensor:
        if len(parts) == 1 and dtype is None:
            joined = parts[0]
        else:
            joined = torch.cat([x.reshape(-1).to(dtype) if dtype else x.reshape(-1) for x in parts])
        return joined.tolist() if as_list else joined

    if not xs[0].is_cuda:
        read = values(xs)
        if read is xs[0]:  # one piece given back as it is: a copy, never the caller's tensor
            read = read.clone()
        return lambda: read
    device = xs[0].device
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    if after is None:
        stream.wait_stream(torch.cuda.current_stream(device))
    else:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in xs]
        for host, x in zip(hosts, xs, strict=True):
            host.copy_(x, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    for x in xs:
        x.record_stream(stream)  # their memory is not reused before the copy has read them

    def wait() -> list | torch.Tensor:
        event.synchronize()
        return values(hosts)

    return wait


class LazyJit:
    """A ``@triton.jit`` kernel compiled for the mode current at launch time.

    ``triton.jit`` picks compiled vs interpreted when it decorates, which pins a module-level
    kernel to the value ``TRITON_INTERPRET`` had at import. ``LazyJit`` decorates on first launch
    per mode instead, so a test can switch the interpreter on for its own scope only (see
    tests/xtoken_core/kernels/conftest.py). Kernels wrapped this way must not call other jitted
    helpers (inline them).

    Args:
        fn: the kernel body, a plain Python function written in the Triton language.
        jit_kwargs: keyword arguments for ``triton.jit``.
    """

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._by_mode: dict[bool, Any] = {}
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = fn.__doc__

    def jitted(self) -> Any:
        """The ``triton.jit`` object for the current mode (decorated once per mode).

        Returns:
            A ``JITFunction`` or, under ``TRITON_INTERPRET=1``, an ``InterpretedFunction``.

        Raises:
            RuntimeError: Triton is not installed.
        """
        return self._jitted_for(interpret_mode())

    def _jitted_for(self, mode: bool) -> Any:
        if triton is None:
            raise RuntimeError("triton is not installed: install it or run on the reference path")
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = triton.jit(self.fn, **self.jit_kwargs)
            self._by_mode[mode] = kernel
        return kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """Decorator form of :class:`LazyJit` (``@lazy_jit`` or ``@lazy_jit(debug=True)``).

    A kernel whose arguments depend on the batch (lengths, chunk and row counts; small index
    arrays carved from one buffer at data-dependent offsets) names them in
    ``do_not_specialize`` / ``do_not_specialize_on_alignment``: Triton otherwise compiles a new
    variant whenever such an int turns 1 or a multiple of 16, or such a pointer 16-byte aligned,
    and the training step that meets it waits seconds for the compile. Strides and vocab sizes
    (fixed per run, and what vectorized loads rely on) stay specialized.

    Args:
        fn: the kernel body.
        jit_kwargs: keyword arguments for ``triton.jit``.

    Returns:
        A :class:`LazyJit`, or a decorator making one.
    """
    if fn is None:
        return lambda f: LazyJit(f, **jit_kwargs)
    return LazyJit(fn, **jit_kwargs)
