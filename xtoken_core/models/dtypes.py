"""Model dtypes by name: ``auto`` and the torch float dtypes that configs name.

The names are checked without importing torch (configs validate before any model is touched);
:func:`resolve_dtype` imports it when a process builds its model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = frozenset(
    {
        "float16", "half", "bfloat16", "float32", "float", "float64", "double",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    }
)  # fmt: skip
"""The float dtype names of torch a config may name (besides ``auto``)."""


def check_dtype_name(name: str) -> None:
    """Raise unless ``name`` is ``auto`` or a torch float dtype name (no torch import).

    Raises:
        ValueError: names the dtype and the usual choices.
    """
    if name != "auto" and name not in FLOAT_DTYPES:
        raise ValueError(f"dtype {name!r} is not a float dtype; use auto, bfloat16, float32")


_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2}


def dtype_bytes(name: str, device: str) -> int:
    """Bytes per element of a dtype name as :func:`resolve_dtype` resolves it (no torch import).

    Raises:
        ValueError: an unknown dtype name.
    """
    check_dtype_name(name)
    if name == "auto":
        return 2 if str(device).startswith("cuda") else 4
    return _BYTES.get(name, 2 if name == "bfloat16" else 1)


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
    import torch

    check_dtype_name(name)
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)
