"""encode_message / decode_message: one message <-> a list of ZMQ frames (zero-copy tensors).

Frame layout (proto/PROTOCOL.md has the diagrams):
  frame 0      16-byte header (magic, version, flags, type code, request id), see header.py
  frame 1      msgpack map: the body; tensors are msgpack ext values (codes below)
  frames 2..n  raw little-endian tensor buffers, each referenced by exactly one ext value

Ext values (their payload is itself a msgpack array):
  EXT_TENSOR=1  [dtype: str, shape: [uint...], data]
  EXT_JAGGED=2  [dtype: str, inner_shape: [uint...], num_rows N, total_rows R, values_data,
                 offsets_data]   values [R, *inner] of dtype, offsets [N+1] int64
  data is either a frame index (uint >= 2) or inline bytes (msgpack bin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from xtoken_core.wire.errors import (
    BAD_BODY,
    BAD_FRAMES,
    DEFAULT_LIMITS,
    TOO_LARGE,
    WireError,
    WireLimits,
)
from xtoken_core.wire.header import pack_header, unpack_header
from xtoken_core.wire.shm import SHM_EXT_CODES, ShmField, ShmReader, decode_shm_ext
from xtoken_core.wire.tensors import (
    DTYPE_NAMES,
    WIRE_DTYPES,
    JaggedColumn,
    RawJagged,
    RawTensor,
    _check_offsets,
    _nested_values_offsets,
    as_wire_tensor,
    num_bytes,
    tensor_bytes,
    tensor_from_buffer,
)

EXT_TENSOR = 1
EXT_JAGGED = 2
# Buffers smaller than this travel inline in the msgpack body (one frame each costs more).
INLINE_MAX_BYTES = 1024
# Containers nested deeper than this are refused (bounds recursion on both sides).
MAX_DEPTH = 64
# A dimension larger than this is refused on decode, before any arithmetic on it.
_MAX_DIM = 2**48
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1

Frame = bytes | bytearray | memoryview

# Fast-path tables. torch dtype -> (wire name, itemsize, tensor.numpy() works for it).
_FAST_DTYPES: dict[torch.dtype, tuple[str, int, bool]] = {
    dtype: (name, dtype.itemsize, dtype != torch.bfloat16) for dtype, name in DTYPE_NAMES.items()
}
_PLAIN_TYPES = (str, float, bool, type(None))
# Types a decoded body may hold besides dict and list (exact types; subclasses take the slow path).
_LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes, torch.Tensor, JaggedColumn})
# Offsets of at most this many entries are checked in Python (cheaper than numpy for few rows).
_SMALL_OFFSETS = 256


class _Slow(Exception):
    """The fast encoder met something unusual: redo the message on the checked, path-naming path."""


@dataclass
class Message:
    """One decoded message.

    Attributes:
        msg_type: a name from ``MESSAGE_TYPES``.
        request_id: the id the reply echoes.
        body: the body dict; tensors are ``torch.Tensor``, jagged fields ``torch.jagged`` nested
            tensors (or ``JaggedColumn`` with ``decode_message(..., jagged="column")``).
    """

    msg_type: str
    request_id: int = 0
    body: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- encode


class _Encoder:
    def __init__(self, limits: WireLimits, inline_max_bytes: int) -> None:
        self.limits = limits
        self.inline_max_bytes = inline_max_bytes
        self.buffers: list[memoryview] = []
        self.buffer_bytes = 0

    def place(self, buf: memoryview, path: str) -> int | bytes:
        """Return inline bytes or the index of a new frame for ``buf``."""
        if buf.nbytes < self.inline_max_bytes:
            return bytes(buf)
        self.buffers.append(buf)
        self.buffer_bytes += buf.nbytes
        if 2 + len(self.buffers) > self.limits.max_frames:
            raise WireError(
                TOO_LARGE,
                f"message needs more than max_frames={self.limits.max_frames} frames (at {path}); "
                "send fewer tensors per message or raise WireLimits.max_frames",
            )
        if self.buffer_bytes > self.limits.max_message_bytes:
            raise WireError(
                TOO_LARGE,
                f"tensor buffers exceed max_message_bytes={self.limits.max_message_bytes} (at "
                f"{path}); send smaller batches or raise WireLimits.max_message_bytes",
            )
        return len(self.buffers) + 1

    # The fast path: plain bodies and CPU tensors, no per-value path strings, no torch op beyond
    # .numpy(). Anything unusual raises _Slow and the message is redone by ``value`` (below),
    # which checks everything and names the offending path.

    def fast(self, x: Any, depth: int) -> Any:
        t = type(x)
        if t is dict:
            if depth >= MAX_DEPTH:
                raise _Slow
            out = {}
            for k, v in x.items():
                if type(k) is not str:
                    raise _Slow
                tv = type(v)
                if tv in _PLAIN_TYPES:
                    out[k] = v
                elif tv is int:
                    if not _INT_MIN <= v <= _INT_MAX:
                        raise _Slow
                    out[k] = v
                else:
                    out[k] = self.fast(v, depth + 1)
            return out
        if t is list or t is tuple:
            if depth >= MAX_DEPTH:
                raise _Slow
            for v in x:
                if type(v) is not str:
                    break
            else:
                return x  # a list of str (keys, field names): as is
            return [self.fast(v, depth + 1) for v in x]
        if t in _PLAIN_TYPES:
            return x
        if t is int:
            if not _INT_MIN <= x <= _INT_MAX:
                raise _Slow
            return x
        if t is RawJagged:
            return self.raw_jagged(x, "")
        if t is JaggedColumn:
            return self.fast_jagged(x.values, x.offsets)
        if t is torch.Tensor:
            name, data = self.fast_tensor(x)
            payload = msgpack.packb([name, list(x.shape), data], use_bin_type=True)
            return msgpack.ExtType(EXT_TENSOR, payload)
        if t is RawTensor:
            return self.raw_tensor(x, "")
        if t is bytes:
            return x
        if t is ShmField:
            return x.to_ext()
        raise _Slow

    def fast_tensor(self, x: torch.Tensor) -> tuple[str, int | bytes]:
        """(wire dtype name, placed data) of a plain CPU tensor, or _Slow."""
        info = _FAST_DTYPES.get(x.dtype)
        if (
            info is None
            or not x.is_cpu
            or x.requires_grad
            or x.is_nested
            or x.ndim > self.limits.max_ndim
            or not x.is_contiguous()
        ):
            raise _Slow
        name, itemsize, numpy_ok = info
        nbytes = x.numel() * itemsize
        if nbytes < self.inline_max_bytes and numpy_ok:
            return name, x.numpy().tobytes()
        return name, self.place(tensor_bytes(x), "")

    def fast_jagged(self, values: torch.Tensor, offsets: torch.Tensor) -> msgpack.ExtType:
        if type(values) is not torch.Tensor or type(offsets) is not torch.Tensor:
            raise _Slow
        if offsets.dtype != torch.int64 or values.ndim < 1:
            raise _Slow
        name, values_data = self.fast_tensor(values)
        _, offsets_data = self.fast_tensor(offsets)
        shape = list(values.shape)
        payload = msgpack.packb(
            [name, shape[1:], offsets.numel() - 1, shape[0], values_data, offsets_data],
            use_bin_type=True,
        )
        return msgpack.ExtType(EXT_JAGGED, payload)

    def raw_data(self, data: Any, expected: int, what: str, path: str) -> int | bytes:
        buf = data if type(data) is bytes else memoryview(data).cast("B")
        if len(buf) != expected:
            raise ValueError(
                f"{what} at {path or 'body'} holds {len(buf)} bytes, its dtype and shape need "
                f"{expected}; build it from the tensor's own bytes"
            )
        if len(buf) < self.inline_max_bytes:
            return bytes(buf)
        return self.place(buf if type(buf) is memoryview else memoryview(buf), path)

    def raw_tensor(self, x: RawTensor, path: str) -> msgpack.ExtType:
        name = DTYPE_NAMES.get(x.dtype)
        if name is None or len(x.shape) > self.limits.max_ndim:
            raise TypeError(f"RawTensor of dtype {x.dtype} at {path or 'body'} cannot travel")
        data = self.raw_data(x.data, num_bytes(x.shape, x.dtype), "RawTensor data", path)
        payload = msgpack.packb([name, list(x.shape), data], use_bin_type=True)
        return msgpack.ExtType(EXT_TENSOR, payload)

    def raw_jagged(self, x: RawJagged, path: str) -> msgpack.ExtType:
        name = DTYPE_NAMES.get(x.dtype)
        if name is None or len(x.inner_shape) + 1 > self.limits.max_ndim:
            raise TypeError(f"RawJagged of dtype {x.dtype} at {path or 'body'} cannot travel")
        values_data = self.raw_data(
            x.values,
            num_bytes((x.total_rows, *x.inner_shape), x.dtype),
            "RawJagged values",
            path,
        )
        offsets_data = self.raw_data(x.offsets, (x.num_rows + 1) * 8, "RawJagged offsets", path)
        payload = msgpack.packb(
            [
                name,
                list(x.inner_shape),
                x.num_rows,
                x.total_rows,
                values_data,
                offsets_data,
            ],
            use_bin_type=True,
        )
        return msgpack.ExtType(EXT_JAGGED, payload)

    def tensor(self, x: Any, path: str) -> msgpack.ExtType:
        t = as_wire_tensor(x, path)
        if t.ndim > self.limits.max_ndim:
            raise WireError(BAD_BODY, f"tensor at {path} has {t.ndim} dims > max_ndim")
        data = self.place(tensor_bytes(t), path)
        payload = msgpack.packb([DTYPE_NAMES[t.dtype], list(t.shape), data], use_bin_type=True)
        return msgpack.ExtType(EXT_TENSOR, payload)

    def jagged(self, values: torch.Tensor, offsets: torch.Tensor, path: str) -> msgpack.ExtType:
        values = as_wire_tensor(values, path)
        offsets = as_wire_tensor(offsets.to(torch.int64), path)
        if values.ndim < 1 or values.ndim > self.limits.max_ndim:
            raise WireError(BAD_BODY, f"jagged values at {path} have {values.ndim} dims")
        values_data = self.place(tensor_bytes(values), path)
        offsets_data = self.place(tensor_bytes(offsets), path)
        payload = msgpack.packb(
            [
                DTYPE_NAMES[values.dtype],
                list(values.shape[1:]),
                offsets.numel() - 1,
                values.shape[0],
                values_data,
                offsets_data,
            ],
            use_bin_type=True,
        )
        return msgpack.ExtType(EXT_JAGGED, payload)

    def value(self, x: Any, path: str, depth: int) -> Any:
        if x is None or isinstance(x, bool | float | str):
            return x
        if isinstance(x, int):
            if not _INT_MIN <= x <= _INT_MAX:
                raise TypeError(f"int {x} at {path} does not fit 64 bits; send it as a str")
            return x
        if depth > MAX_DEPTH:
            raise WireError(BAD_BODY, f"body nests deeper than {MAX_DEPTH} at {path}")
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"dict key {k!r} ({type(k).__name__}) at {path}: keys must be str"
                    )
                out[k] = self.value(v, f"{path}.{k}", depth + 1)
            return out
        if isinstance(x, list | tuple):
            return [self.value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]
        if isinstance(x, bytes | bytearray):
            return bytes(x)
        if isinstance(x, JaggedColumn):
            return self.jagged(x.values, x.offsets, path)
        if isinstance(x, RawJagged):
            return self.raw_jagged(x, path)
        if isinstance(x, RawTensor):
            return self.raw_tensor(x, path)
        if isinstance(x, torch.Tensor):
            if x.is_nested:
                try:
                    values, offsets = _nested_values_offsets(x)
                except ValueError as e:
                    raise TypeError(f"nested tensor at {path}: {e}") from None
                return self.jagged(values, offsets, path)
            return self.tensor(x, path)
        if isinstance(x, np.ndarray):
            return self.tensor(x, path)
        if isinstance(x, ShmField):
            return x.to_ext()
        if isinstance(x, np.generic) and x.dtype.kind in "biuf":
            return self.value(x.item(), path, depth)
        raise TypeError(
            f"{type(x).__module__}.{type(x).__qualname__} at {path} cannot travel on the wire; "
            "use None, bool, int, float, str, bytes, list, dict, torch.Tensor, a torch.jagged "
            "nested tensor or JaggedColumn (nothing is pickled)"
        )


def encode_message(
    msg_type: str,
    body: dict[str, Any],
    *,
    request_id: int = 0,
    limits: WireLimits | None = None,
    inline_max_bytes: int = INLINE_MAX_BYTES,
) -> list[bytes | memoryview]:
    """Encode one message as ZMQ frames; tensor frames alias the tensors' memory (zero copy).

    Keep the tensors unmodified until the frames are sent (``zmq`` ``send_multipart(...,
    copy=False)`` keeps them referenced). Non-contiguous or non-CPU tensors are copied once.

    Args:
        msg_type: a name from ``MESSAGE_TYPES``.
        body: str-keyed dict of None, bool, int, float, str, bytes, list/tuple, dict,
            torch.Tensor (wire dtypes, any shape), numeric np.ndarray, torch.jagged nested
            tensor ``[N, j, *D]`` or JaggedColumn. Tuples decode as lists, numpy as torch.
        request_id: 0 <= id < 2**64, echoed by the reply.
        limits: bounds to enforce (``WireLimits()`` by default).
        inline_max_bytes: buffers with fewer bytes travel inside the body; 0 sends every
            buffer as its own frame.

    Returns:
        ``[header, body, *tensor_buffers]``.

    Raises:
        WireError: ``unknown_type``, ``bad_header`` (request id), ``too_large``, ``bad_body``
            (nesting too deep).
        TypeError: a value of an unsupported type or dtype (the message names its path).
    """
    limits = limits or DEFAULT_LIMITS
    header = pack_header(msg_type, request_id)
    if not isinstance(body, dict):
        raise TypeError(f"message body must be a dict, got {type(body).__name__}")
    enc = _Encoder(limits, inline_max_bytes)
    try:
        packed_body = msgpack.packb(enc.fast(body, 0), use_bin_type=True)
    except (_Slow, WireError, TypeError, ValueError):
        # Unusual input or an error: the checked path raises it again, naming the value's path.
        enc = _Encoder(limits, inline_max_bytes)
        packed_body = msgpack.packb(enc.value(body, "body", 0), use_bin_type=True)
    if len(packed_body) > limits.max_body_bytes:
        raise WireError(
            TOO_LARGE,
            f"{msg_type} body is {len(packed_body)} bytes > max_body_bytes="
            f"{limits.max_body_bytes}; send large tensors as frames (lower inline_max_bytes) "
            "or raise WireLimits.max_body_bytes",
        )
    total = len(header) + len(packed_body) + enc.buffer_bytes
    if total > limits.max_message_bytes:
        raise WireError(
            TOO_LARGE,
            f"{msg_type} message is {total} bytes > max_message_bytes="
            f"{limits.max_message_bytes}; send smaller batches or raise the limit",
        )
    return [header, packed_body, *enc.buffers]


# ---------------------------------------------------------------------------------- decode


def _as_bytes_view(frame: Any, index: int) -> memoryview:
    try:
        mv = memoryview(frame)
    except TypeError:
        buffer = getattr(frame, "buffer", None)  # zmq.Frame
        if buffer is None:
            raise WireError(
                BAD_FRAMES, f"frame {index} is a {type(frame).__name__}, not a bytes-like buffer"
            ) from None
        mv = memoryview(buffer)
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except (TypeError, ValueError):
            raise WireError(BAD_FRAMES, f"frame {index} is not a contiguous byte buffer") from None
    return mv


def _bad(message: str) -> WireError:
    return WireError(BAD_BODY, message)


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class _Decoder:
    def __init__(
        self, frames: list[memoryview], limits: WireLimits, copy: bool, jagged: str, shm: Any
    ):
        self.frames = frames
        self.shm: bool | ShmReader = shm  # a ShmReader once the first shm ext is adopted
        self.limits = limits
        self.copy = copy
        self.as_column = jagged == "column"
        self.used: set[int] = set()

    def buffer(self, data: Any, what: str) -> tuple[memoryview, bool]:
        """Return (buffer, inline) for a descriptor's data field."""
        if isinstance(data, bytes):
            return memoryview(data), True
        if not _is_uint(data):
            raise _bad(f"{what}: data must be a frame index or bytes, got {type(data).__name__}")
        if not 2 <= data < len(self.frames):
            raise WireError(
                BAD_FRAMES, f"{what}: frame index {data} out of range [2, {len(self.frames)})"
            )
        if data in self.used:
            raise WireError(BAD_FRAMES, f"{what}: frame {data} is referenced twice")
        self.used.add(data)
        return self.frames[data], False

    def dtype(self, name: Any, what: str) -> torch.dtype:
        dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise _bad(f"{what}: unknown dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
        return dtype

    def shape(self, shape: Any, what: str) -> tuple[int, ...]:
        if not isinstance(shape, list) or len(shape) > self.limits.max_ndim:
            raise _bad(f"{what}: shape must be a list of <= {self.limits.max_ndim} dims")
        if not all(_is_uint(d) and d <= _MAX_DIM for d in shape):
            raise _bad(f"{what}: shape {shape!r} must hold non-negative ints <= 2**48")
        if math.prod(max(d, 1) for d in shape) > _MAX_DIM:
            # zero-size shapes still need strides that fit int64
            raise _bad(f"{what}: shape {shape!r} spans more than 2**48 elements")
        return tuple(shape)

    def make_tensor(
        self, placed: tuple[memoryview, bool], dtype: torch.dtype, shape: tuple[int, ...], what: str
    ) -> torch.Tensor:
        buf, inline = placed
        expected = num_bytes(shape, dtype)
        if buf.nbytes != expected:
            raise WireError(
                BAD_FRAMES,
                f"{what}: buffer is {buf.nbytes} bytes, shape {list(shape)} of {dtype} needs "
                f"{expected}",
            )
        if dtype == torch.bool and buf.nbytes and int(np.frombuffer(buf, np.uint8).max()) > 1:
            raise _bad(f"{what}: bool tensor holds bytes other than 0 and 1")
        if inline and expected:
            # Inline bytes are small: copy them so the tensor is writable; a fresh bytearray is
            # malloc-aligned, and one frombuffer (plus a view for ndim != 1) is all torch does.
            flat = torch.frombuffer(bytearray(buf), dtype=dtype)
            return flat if len(shape) == 1 else flat.view(shape)
        return tensor_from_buffer(buf, dtype, shape, copy=self.copy or inline)

    def ext_hook(self, code: int, data: bytes) -> Any:
        try:
            fields = msgpack.unpackb(data, raw=False, use_list=True, ext_hook=_no_ext)
        except WireError:
            raise
        except Exception as e:
            raise _bad(f"ext {code} payload is not valid msgpack: {e}") from None
        if code == EXT_TENSOR:
            if not isinstance(fields, list) or len(fields) != 3:
                raise _bad("tensor ext must be [dtype, shape, data]")
            dtype = self.dtype(fields[0], "tensor")
            shape = self.shape(fields[1], "tensor")
            return self.make_tensor(self.buffer(fields[2], "tensor"), dtype, shape, "tensor")
        if code == EXT_JAGGED:
            if not isinstance(fields, list) or len(fields) != 6:
                raise _bad("jagged ext must be [dtype, inner_shape, N, R, values, offsets]")
            dtype = self.dtype(fields[0], "jagged")
            inner = self.shape(fields[1], "jagged")
            n, r = fields[2], fields[3]
            if not (_is_uint(n) and _is_uint(r) and n <= _MAX_DIM and r <= _MAX_DIM):
                raise _bad(f"jagged: N={n!r} and R={r!r} must be non-negative ints")
            if len(inner) + 1 > self.limits.max_ndim:
                raise _bad("jagged: too many dims")
            values = self.make_tensor(
                self.buffer(fields[4], "jagged values"), dtype, (r, *inner), "jagged values"
            )
            offsets = self.make_tensor(
                self.buffer(fields[5], "jagged offsets"), torch.int64, (n + 1,), "jagged offsets"
            )
            if n < _SMALL_OFFSETS:
                _check_small_offsets(offsets.tolist(), r)
            else:
                _check_offsets(offsets.numpy(), r, _bad)
            column = JaggedColumn.__new__(JaggedColumn)  # already validated: skip __post_init__
            column.values, column.offsets = values, offsets
            return column if self.as_column else column.to_nested()
        if code in SHM_EXT_CODES and self.shm:
            if self.shm is True:
                self.shm = ShmReader()
            return decode_shm_ext(code, fields, self.shm, self.as_column)
        raise _bad(f"unknown ext type {code}")

    def check(self, x: Any, depth: int) -> None:
        """Refuse anything but the body value types, and non-str keys."""
        t = type(x)
        if t is dict:
            if depth > MAX_DEPTH:
                raise _bad(f"body nests deeper than {MAX_DEPTH}")
            for k, v in x.items():
                if type(k) is not str:
                    raise _bad(f"dict key {k!r} is not a str")
                tv = type(v)
                if tv is dict or tv is list or tv not in _LEAF_TYPES:
                    self.check(v, depth + 1)
        elif t is list:
            if depth > MAX_DEPTH:
                raise _bad(f"body nests deeper than {MAX_DEPTH}")
            for v in x:
                tv = type(v)
                if tv is dict or tv is list or tv not in _LEAF_TYPES:
                    self.check(v, depth + 1)
        elif t not in _LEAF_TYPES and not isinstance(x, torch.Tensor):
            raise _bad(f"body holds a {t.__name__}, which is not a wire value")


def _check_small_offsets(offsets: list[int], total: int) -> None:
    """``_check_offsets`` for a few rows, in Python (no numpy round trip)."""
    if offsets[0] != 0 or offsets[-1] != total:
        raise _bad(
            f"jagged offsets run from {offsets[0]} to {offsets[-1]}; they must run from 0 to "
            f"the {total} value rows"
        )
    prev = 0
    for o in offsets:
        if o < prev:
            raise _bad("jagged offsets decrease; row lengths must be >= 0")
        prev = o


def _no_ext(code: int, data: bytes) -> Any:
    raise _bad(f"ext {code} nested inside a tensor descriptor")


def decode_message(
    frames: Sequence[Any],
    *,
    limits: WireLimits | None = None,
    copy: bool = False,
    jagged: str = "nested",
    shm: bool | ShmReader = False,
) -> Message:
    """Decode ZMQ frames into a Message; tensors alias the frames' memory unless ``copy``.

    Zero copy: tensors are ``torch.frombuffer`` views of the received frames, so they share
    the frames' lifetime and, for read-only buffers (``bytes``), must not be written to (torch
    does not enforce read-only tensors). Pass ``copy=True`` for tensors with their own
    writable memory. Inline (small) tensors are always copied.

    Args:
        frames: ``[header, body, *buffers]``: bytes, bytearray, memoryview, zmq.Frame or any
            buffer-protocol object.
        limits: bounds to enforce (``WireLimits()`` by default).
        copy: copy every tensor buffer instead of aliasing it.
        jagged: ``"nested"`` (default) rebuilds jagged fields as ``torch.jagged`` nested
            tensors ``[N, j, *D]``; ``"column"`` as ``JaggedColumn`` (what a server that slices
            rows per key wants).
        shm: accept shared-memory tensors (ext 3/4, xtoken_core/wire/shm.py): ``True`` adopts
            their segments (maps and unlinks them); a ``ShmReader`` opens them its way (a
            server's own pool, a client's cache of mappings; its ``refs`` then list what was
            opened). Off, they are ``bad_body``. Same-host receivers only.

    Returns:
        The message.

    Raises:
        WireError: ``bad_frames``, ``too_large``, ``bad_header``, ``bad_version``,
            ``unknown_type``, ``bad_body``; never any other exception for any input frames.
        ValueError: ``jagged`` is not ``"nested"`` or ``"column"`` (a caller bug).
    """
    if jagged not in ("nested", "column"):
        raise ValueError(f"jagged={jagged!r}: use 'nested' or 'column'")
    limits = limits or DEFAULT_LIMITS
    if type(frames) is not list and (
        isinstance(frames, str | bytes | bytearray | memoryview) or not isinstance(frames, Sequence)
    ):
        raise WireError(
            BAD_FRAMES, f"frames must be a sequence of buffers, got {type(frames).__name__}"
        )
    if len(frames) > limits.max_frames:
        raise WireError(
            TOO_LARGE, f"message has {len(frames)} frames > max_frames={limits.max_frames}"
        )
    if len(frames) < 2:
        raise WireError(BAD_FRAMES, f"message has {len(frames)} frames; needs header and body")
    views = [_as_bytes_view(f, i) for i, f in enumerate(frames)]
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise WireError(
            TOO_LARGE, f"message is {total} bytes > max_message_bytes={limits.max_message_bytes}"
        )
    if views[1].nbytes > limits.max_body_bytes:
        raise WireError(
            TOO_LARGE, f"body is {views[1].nbytes} bytes > max_body_bytes={limits.max_body_bytes}"
        )
    msg_type, request_id = unpack_header(views[0])
    dec = _Decoder(views, limits, copy, jagged, shm)
    try:
        body = msgpack.unpackb(
            views[1], raw=False, use_list=True, strict_map_key=True, ext_hook=dec.ext_hook
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types on garbage: all mean a bad body
        raise _bad(f"body is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise _bad(f"body must be a msgpack map, got {type(body).__name__}")
    dec.check(body, 0)
    if len(views) > 2 and len(dec.used) != len(views) - 2:
        unused = sorted(set(range(2, len(views))) - dec.used)
        raise WireError(BAD_FRAMES, f"frames {unused[:8]} are not referenced by the body")
    return Message(msg_type, request_id, body)
