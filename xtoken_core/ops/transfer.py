"""Host tensors to a GPU without making the host wait for the GPU.

A copy from pageable host memory to a GPU is synchronous for the host: the driver stages it
through a pinned buffer of its own and, for all but small copies, waits for the work queued
before it on the stream. In a training step that wait lands on the host at the worst moment (the
kernels of the step before, or the forward just queued, must finish before the host can queue
anything more), and the GPU idles while the host catches up. A copy from page-locked (pinned)
memory is queued like a kernel and returns at once, so the host first copies the tensor into
pinned memory (``Tensor.pin_memory``: PyTorch's caching host allocator, which hands the block
back only once the copies queued from it have run).
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(
    t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``t`` on ``device`` (as ``dtype`` when given), queued without a host wait on a GPU.

    A host tensor bound for a CUDA device goes through pinned memory and a non-blocking copy;
    anything else is ``Tensor.to`` (a tensor already there: itself, or its cast).

    Args:
        t: the tensor.
        device: where it goes.
        dtype: its dtype there (None: its own).
    """
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, dtype, non_blocking=True)
