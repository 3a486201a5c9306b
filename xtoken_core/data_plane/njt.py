"""Fast access to ``torch.jagged`` nested tensors: their parts and their construction without
torch's per-call dispatch.

A jagged nested tensor is a Python tensor subclass: each public call on it (``values()``,
``is_nested``, ``layout``, ``nested_tensor_from_jagged``) runs through ``__torch_function__``
and costs 10-100 us, as much as padding a row. The data plane touches a dozen fields per batch,
so these helpers read the parts the subclass keeps as plain attributes and build one from its
parts directly; where this torch has no such class (or a value needs autograd) they fall back
to the public calls. ``tests/xtoken_core/data_plane/test_njt.py`` holds both ways equal.

Legend: N rows, R total rows of the values, D... the inner dims.
"""

from __future__ import annotations

from typing import Any

import torch

from xtoken_core.jagged import _nested_values_offsets, is_jagged

try:  # the class behind torch.jagged nested tensors (private: guarded, with a public fallback)
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
    from torch.nested._internal.nested_tensor import _store_val_in_tensor
except ImportError:  # pragma: no cover - a torch without it takes the public path
    _NJT = None

__all__ = ["is_njt", "njt_from_parts", "njt_parts"]


def is_njt(x: Any) -> bool:
    """True for a ``torch.jagged`` nested tensor (an ``isinstance``, no dispatch)."""
    if _NJT is not None:
        return isinstance(x, _NJT)
    return is_jagged(x)  # pragma: no cover


def njt_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values ``[R, *D]``, offsets ``[N+1]`` int64) of a jagged nested tensor, compact (a view
    with holes, from ``narrow``, is gathered into one values buffer).

    Raises:
        ValueError: not a jagged nested tensor, or ragged in a dim other than 1.
    """
    if (
        _NJT is not None
        and isinstance(x, _NJT)
        and x._lengths is None
        and x._ragged_idx == 1
        and x._offsets.dtype == torch.int64
    ):
        return x._values, x._offsets
    return _nested_values_offsets(x)


def njt_from_parts(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor ``[N, j, *D]`` over ``values`` (no copy), rows cut by ``offsets``.

    With CPU offsets it knows its shortest and longest row, so that
    ``torch.nested.to_padded_tensor`` pads it to the longest row (without them torch pads to
    a width it cannot know, the total rows).

    Args:
        values: ``[R, *D]``.
        offsets: ``[N+1]`` int64 on ``values``' device, from 0 to R, non-decreasing (the caller
            has checked them: a ``JaggedColumn`` does).

    Returns:
        The nested tensor, sharing ``values``' storage.
    """
    hints: dict[str, int] = {}
    if offsets.device.type == "cpu" and offsets.numel() > 1:
        lengths = offsets.diff().tolist()
        hints = {"min_seqlen": min(lengths), "max_seqlen": max(lengths)}
    if _NJT is not None and not values.requires_grad:
        cache = {k: _store_val_in_tensor(v) for k, v in hints.items()}
        return _NJT(values, offsets, _metadata_cache=cache)
    return torch.nested.nested_tensor_from_jagged(values, offsets, **hints)
