"""The loss's one collective: a count summed over the data-parallel group (the global
denominators of docs/design.md, "The loss math")."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["dp_all_reduce_sum"]


def dp_all_reduce_sum(local: torch.Tensor | float | int) -> torch.Tensor:
    """Sum a count across the data-parallel (default) process group.

    Args:
        local: a scalar (or small) tensor or number; it is not modified.

    Returns:
        A fresh float32 tensor on the input's device holding the sum over ranks; a copy of the
        local value when torch.distributed is not initialized.
    """
    if isinstance(local, torch.Tensor):
        out = local.detach().to(torch.float32).clone()
    else:
        out = torch.tensor(float(local), dtype=torch.float32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
