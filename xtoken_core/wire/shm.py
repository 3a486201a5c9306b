"""Shared-memory tensors on the wire: ext types 3 and 4 reference buffers in a /dev/shm segment.

Legend: N rows of a jagged field, R total rows of its values, D... the inner dims.

Same-host senders may replace a tensor's frame by a reference into a shared-memory segment
(xtoken_core.ipc.shm): the bytes never cross a socket. The ext payloads mirror EXT_TENSOR and
EXT_JAGGED, with the buffer given as (segment name, segment size, byte offset):

  EXT_SHM_TENSOR=3  [dtype, shape, name, size, offset]
  EXT_SHM_JAGGED=4  [dtype, inner_shape, N, R, name, size, values_offset, offsets]
                    offsets: byte offset in the segment | inline bin (int64 [N+1])

A receiver decodes them only when asked to (``decode_message(..., shm=True)`` or a
``ShmReader``). A one-message reader **adopts** each segment (maps it, unlinks its name); a
reader that knows a segment already (a server's own pool) or caches mappings of a server's pool
(a client) unlinks nothing. Tensors are views of the mapping. Every field is checked (name
pattern, owner uid, file size, bounds, alignment, dtype/shape vs bytes, offsets) and a bad one
is ``bad_body``. Senders use them only with a receiver that advertised ``shm: true`` in its
hello reply, or, in replies, when the request asked for them (proto/PROTOCOL.md,
"Shared-memory tensors").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from xtoken_core.ipc.shm import (
    ShmReader,
    ShmRegion,
    ShmSegment,
    ShmTensorHandle,
    write_tensors,
)
from xtoken_core.wire.errors import BAD_BODY, WireError
from xtoken_core.wire.tensors import (
    DTYPE_NAMES,
    WIRE_DTYPES,
    JaggedColumn,
    _check_offsets,
    _nested_values_offsets,
    is_jagged,
)

EXT_SHM_TENSOR = 3
EXT_SHM_JAGGED = 4
SHM_EXT_CODES = frozenset({EXT_SHM_TENSOR, EXT_SHM_JAGGED})


@dataclass(frozen=True, slots=True)
class ShmField:
    """A body value that travels as a shared-memory reference (ext 3 or 4).

    Attributes:
        handle: where the tensor (or jagged column) lives in its segment.
        offsets: for a jagged field whose offsets travel inline: their int64 ``[N+1]`` bytes,
            with ``handle`` the dense values ``[R, *D]`` (a server's reply rebases the offsets
            of the rows it hands out, so they are not in the segment).
    """

    handle: ShmTensorHandle
    offsets: bytes | None = None

    def to_ext(self) -> msgpack.ExtType:
        """The msgpack ext value for this field."""
        h = self.handle
        name = DTYPE_NAMES[h.dtype]
        if self.offsets is not None:
            payload = [
                name,
                list(h.shape[1:]),
                len(self.offsets) // 8 - 1,
                h.shape[0],
                h.name,
                h.size,
                h.offset,
                self.offsets,
            ]
            return msgpack.ExtType(EXT_SHM_JAGGED, msgpack.packb(payload, use_bin_type=True))
        if h.offsets_at is None:
            payload = [name, list(h.shape), h.name, h.size, h.offset]
            return msgpack.ExtType(EXT_SHM_TENSOR, msgpack.packb(payload, use_bin_type=True))
        payload = [
            name,
            list(h.shape[1:]),
            h.num_rows,
            h.shape[0],
            h.name,
            h.size,
            h.offset,
            h.offsets_at,
        ]
        return msgpack.ExtType(EXT_SHM_JAGGED, msgpack.packb(payload, use_bin_type=True))


def decode_shm_ext(
    code: int, fields: Any, reader: ShmReader, as_column: bool
) -> torch.Tensor | JaggedColumn:
    """Adopt the segment an ext 3/4 payload references and return the tensor it describes.

    Args:
        code: ``EXT_SHM_TENSOR`` or ``EXT_SHM_JAGGED``.
        fields: the unpacked ext payload (a list).
        reader: maps each segment once per message.
        as_column: return jagged fields as ``JaggedColumn`` (else ``torch.jagged`` nested).

    Returns:
        The tensor, a zero-copy view of the shared mapping.

    Raises:
        WireError: ``bad_body`` for a malformed payload or a segment that cannot be adopted.
    """
    try:
        if code == EXT_SHM_TENSOR:
            if not isinstance(fields, list) or len(fields) != 5:
                raise ValueError("shm tensor ext must be [dtype, shape, name, size, offset]")
            dtype, shape = _dtype(fields[0]), _shape(fields[1])
            nbytes = _nbytes(shape, dtype)
            handle = ShmTensorHandle(fields[2], fields[3], fields[4], nbytes, dtype, shape)
        else:
            if not isinstance(fields, list) or len(fields) != 8:
                raise ValueError(
                    "shm jagged ext must be [dtype, inner_shape, N, R, name, size, "
                    "values_offset, offsets_offset]"
                )
            dtype, inner = _dtype(fields[0]), _shape(fields[1])
            n, r = fields[2], fields[3]
            if type(r) is not int or r < 0:
                raise ValueError(f"shm jagged R={r!r} must be a non-negative int")
            shape = (r, *inner)
            if isinstance(fields[7], bytes):  # offsets inline: values are a dense [R, *D]
                handle = ShmTensorHandle(
                    fields[4], fields[5], fields[6], _nbytes(shape, dtype), dtype, shape
                )
                values = reader.open(handle)
                column = JaggedColumn.__new__(JaggedColumn)
                column.values, column.offsets = values, _inline_offsets(fields[7], n, r)
                return column if as_column else column.to_nested()
            handle = ShmTensorHandle(
                fields[4], fields[5], fields[6], _nbytes(shape, dtype), dtype, shape, fields[7], n
            )
        value = reader.open(handle)
    except ValueError as e:
        raise WireError(BAD_BODY, f"shm: {e}") from None
    if isinstance(value, JaggedColumn) and not as_column:
        return value.to_nested()
    return value


def _inline_offsets(data: bytes, n: Any, r: int) -> torch.Tensor:
    """int64 offsets ``[N+1]`` from inline bytes, checked to run from 0 to R."""
    if type(n) is not int or not 0 <= n <= 2**48 or len(data) != (n + 1) * 8:
        raise ValueError(f"shm jagged inline offsets: {len(data)} bytes for N={n!r} rows")
    offsets_N1 = torch.frombuffer(bytearray(data), dtype=torch.int64)
    _check_offsets(offsets_N1.numpy(), r, ValueError, "shm inline offsets")
    return offsets_N1


def _dtype(name: Any) -> torch.dtype:
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > 32:
        raise ValueError(f"shape {shape!r} must be a list of <= 32 dims")
    if not all(type(d) is int and 0 <= d <= 2**48 for d in shape):
        raise ValueError(f"shape {shape!r} must hold non-negative ints <= 2**48")
    return tuple(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def fields_nbytes(fields: Mapping[str, Any]) -> int:
    """Bytes of the tensor data in a put's fields (dense, nested jagged or JaggedColumn)."""
    total = 0
    for value in fields.values():
        if isinstance(value, JaggedColumn):
            total += value.values.numel() * value.values.element_size() + value.offsets.numel() * 8
        elif isinstance(value, torch.Tensor):
            if value.is_nested:
                values = value.values()
                total += values.numel() * values.element_size() + (value.size(0) + 1) * 8
            else:
                total += value.numel() * value.element_size()
    return total


def _as_columns(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Nested jagged tensors as ``JaggedColumn``; other values as they are."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if is_jagged(value):
            values, offsets = _nested_values_offsets(value)
            value = JaggedColumn(values, offsets)
        elif isinstance(value, torch.Tensor) and value.is_nested:
            raise ValueError(f"field {name!r}: only torch.jagged nested tensors travel")
        out[name] = value
    return out


def fields_layout_bytes(fields: Mapping[str, Any]) -> int:
    """Bytes a shared-memory region needs for a put's tensor fields (each buffer 64-aligned)."""
    sizes: list[int] = []
    for value in _as_columns(fields).values():
        if isinstance(value, JaggedColumn):
            v = value.values
            sizes += [v.numel() * v.element_size(), value.offsets.numel() * 8]
        elif isinstance(value, torch.Tensor):
            sizes.append(value.numel() * value.element_size())
    return ShmSegment.layout_bytes(sizes)


def fields_into_region(fields: Mapping[str, Any], region: ShmRegion) -> dict[str, Any]:
    """Place every tensor field in a reserved region; return the fields as ``ShmField`` s.

    Tensors already inside the region (built with ``region.empty``) are referenced where they
    are; the others are copied in (one memcpy each). Non-tensor values are kept as they are.

    Args:
        fields: name -> dense tensor, ``torch.jagged`` nested tensor or ``JaggedColumn``.
        region: the reservation (``QueueClient.reserve``).

    Returns:
        The fields with tensors replaced by ``ShmField``.

    Raises:
        ValueError: a dtype without a wire name, a nested tensor that cannot travel, or a region
            too small (``fields_layout_bytes`` says how much is needed).
    """
    out: dict[str, Any] = {}
    for name, value in _as_columns(fields).items():
        if isinstance(value, JaggedColumn):
            out[name] = ShmField(region.write_jagged(value))
        elif isinstance(value, torch.Tensor):
            out[name] = ShmField(region.write(value))
        else:
            out[name] = value
    return out


def fields_to_shm(fields: Mapping[str, Any]) -> tuple[ShmSegment, dict[str, Any]]:
    """Write every tensor field into ONE new segment; return it and the fields as ``ShmField`` s.

    Non-tensor values are kept as they are. The caller closes and unlinks the segment once the
    receiver answered (a receiver that adopted it has unlinked it already).

    Args:
        fields: name -> dense tensor, ``torch.jagged`` nested tensor or ``JaggedColumn``.

    Returns:
        ``(segment, fields)`` with tensors replaced by ``ShmField``.

    Raises:
        ValueError: a dtype without a wire name, or a nested tensor that cannot travel.
        OSError: /dev/shm missing or full (nothing is left behind).
    """
    names, tensors = [], []
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if is_jagged(value):
            values, offsets = _nested_values_offsets(value)
            value = JaggedColumn(values, offsets)
        elif isinstance(value, torch.Tensor) and value.is_nested:
            raise ValueError(f"field {name!r}: only torch.jagged nested tensors travel")
        if isinstance(value, JaggedColumn | torch.Tensor):
            names.append(name)
            tensors.append(value)
        else:
            out[name] = value
    segment, handles = write_tensors(tensors)
    for name, handle in zip(names, handles):
        out[name] = ShmField(handle)
    segment.close()
    return segment, out
