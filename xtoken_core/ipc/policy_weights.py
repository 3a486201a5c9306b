"""The student's weights from the trainer to the rollout workers, published without stopping.

The trainer (one process: rank 0) publishes its parameters every ``sync_every`` optimizer steps
with a *version* (its step); a rollout worker copies the newest publication into its own copy of
the student between two generation batches. Neither side waits for the other: the publisher
writes the slot the readers are not reading, a reader copies the newest complete slot.

Both sides meet in a directory (the run's ``policy/``) that holds ``descriptor.msgpack``, written
atomically (temporary name, flushed to disk, then renamed) by each publisher: what the transport
is and where the weights are. A descriptor found damaged (bytes that do not decode) costs no run:
a reader keeps the publisher it has mapped, or has none yet and waits, with one warning naming
the file; the publisher writes its descriptor again at its next publication when the file no
longer holds it (and leaves a successor's alone). Transports:

* ``file``: ``weights.safetensors`` beside it, written whole under a temporary name and renamed,
  so a reader opens one complete version (its ``version`` is in the file's metadata). Works
  across nodes on a shared filesystem (a checkpoint path); costs a write and a read of the
  weights per publication.
* ``shm`` (CPU, one node): two slots of one flat buffer in a /dev/shm segment that both map.
* ``cuda_ipc`` (GPU, one node): two slots of one flat buffer on the trainer's GPU, exported once
  by CUDA IPC; the reader copies from it to its own GPU (the same one, or another over
  NVLink/PCIe).

The slot transports keep a small /dev/shm header of 8-byte words, one writer (the publisher):
``latest`` (the slot of the newest publication), and per slot a sequence counter ``gen`` (odd
while the slot is written) and the ``version`` it holds. Publishing: ``gen += 1`` (odd), copy the
weights into the slot that is not ``latest`` (``cuda_ipc``: then synchronize the stream, so the
bytes are in memory before the header says so), ``version``, ``gen += 1`` (even), ``latest``.
Reading (a seqlock): read ``gen`` of the ``latest`` slot (even), copy the slot, read ``gen`` again;
a change means the publisher overwrote the slot during the copy (it published twice meanwhile),
so the copy is thrown away and taken again. A reader never sees a torn version.

A new publisher (a restarted trainer) writes a new descriptor with a new ``instance``; readers
notice the file changed and map the new buffers. The publisher unlinks its segments on ``close``;
a killed one leaves ``xtk_<pid>_*`` files that ``shm.sweep_orphans`` removes.

Legend: P parameters (flat, all tensors end to end), S = 2 slots.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from xtoken_core.errors import SettingsError
from xtoken_core.ipc.cuda import CudaIpcHandle
from xtoken_core.ipc.shm import ShmReader, ShmSegment
from xtoken_core.jagged import DTYPE_NAMES, WIRE_DTYPES

logger = logging.getLogger(__name__)

TRANSPORTS = ("file", "shm", "cuda_ipc")
DESCRIPTOR = "descriptor.msgpack"
WEIGHTS_FILE = "weights.safetensors"
FORMAT = 1
MAGIC = 0x78746B57  # "xtkW"

# header words
W_MAGIC, W_FORMAT, W_INSTANCE, W_LATEST, W_CLOSED = 0, 1, 2, 3, 4
W_GEN = 5  # W_GEN + slot
W_VERSION = 7  # W_VERSION + slot
HEADER_WORDS = 9
SLOTS = 2
# each tensor starts at a multiple of this many bytes of the flat buffer
ALIGN_BYTES = 64
# torn copies retried before a read gives up until the next call
READ_ATTEMPTS = 4


@dataclass(frozen=True)
class Entry:
    """One tensor of the flat buffer: its name, shape and offset (in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n


def layout(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> tuple[list[Entry], int]:
    """The flat buffer's entries (every tensor at an aligned offset) and its length P.

    Args:
        named: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``.
        dtype: the buffer's dtype.

    Returns:
        ``(entries, P)``.
    """
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    entries, offset = [], 0
    for name, tensor in named:
        entries.append(Entry(name, tuple(tensor.shape), offset))
        offset += -(-tensor.numel() // step) * step
    return entries, offset


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` under a temporary name, flush it to disk, then rename it into place: a
    reader opens the old bytes or the new ones, whole, even after a crash of the machine."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_descriptor(data: bytes) -> tuple[dict[str, Any], list[Entry], torch.dtype]:
    """A descriptor's fields, its layout and dtype, from the bytes of its file.

    Args:
        data: the bytes of ``descriptor.msgpack``.

    Returns:
        ``(descriptor, entries, dtype)``.

    Raises:
        ValueError: the bytes are no descriptor of this format (damaged, or written by another
            format); the message says what is wrong with them.
    """
    try:
        d = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"not a weight descriptor of format {FORMAT}")
    if d.get("transport") not in TRANSPORTS or d.get("dtype") not in WIRE_DTYPES:
        raise ValueError(f"unknown transport {d.get('transport')!r} or dtype {d.get('dtype')!r}")
    try:
        entries = [
            Entry(str(n), tuple(int(s) for s in shape), int(o)) for n, shape, o in d["entries"]
        ]
        int(d["instance"]), int(d["numel"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"its layout does not read ({type(e).__name__}: {e})") from None
    return d, entries, WIRE_DTYPES[d["dtype"]]


class WeightPublisher:
    """The trainer's side: publishes its parameters under a version.

    Args:
        directory: where the descriptor (and the ``file`` transport's weights) go; created.
        named: ``(name, parameter)`` of the model to publish (its names and shapes fix the
            layout; every publication passes the same).
        transport: ``file``, ``shm`` or ``cuda_ipc``.

    Raises:
        ValueError: an unknown transport, ``cuda_ipc`` for parameters not on a CUDA device, or
            parameters of a dtype that has no wire name.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        transport: str,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: use one of {', '.join(TRANSPORTS)}")
        named = list(named)
        if not named:
            raise ValueError("no parameters to publish")
        self.dtype = named[0][1].dtype
        self.device = named[0][1].device
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"parameters of dtype {self.dtype} cannot be published")
        if transport == "cuda_ipc" and self.device.type != "cuda":
            raise ValueError(
                f"transport cuda_ipc needs parameters on a CUDA device, they are on "
                f"{self.device}; use shm on one CPU node or file across nodes"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.transport = transport
        self.instance = secrets.randbits(62)
        self.entries, self.numel = layout(named, self.dtype)
        self._names = [e.name for e in self.entries]
        self._segments: list[ShmSegment] = []
        self._header_H: torch.Tensor | None = None
        self._buffer_SP: torch.Tensor | None = None
        self._export: CudaIpcHandle | None = None
        self.version: int | None = None
        descriptor: dict[str, Any] = {
            "format": FORMAT,
            "transport": transport,
            "instance": self.instance,
            "pid": os.getpid(),
            "dtype": DTYPE_NAMES[self.dtype],
            "numel": self.numel,
            "entries": [[e.name, list(e.shape), e.offset] for e in self.entries],
        }
        if transport != "file":
            descriptor.update(self._allocate())
        self._closed = False
        # a publisher that is never closed (an exception, the interpreter exiting) still unlinks
        self._finalizer = weakref.finalize(self, _unlink_all, list(self._segments))
        self._descriptor = msgpack.packb(descriptor, use_bin_type=True)
        _write_atomic(self.directory / DESCRIPTOR, self._descriptor)
        logger.info(
            "[policy] publishing %d tensors (%.1f MiB, %s) by %s in %s",
            len(self.entries),
            self.numel * self.dtype.itemsize / 2**20,
            DTYPE_NAMES[self.dtype],
            transport,
            self.directory,
        )

    def _allocate(self) -> dict[str, Any]:
        """The header and the two slots; returns their descriptor fields."""
        header = ShmSegment.create(HEADER_WORDS * 8)
        self._segments.append(header)
        header_H = header.view(0, torch.int64, (HEADER_WORDS,))
        header_H.zero_()
        header_H[W_LATEST] = -1
        for word, value in ((W_MAGIC, MAGIC), (W_FORMAT, FORMAT), (W_INSTANCE, self.instance)):
            header_H[word] = value
        self._header_H = header_H
        fields: dict[str, Any] = {"header": header.name, "header_bytes": header.size}
        if self.transport == "shm":
            data = ShmSegment.create(SLOTS * self.numel * self.dtype.itemsize)
            self._segments.append(data)
            self._buffer_SP = data.view(0, self.dtype, (SLOTS, self.numel))
            fields.update(data=data.name, data_bytes=data.size)
        else:
            from xtoken_core.ipc.ring_format import cuda_device_key

            with torch.cuda.device(self.device):
                self._buffer_SP = torch.empty(
                    SLOTS, self.numel, dtype=self.dtype, device=self.device
                )
                self._export = CudaIpcHandle.export(self._buffer_SP)
            fields.update(data=self._export.to_dict(), device=cuda_device_key(self.device.index))
        return fields

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish the parameters as ``version`` (call between optimizer steps).

        Args:
            named: the same ``(name, parameter)`` pairs as at construction, current values.
            version: the version they are (the trainer's step); readers take the newest.

        Raises:
            ValueError: parameters other than those of the layout, or a closed publisher.
        """
        if self._closed:
            raise ValueError("this weight publisher is closed")
        named = list(named)
        if [n for n, _ in named] != self._names:
            raise ValueError("publish() got other parameters than the publisher was built for")
        with torch.no_grad():
            if self.transport == "file":
                self._publish_file(named, version)
            else:
                self._publish_slot(named, version)
        self.version = version
        self._keep_descriptor()

    def _keep_descriptor(self) -> None:
        """Write the descriptor again when its file no longer holds it: gone, or damaged (bytes
        that are no descriptor). A valid descriptor of another publisher (a restarted trainer
        took over) is left alone."""
        path = self.directory / DESCRIPTOR
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        if data == self._descriptor:
            return
        if data is not None:
            try:
                parse_descriptor(data)
            except ValueError as e:
                logger.warning("[policy] %s was damaged (%s): written again", path, e)
            else:
                return  # a successor's
        else:
            logger.warning("[policy] %s was gone: written again", path)
        _write_atomic(path, self._descriptor)

    def _publish_file(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        tensors = {n: p.detach().to("cpu").contiguous() for n, p in named}
        path = self.directory / WEIGHTS_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"version": str(version), "format": str(FORMAT)})
        os.replace(tmp, path)

    def _publish_slot(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        header_H, buffer_SP = self._header_H, self._buffer_SP
        assert header_H is not None and buffer_SP is not None
        latest = int(header_H[W_LATEST])
        slot = 0 if latest < 0 else 1 - latest
        header_H[W_GEN + slot] += 1  # odd: being written
        for entry, (_, p) in zip(self.entries, named, strict=True):
            buffer_SP[slot, entry.offset : entry.offset + entry.numel].view(entry.shape).copy_(
                p.detach()
            )
        if buffer_SP.device.type == "cuda":
            torch.cuda.current_stream(buffer_SP.device).synchronize()  # bytes before the header
        header_H[W_VERSION + slot] = version
        header_H[W_GEN + slot] += 1  # even: complete
        header_H[W_LATEST] = slot

    def close(self) -> None:
        """Mark the publication closed and unlink its segments (readers keep what they copied)."""
        if self._closed:
            return
        self._closed = True
        if self._header_H is not None:
            self._header_H[W_CLOSED] = 1
        self._header_H = self._buffer_SP = None
        if self._export is not None:
            from xtoken_core.ipc import cuda as cuda_ipc

            cuda_ipc.forget(self._export)
        segments, self._segments = self._segments, []
        self._finalizer.detach()
        for segment in segments:
            segment.unlink()
            try:
                segment.close()
            except BufferError:  # a view outlives us in this process: the OS frees it later
                pass

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_all(segments: list[ShmSegment]) -> None:
    """Unlink a publisher's segments (its finalizer: readers keep what they mapped)."""
    for segment in segments:
        segment.unlink()


@dataclass
class _Mapped:
    """What a reader holds of one publisher (``stamp``: of the file it was last read from)."""

    stamp: tuple[int, int]  # the descriptor file's (inode, mtime_ns)
    descriptor: dict[str, Any]
    entries: list[Entry]
    dtype: torch.dtype
    header_H: torch.Tensor | None = None
    buffer_SP: torch.Tensor | None = None
    export: CudaIpcHandle | None = None


class WeightSubscriber:
    """A rollout worker's side: copies the newest publication into its model.

    A damaged descriptor or weights file is waited out, never raised: the reader goes on with
    the publisher it has mapped (or, with none yet, has nothing to load) and warns once per
    damaged file; the publisher's next publication writes them whole again.

    Args:
        directory: the publisher's directory.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.version: int | None = None  # the version last loaded
        self._mapped: _Mapped | None = None
        self._file_stamp: tuple[int, int] | None = None
        self._file_version: int | None = None
        # (inode, mtime_ns) of a file found damaged: warned once, read again once it changes
        self._damaged: set[tuple[str, tuple[int, int]]] = set()

    def newest(self) -> int | None:
        """The version of the newest complete publication (None: nothing published yet, or
        the publisher closed)."""
        mapped = self._map()
        if mapped is None:
            return None
        if mapped.descriptor["transport"] == "file":
            return self._file_newest()
        header_H = mapped.header_H
        assert header_H is not None
        slot = int(header_H[W_LATEST])
        if slot < 0 or int(header_H[W_CLOSED]):
            return None
        return int(header_H[W_VERSION + slot])

    def load_into(self, model: torch.nn.Module) -> int | None:
        """Copy the newest publication into ``model``'s parameters, if it is newer than the one
        loaded last.

        Args:
            model: the rollout's copy of the student (same parameter names and shapes).

        Returns:
            The version loaded, or None when nothing newer is published.

        Raises:
            SettingsError: the publication is of another model (names the first difference).
        """
        mapped = self._map()
        if mapped is None:
            return None
        params = dict(model.named_parameters())
        _check_model(mapped.entries, params)
        with torch.no_grad():
            if mapped.descriptor["transport"] == "file":
                return self._load_file(params)
            return self._load_slot(mapped, params)

    # ------------------------------------------------------------------ internals

    def _damaged_once(self, path: Path, stamp: tuple[int, int], why: str) -> None:
        """Warn that ``path`` (as of ``stamp``) is damaged, once per version of the file."""
        if (path.name, stamp) in self._damaged:
            return
        self._damaged.add((path.name, stamp))
        logger.warning(
            "[policy] %s is damaged (%s): waiting for the trainer's next publication, which "
            "writes it again",
            path,
            why,
        )

    def _map(self) -> _Mapped | None:
        """The current descriptor (re-read and re-mapped when its file changed; while it is
        damaged, the publisher mapped before, if any)."""
        path = self.directory / DESCRIPTOR
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns)
        if self._mapped is not None and self._mapped.stamp == stamp:
            return self._mapped
        if (path.name, stamp) in self._damaged:
            return self._mapped
        try:
            d, entries, dtype = parse_descriptor(path.read_bytes())
        except FileNotFoundError:  # replaced between the stat and the read: next call
            return self._mapped
        except ValueError as e:
            self._damaged_once(path, stamp, str(e))
            return self._mapped
        if self._mapped is not None and d == self._mapped.descriptor:
            self._mapped.stamp = stamp  # written again as it was: the same buffers
            return self._mapped
        mapped = _Mapped(stamp, d, entries, dtype)
        if d["transport"] != "file":
            try:
                self._map_slots(mapped)
            except ValueError as e:  # the publisher is gone (its segments were swept)
                logger.warning("[policy] cannot map the published weights yet: %s", e)
                return None
        self.close()
        self._mapped = mapped
        logger.info(
            "[policy] reading weights of publisher %#x (pid %s) by %s",
            d["instance"],
            d.get("pid"),
            d["transport"],
        )
        return mapped

    def _map_slots(self, mapped: _Mapped) -> None:
        d = mapped.descriptor
        reader = ShmReader(unlink=False)
        header_H = reader.segment(d["header"], d["header_bytes"])[: HEADER_WORDS * 8].view(
            torch.int64
        )
        if int(header_H[W_MAGIC]) != MAGIC or int(header_H[W_INSTANCE]) != d["instance"]:
            raise ValueError(f"header {d['header']} is not the descriptor's publisher")
        numel = int(d["numel"])
        if d["transport"] == "shm":
            nbytes = SLOTS * numel * mapped.dtype.itemsize
            base = reader.segment(d["data"], d["data_bytes"])
            buffer_SP = base[:nbytes].view(mapped.dtype).view(SLOTS, numel)
        else:
            from dataclasses import replace

            from xtoken_core.ipc.ring_format import local_cuda_index

            export = CudaIpcHandle.from_dict(d["data"])
            export = replace(export, device=local_cuda_index(d["device"]))
            buffer_SP = export.open()
            mapped.export = export
        mapped.header_H, mapped.buffer_SP = header_H, buffer_SP

    def _file_newest(self) -> int | None:
        """The version in the weights file's metadata (None: no file, or a damaged one)."""
        path = self.directory / WEIGHTS_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns)
        if (path.name, stamp) in self._damaged:
            return None
        if stamp != self._file_stamp:
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    self._file_version = int(f.metadata()["version"])
            except FileNotFoundError:  # replaced between the stat and the open
                return self._file_version
            except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
                self._damaged_once(path, stamp, f"{type(e).__name__}: {e}")
                return None
            self._file_stamp = stamp
        return self._file_version

    def _load_file(self, params: dict[str, torch.nn.Parameter]) -> int | None:
        from safetensors import SafetensorError, safe_open

        newest = self._file_newest()
        if newest is None or newest == self.version:
            return None
        path = self.directory / WEIGHTS_FILE
        # the open file is one version whatever replaces the name meanwhile; every tensor is
        # read before any is copied, so a file that fails to read leaves the model as it was
        try:
            st = path.stat()
            stamp = (st.st_ino, st.st_mtime_ns)
            with safe_open(str(path), framework="pt") as f:
                version = int(f.metadata()["version"])
                tensors = {name: f.get_tensor(name) for name in params}
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            self._damaged_once(path, stamp, f"{type(e).__name__}: {e}")
            return None
        for name, p in params.items():
            p.copy_(tensors[name])
        self.version = version
        return version

    def _load_slot(self, mapped: _Mapped, params: dict[str, torch.nn.Parameter]) -> int | None:
        header_H, buffer_SP = mapped.header_H, mapped.buffer_SP
        assert header_H is not None and buffer_SP is not None
        for _ in range(READ_ATTEMPTS):
            slot = int(header_H[W_LATEST])
            if slot < 0 or int(header_H[W_CLOSED]):
                return None
            gen = int(header_H[W_GEN + slot])
            version = int(header_H[W_VERSION + slot])
            if gen % 2 or int(header_H[W_LATEST]) != slot:
                time.sleep(0.001)  # being written: the other slot becomes latest soon
                continue
            if version == self.version:
                return None
            for entry in mapped.entries:
                src = buffer_SP[slot, entry.offset : entry.offset + entry.numel].view(entry.shape)
                params[entry.name].copy_(src)
            for t in {buffer_SP.device, *(p.device for p in params.values())}:
                if t.type == "cuda":
                    torch.cuda.synchronize(t)
            if int(header_H[W_GEN + slot]) == gen:
                self.version = version
                return version
            logger.debug("[policy] slot %d was written during the copy: copying again", slot)
        return None

    def close(self) -> None:
        """Drop the mappings (the model keeps what was copied)."""
        if self._mapped is not None and self._mapped.export is not None:
            from xtoken_core.ipc import cuda as cuda_ipc

            cuda_ipc.forget(self._mapped.export)
        self._mapped = None


def _check_model(entries: list[Entry], params: dict[str, torch.nn.Parameter]) -> None:
    """The published tensors are exactly the model's parameters.

    Raises:
        SettingsError: names the first name or shape that differs.
    """
    published = {e.name: e.shape for e in entries}
    for name, p in params.items():
        if name not in published:
            raise SettingsError(
                f"the published weights have no {name!r}: the rollout's student is not the "
                "trainer's (give both the same student model)"
            )
        if tuple(p.shape) != published[name]:
            raise SettingsError(
                f"published {name!r} is {list(published[name])}, the rollout's is "
                f"{list(p.shape)}: the rollout's student is not the trainer's"
            )
    extra = sorted(set(published) - set(params))
    if extra:
        raise SettingsError(
            f"the published weights hold {extra[0]!r}, which the rollout's student lacks: it is "
            "not the trainer's student"
        )
