"""The jagged column (N variable-length rows as one values tensor + one offsets tensor) and the
tensor dtypes that cross process boundaries, shared by the wire codec (:mod:`xtoken_core.wire`)
and the shared-memory / CUDA IPC handles (:mod:`xtoken_core.ipc`), which import it from here and
not from each other.

Legend: N rows (samples) of a jagged column, R total rows of its values (sum of row lengths),
D... the inner (per-token) dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["DTYPE_NAMES", "WIRE_DTYPES", "JaggedColumn", "is_jagged"]

# dtype name on the wire -> torch dtype. Names are part of the protocol.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}


@dataclass
class JaggedColumn:
    """N variable-length rows stored as one values tensor and one offsets tensor.

    Row i is ``values[offsets[i]:offsets[i+1]]``. This is the layout of a jagged field on the
    wire and the cheapest one for a server to slice per key.

    Args:
        values: ``[R, *D]`` tensor, R = total rows.
        offsets: ``[N+1]`` int64, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == R``.

    Raises:
        ValueError: if the offsets do not describe the values.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.values, torch.Tensor) or self.values.ndim < 1:
            raise ValueError(
                f"JaggedColumn.values must be a tensor with >= 1 dim, got {_describe(self.values)}"
            )
        if (
            not isinstance(self.offsets, torch.Tensor)
            or self.offsets.dtype != torch.int64
            or self.offsets.ndim != 1
            or self.offsets.numel() < 1
        ):
            raise ValueError(
                "JaggedColumn.offsets must be a 1-D int64 tensor of N+1 entries, got "
                f"{_describe(self.offsets)}"
            )
        _check_offsets(self.offsets.cpu().numpy(), int(self.values.shape[0]), ValueError)

    @property
    def num_rows(self) -> int:
        """N, the number of rows."""
        return int(self.offsets.numel()) - 1

    def lengths(self) -> torch.Tensor:
        """Return the row lengths, ``[N]`` int64."""
        return self.offsets.diff()

    def row(self, i: int) -> torch.Tensor:
        """Return row ``i`` as a view, ``[len_i, *D]``."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.values[start:end]

    def rows(self) -> list[torch.Tensor]:
        """Return all rows as views, N tensors ``[len_i, *D]``."""
        # one split: no per-row reads of the offsets (each a device sync on an accelerator)
        return list(self.values.split(self.lengths().tolist()))

    def to_nested(self) -> torch.Tensor:
        """Return a ``torch.jagged`` nested tensor ``[N, j, *D]`` sharing this storage."""
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets)

    @classmethod
    def from_nested(cls, nested: torch.Tensor) -> JaggedColumn:
        """Build from a ``torch.jagged`` nested tensor (zero copy unless it has holes).

        Args:
            nested: ``[N, j, *D]`` nested tensor, ragged dim 1.

        Returns:
            The column.

        Raises:
            ValueError: for a strided nested tensor or a ragged dim other than 1.
        """
        values, offsets = _nested_values_offsets(nested)
        return cls(values, offsets)

    @classmethod
    def from_rows(
        cls, rows: list[torch.Tensor], *, dtype: torch.dtype | None = None
    ) -> JaggedColumn:
        """Concatenate rows ``[len_i, *D]`` (same D, same dtype) into a column (copies).

        Args:
            rows: the rows; may be empty (then ``dtype`` defaults to float32 and D to ()).
            dtype: dtype of an empty column.

        Returns:
            The column.

        Raises:
            ValueError: if rows differ in inner shape or dtype, or a row is 0-d.
        """
        if not rows:
            return cls(
                torch.empty(0, dtype=dtype or torch.float32), torch.zeros(1, dtype=torch.int64)
            )
        inner = tuple(rows[0].shape[1:])
        for i, r in enumerate(rows):
            if r.ndim < 1 or tuple(r.shape[1:]) != inner or r.dtype != rows[0].dtype:
                raise ValueError(
                    f"row {i} has shape {tuple(r.shape)} dtype {r.dtype}; every row must be "
                    f"[len, {', '.join(map(str, inner))}] of dtype {rows[0].dtype}"
                )
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(torch.cat(rows, 0), offsets)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor shape={tuple(x.shape)} dtype={x.dtype}"
    return type(x).__name__


def _check_offsets(
    offsets_n1: np.ndarray, total: int, exc: type[Exception], path: str = ""
) -> None:
    """Raise ``exc`` unless offsets start at 0, never decrease and end at ``total``."""
    where = f" at {path}" if path else ""
    if offsets_n1.size < 1:
        raise exc(f"jagged offsets{where} are empty; they need N+1 >= 1 entries")
    if int(offsets_n1[0]) != 0 or int(offsets_n1[-1]) != total:
        raise exc(
            f"jagged offsets{where} run from {int(offsets_n1[0])} to {int(offsets_n1[-1])}; "
            f"they must run from 0 to the {total} value rows"
        )
    if offsets_n1.size > 1 and bool((np.diff(offsets_n1) < 0).any()):
        raise exc(f"jagged offsets{where} decrease; row lengths must be >= 0")


def is_jagged(x: Any) -> bool:
    """True for a ``torch.jagged`` nested tensor."""
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.jagged


def _nested_values_offsets(nested: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (values ``[R, *D]``, offsets ``[N+1]`` int64) of a jagged nested tensor."""
    if not is_jagged(nested):
        raise ValueError(
            f"expected a torch.jagged nested tensor, got layout {nested.layout}; build it with "
            "torch.nested.nested_tensor(..., layout=torch.jagged)"
        )
    if nested._ragged_idx != 1:
        raise ValueError(
            f"nested tensor ragged dim is {nested._ragged_idx}; only ragged dim 1 travels on the "
            "wire (transpose it back first)"
        )
    values, offsets = nested.values(), nested.offsets().to(torch.int64)
    if nested._lengths is not None:
        # A view with holes (torch.nested.narrow): gather the live rows into one buffer.
        lengths = nested._lengths.to(torch.int64)
        rows = [
            values[int(offsets[i]) : int(offsets[i]) + int(lengths[i])]
            for i in range(lengths.numel())
        ]
        inner = tuple(values.shape[1:])
        values = torch.cat(rows, 0) if rows else values.new_empty((0, *inner))
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.cpu(), 0, out=offsets[1:])
    return values, offsets
