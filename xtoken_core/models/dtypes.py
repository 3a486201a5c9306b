"""Model dtypes by name: ``auto`` and the torch float dtypes that configs name."""

from __future__ import annotations

import torch


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; else the torch dtype of that name.

    Args:
        name: ``auto`` or a torch float dtype name (``bfloat16``, ``float32``, ...).
        device: the device the dtype is for (``cuda``, ``cuda:1``, ``cpu``).

    Returns:
        The torch dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a float dtype; use auto, bfloat16, float32")
    return dtype
