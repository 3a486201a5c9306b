"""CUDA IPC tensor handles: export a persistent GPU buffer once, open slots of it in other processes.

Legend: S slots of a persistent buffer (one sample each), D... the per-slot dims.

A teacher allocates one persistent buffer ``[S, *D]`` on its GPU, exports it once
(``CudaIpcHandle.export``) and, per sample, publishes ``handle.slot(i).to_dict()`` (a small
msgpack-able dict: bytes, ints, strs). A trainer on the same host rebuilds slot ``i`` as a
zero-copy view with ``open()``.

Rules:
  * Export once, open many: a process opens each exported buffer once (cached for the life of
    the process, ``release_cache`` drops the cache), which is how the CUDA IPC reference
    counter torch keeps for the producer stays balanced (one export, one importer release).
  * The producer must keep the buffer alive while handles are out, and must finish its writes
    before it publishes a handle (``torch.cuda.current_stream().synchronize()`` or an event the
    consumer waits on): the IPC event only covers work queued before the export.
  * In the exporting process itself ``open`` returns a view of the original buffer (CUDA does
    not let a process import its own allocation).

Nothing is unpickled: the handle carries ``storage._share_cuda_()``'s fields and the view's
size, stride and offset; ``open`` checks them against the storage size before building a view.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from xtoken_core.jagged import DTYPE_NAMES, WIRE_DTYPES

MAX_NDIM = 32
# (IPC handle, storage offset) -> storage, for buffers exported or opened by this process.
_EXPORTED: dict[tuple[bytes, int], torch.UntypedStorage] = {}
_OPENED: dict[tuple[bytes, int], torch.UntypedStorage] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class CudaIpcHandle:
    """An exported CUDA tensor (a view of an IPC-shared storage), optionally one slot of it.

    Attributes:
        pid: the exporting process.
        device: CUDA device index of the storage.
        handle: cudaIpcMemHandle bytes of the allocation.
        storage_size: bytes of the storage.
        storage_offset: byte offset of the storage inside the allocation.
        ref_counter_handle: torch's IPC ref-counter file name (bytes).
        ref_counter_offset: slot in that file.
        event_handle: IPC event handle bytes (or None).
        event_sync_required: whether the importer must wait on that event.
        dtype: a wire dtype.
        shape: the exported view's shape ``[S, *D]``.
        stride: its strides, in elements.
        offset: its offset in the storage, in elements.
        index: a slot ``i`` (``open`` returns ``view[i]``) or None for the whole view.
    """

    pid: int
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    index: int | None = None

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaIpcHandle:
        """Export a CUDA tensor (usually a persistent buffer ``[S, *D]``).

        Args:
            tensor: a strided CUDA tensor of a wire dtype; keep it alive while handles are out.

        Returns:
            The handle of the whole view (``slot(i)`` narrows it to one sample).

        Raises:
            ValueError: not a CUDA tensor, or a dtype that has no wire name.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"CUDA IPC exports CUDA tensors only, got {where}; use shm on CPU")
        if tensor.dtype not in DTYPE_NAMES or tensor.layout != torch.strided:
            raise ValueError(
                f"cannot export a {tensor.layout} tensor of {tensor.dtype}; use a strided tensor "
                f"of one of {sorted(WIRE_DTYPES)}"
            )
        storage = tensor.untyped_storage()
        (
            device,
            handle,
            storage_size,
            storage_offset,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = storage._share_cuda_()
        with _LOCK:
            _EXPORTED[(bytes(handle), int(storage_offset))] = storage
        return cls(
            pid=os.getpid(),
            device=int(device),
            handle=bytes(handle),
            storage_size=int(storage_size),
            storage_offset=int(storage_offset),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=None if event_handle is None else bytes(event_handle),
            event_sync_required=bool(event_sync_required),
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            offset=int(tensor.storage_offset()),
        )

    def slot(self, index: int) -> CudaIpcHandle:
        """The handle of slot ``index`` of the exported view (``view[index]``).

        Raises:
            ValueError: ``index`` outside ``[0, S)`` or a 0-d export.
        """
        if not self.shape or not (type(index) is int and 0 <= index < self.shape[0]):
            raise ValueError(
                f"slot index {index!r} is outside [0, {self.shape[0] if self.shape else 0}) of "
                f"the exported buffer of shape {list(self.shape)}"
            )
        return replace(self, index=index)

    def to_dict(self) -> dict[str, Any]:
        """The msgpack-able description ``{kind: "cuda", ...}``."""
        return {
            "kind": "cuda",
            "pid": self.pid,
            "device": self.device,
            "handle": self.handle,
            "storage_size": self.storage_size,
            "storage_offset": self.storage_offset,
            "ref_counter_handle": self.ref_counter_handle,
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": self.event_handle,
            "event_sync_required": self.event_sync_required,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
            "index": self.index,
        }

    @classmethod
    def from_dict(cls, d: Any) -> CudaIpcHandle:
        """Parse and check a handle received from another process (touches no GPU).

        Raises:
            ValueError: a missing key or wrong kind, an unknown dtype, or a view that reaches
                outside its storage.
        """
        if not isinstance(d, dict) or d.get("kind") != "cuda":
            raise ValueError(f"not a CUDA IPC handle: {str(d)[:200]}; expected {{kind: 'cuda'}}")
        ints = ("pid", "device", "storage_size", "storage_offset", "ref_counter_offset", "offset")
        for key in ints:
            if type(d.get(key)) is not int or d[key] < 0:
                raise ValueError(f"CUDA IPC handle {key}={d.get(key)!r}: a non-negative int")
        for key in ("handle", "ref_counter_handle"):
            if not isinstance(d.get(key), bytes) or not d[key]:
                raise ValueError(f"CUDA IPC handle {key} must be non-empty bytes")
        if d.get("event_handle") is not None and not isinstance(d["event_handle"], bytes):
            raise ValueError("CUDA IPC handle event_handle must be bytes or None")
        dtype = WIRE_DTYPES.get(d.get("dtype")) if isinstance(d.get("dtype"), str) else None
        if dtype is None:
            raise ValueError(f"CUDA IPC handle dtype {d.get('dtype')!r} is not a wire dtype")
        shape, stride = d.get("shape"), d.get("stride")
        if (
            not isinstance(shape, list)
            or not isinstance(stride, list)
            or len(shape) != len(stride)
            or len(shape) > MAX_NDIM
            or not all(type(s) is int and 0 <= s <= 2**48 for s in shape + stride)
        ):
            raise ValueError(f"CUDA IPC handle shape {shape!r} / stride {stride!r} do not match")
        index = d.get("index")
        h = cls(
            pid=d["pid"],
            device=d["device"],
            handle=d["handle"],
            storage_size=d["storage_size"],
            storage_offset=d["storage_offset"],
            ref_counter_handle=d["ref_counter_handle"],
            ref_counter_offset=d["ref_counter_offset"],
            event_handle=d.get("event_handle"),
            event_sync_required=bool(d.get("event_sync_required")),
            dtype=dtype,
            shape=tuple(shape),
            stride=tuple(stride),
            offset=d["offset"],
        )
        if math.prod(shape):
            last = d["offset"] + sum((s - 1) * st for s, st in zip(shape, stride))
            if (last + 1) * dtype.itemsize > d["storage_size"]:
                raise ValueError(
                    f"CUDA IPC handle view (offset {d['offset']}, shape {shape}, stride {stride}) "
                    f"reaches past its {d['storage_size']}-byte storage"
                )
        return h if index is None else h.slot(index)

    def open(self) -> torch.Tensor:
        """Return the exported view (or its slot) as a zero-copy CUDA tensor in this process.

        Returns:
            ``[S, *D]`` for the whole view, ``[*D]`` for a slot.

        Raises:
            ValueError: the handle does not fit its storage.
            RuntimeError: CUDA refuses the handle (another host, the producer is gone).
        """
        key = (self.handle, self.storage_offset)
        with _LOCK:
            storage = _EXPORTED.get(key) if self.pid == os.getpid() else None
            if storage is None:
                storage = _OPENED.get(key)
            if storage is None:
                torch.cuda._lazy_init()
                storage = torch.UntypedStorage._new_shared_cuda(
                    self.device,
                    self.handle,
                    self.storage_size,
                    self.storage_offset,
                    self.ref_counter_handle,
                    self.ref_counter_offset,
                    self.event_handle,
                    self.event_sync_required,
                )
                _OPENED[key] = storage
        if storage.nbytes() < self.storage_size:
            raise ValueError(
                f"CUDA IPC storage is {storage.nbytes()} bytes, the handle says {self.storage_size}"
            )
        view = torch.empty(0, dtype=self.dtype, device=storage.device)
        view.set_(storage, self.offset, self.shape, self.stride)
        return view if self.index is None else view[self.index]


def forget(handle: CudaIpcHandle) -> bool:
    """Drop this process's cached export or import of ``handle``'s storage (views already made
    stay valid; the memory goes when they do). A ring that is closed or whose producer died
    calls this so that its buffer is not kept for the life of the process.

    Args:
        handle: a handle of the buffer (any slot of it).

    Returns:
        True when a cached storage was dropped.
    """
    key = (handle.handle, handle.storage_offset)
    with _LOCK:
        opened = _OPENED.pop(key, None)
        exported = _EXPORTED.pop(key, None) if handle.pid == os.getpid() else None
    return opened is not None or exported is not None


def release_cache() -> int:
    """Drop this process's references to imported buffers (views already made stay valid).

    Returns:
        How many imported storages were dropped.
    """
    with _LOCK:
        n = len(_OPENED)
        _OPENED.clear()
    return n
