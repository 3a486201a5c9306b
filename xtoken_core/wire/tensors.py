"""Tensors on the wire: tensor <-> (descriptor, buffer) codecs, raw (already encoded) tensors and
jagged columns; the dtype table and JaggedColumn come from :mod:`xtoken_core.jagged`.

Legend: N rows (samples) of a jagged column, R total rows of its values (sum of row lengths),
D... the inner (per-token) dims.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xtoken_core.jagged import (  # noqa: F401  (re-exported: the wire's public names)
    DTYPE_NAMES,
    WIRE_DTYPES,
    JaggedColumn,
    _check_offsets,
    _describe,
    _nested_values_offsets,
    is_jagged,
)

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in practice
    raise ImportError("xtoken_core.wire assumes a little-endian host (the wire is little-endian)")

# numpy dtypes accepted on encode (they decode as torch tensors of the same dtype).
_NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}

# torch.frombuffer warns once per process on a read-only buffer (zmq frames, bytes). Decoded
# tensors alias the received frames on purpose (zero copy), so that warning is noise: trigger
# it here, at import, inside a filter, and torch stays quiet for the rest of the process. This
# is thread-safe, unlike wrapping every decode in warnings.catch_warnings().
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\x00", dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A dense tensor already in wire form: dtype, shape and its raw little-endian bytes.

    What a server that forwards stored bytes hands to ``encode_message``: encoding it touches no
    torch op (the bytes go inline or as a frame, zero copy). Decodes as a ``torch.Tensor``.

    Attributes:
        dtype: a wire dtype (a key of ``DTYPE_NAMES``).
        shape: the tensor shape.
        data: ``prod(shape) * itemsize`` bytes (bytes or a 1-D byte memoryview).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class RawJagged:
    """A jagged column already in wire form: values ``[R, *D]`` and offsets ``[N+1]`` as bytes.

    Encoding it touches no torch op; it decodes exactly like the ``JaggedColumn`` it stands for.
    The producer guarantees the offsets are valid (0 .. R, non-decreasing).

    Attributes:
        dtype: dtype of the values (a key of ``DTYPE_NAMES``).
        inner_shape: D, the per-row dims.
        num_rows: N.
        total_rows: R.
        values: ``R * prod(D) * itemsize`` bytes (bytes or a 1-D byte memoryview).
        offsets: ``(N + 1) * 8`` bytes, little-endian int64.
    """

    dtype: torch.dtype
    inner_shape: tuple[int, ...]
    num_rows: int
    total_rows: int
    values: bytes | memoryview
    offsets: bytes | memoryview

    def to_column(self) -> JaggedColumn:
        """Return the column as tensors over copies of the bytes (writable, owned)."""
        shape = (self.total_rows, *self.inner_shape)
        values = tensor_from_buffer(memoryview(self.values).cast("B"), self.dtype, shape, copy=True)
        offsets = tensor_from_buffer(
            memoryview(self.offsets).cast("B"), torch.int64, (self.num_rows + 1,), copy=True
        )
        return JaggedColumn(values, offsets)


def as_wire_tensor(x: Any, path: str) -> torch.Tensor:
    """Return a CPU, contiguous, detached tensor of a wire dtype for a tensor or numpy array.

    Args:
        x: ``torch.Tensor`` (strided) or numeric ``np.ndarray``.
        path: where in the body ``x`` sits, for error messages.

    Returns:
        The tensor (``x`` itself when already CPU-contiguous: zero copy).

    Raises:
        TypeError: unsupported dtype or array kind.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.byteorder == ">":
            x = x.astype(x.dtype.newbyteorder("<"))
        dtype = _NUMPY_TO_TORCH.get(x.dtype)
        if dtype is None:
            raise TypeError(
                f"numpy array of dtype {x.dtype} at {path} cannot travel on the wire; use one of "
                f"{sorted(str(d) for d in _NUMPY_TO_TORCH)}"
            )
        x = torch.from_numpy(np.ascontiguousarray(x))
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(
            f"tensor of dtype {x.dtype} at {path} cannot travel on the wire; use one of "
            f"{sorted(WIRE_DTYPES)}"
        )
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if not x.is_contiguous():
        x = x.contiguous()
    return x


def tensor_bytes(x: torch.Tensor) -> memoryview:
    """Return a 1-D byte memoryview over a contiguous CPU tensor's data (zero copy).

    The memoryview keeps the tensor alive.
    """
    if x.numel() == 0:
        return memoryview(b"")
    if x.dtype != torch.bfloat16:  # numpy has no bfloat16
        try:
            return memoryview(x.numpy()).cast("B")  # one torch op; raises for strided views
        except (TypeError, RuntimeError):  # not C-contiguous, or needs grad
            pass
    flat = x.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_from_buffer(
    buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], *, copy: bool
) -> torch.Tensor:
    """Rebuild a tensor over ``buf`` (zero copy unless ``copy`` or misaligned).

    The caller has checked ``buf.nbytes == prod(shape) * itemsize``.

    Args:
        buf: 1-D byte memoryview.
        dtype: the tensor dtype.
        shape: the tensor shape.
        copy: give the tensor its own writable memory.

    Returns:
        The tensor, aliasing ``buf`` unless copied.
    """
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if copy:
        buf = memoryview(bytearray(buf))
    flat = torch.frombuffer(buf, dtype=dtype)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # misaligned frame (a slice of a larger buffer): copy to align
    return flat.reshape(shape)


def num_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Return ``prod(shape) * itemsize`` with Python ints (no overflow)."""
    return math.prod(shape) * dtype.itemsize
