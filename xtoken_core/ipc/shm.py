"""POSIX shared-memory tensor handles: write tensors into a /dev/shm segment, map them elsewhere.

Legend: N rows of a jagged tensor, R total rows of its values, D... the inner dims.

A producer creates a ``ShmSegment`` (one file under /dev/shm named ``xtk_<pid>_<16 hex>``,
mode 0600), writes tensors into it at 64-byte aligned offsets and sends their small handles
(``ShmTensorHandle.to_dict()``: plain str/int/list values, msgpack-able) to a consumer on the
same host. The consumer maps the segment (``ShmReader`` / ``open_handle``) and gets zero-copy
torch tensors over the mapping.

Ownership (why nothing leaks):
  * The consumer **adopts** a segment: it maps it and unlinks its name at once (``unlink=True``,
    the default). From then on the memory is an anonymous shared mapping that the kernel frees
    when the last mapping goes, whichever process dies first.
  * The mapping lives exactly as long as the tensors that view it: every tensor is a view of one
    uint8 tensor built by ``torch.from_numpy(np.frombuffer(mmap))``; the numpy array holds a
    buffer export of the ``mmap`` object (so it cannot be closed under the tensors) and the
    tensor storage holds the array. When the last view is freed the mmap object is collected
    and unmapped. (``torch.frombuffer`` alone does not hold an export: closing the mmap would
    leave dangling tensors, so it is not used here.)
  * The producer unlinks too (``ShmSegment.unlink``, idempotent) once the consumer answered or
    gave up, so a segment whose consumer never came is not left behind. Only a producer killed
    between creating a segment and handing it over leaves a file; ``sweep_orphans`` removes those
    of dead processes.

Memory is committed as it is written. ``ShmSegment.create(commit=False)`` makes a sparse
segment (a queue server's pool: a reserve of any size costs microseconds and no memory); a
producer writing into a region of it allocates exactly the pages it writes first
(``ShmRegion.alloc`` / ``commit``: ``posix_fallocate`` of that byte range), so a full /dev/shm
(Docker's default is 64 MB) is a ``ShmFullError`` naming the fix, never a SIGBUS on a store into
the mapping. The owner runs ``back_ranges`` on the bytes a producer references before reading
them, so a producer that skipped the commit cannot make it fault either.

Validation: everything read from a handle is checked before any byte is touched (name pattern,
same owner uid, regular file, declared size == file size, bounds, alignment, dtype/shape vs
nbytes, jagged offsets, bool bytes) and refused with a ``ValueError`` that names the value.
Nothing is ever unpickled.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import math
import mmap
import os
import re
import secrets
import stat
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xtoken_core.jagged import DTYPE_NAMES, WIRE_DTYPES, JaggedColumn

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "xtk_"
# Names this module creates and the only ones it opens: xtk_<pid>_<16 hex>.
NAME_RE = re.compile(r"xtk_([0-9]{1,10})_[0-9a-f]{16}")
# Every tensor starts at a multiple of this (cache line; any dtype's alignment divides it).
ALIGN = 64
# A segment larger than this is refused on open (1 TiB: a sanity bound, not a policy).
MAX_SEGMENT_BYTES = 1 << 40
MAX_NDIM = 32
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


# posix_fallocate errors that mean "no memory for these pages" (tmpfs size limit; a memory
# cgroup's limit) and those of a filesystem that cannot allocate ahead (then pages fault in as
# they are written, as they did before).
_FULL_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
_NO_FALLOCATE_ERRNOS = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class ShmFullError(OSError):
    """/dev/shm (or the memory limit of this process's cgroup) cannot hold bytes that are about
    to be written into a shared-memory segment. Nothing was written; the segment and the mapping
    are intact. Retryable: it may succeed once memory is freed.

    Attributes:
        name: the segment.
        nbytes: the bytes that could not be committed.
        retryable: always True.
    """

    retryable = True

    def __init__(self, code: int, name: str, offset: int, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes
        super().__init__(
            code,
            f"{SHM_DIR} has no room for {_mib(nbytes)} more of shared-memory segment {name} "
            f"(at offset {offset}; {_shm_free()}; {os.strerror(code)}): raise its size (docker "
            "run --shm-size, compose shm_size, or the tmpfs size= option) or this container's "
            "memory limit, free memory, or send the bytes over the socket instead",
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _shm_free() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "its free space unknown"
    return f"{_mib(st.f_bavail * st.f_frsize)} free of {_mib(st.f_blocks * st.f_frsize)}"


def _open_segment(name: str) -> int | None:
    """An fd of the segment's file, or None when its name is gone (the owner unlinked it: a
    server that stopped or died, a reservation that expired; existing mappings stay valid)."""
    try:
        return os.open(_path(check_name(name)), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def _fallocate(fd: int, name: str, offset: int, nbytes: int) -> bool:
    """Allocate the pages of ``[offset, offset + nbytes)``; False when the filesystem cannot.

    Raises:
        ShmFullError: no memory for them.
    """
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        if e.errno in _FULL_ERRNOS:
            raise ShmFullError(e.errno, name, offset, nbytes) from None
        if e.errno in _NO_FALLOCATE_ERRNOS:
            return False
        raise
    return True


def commit(name: str, offset: int, nbytes: int) -> bool:
    """Allocate the memory behind bytes of a segment before writing them.

    Pages already allocated cost a lookup each; new ones are zeroed and charged to this
    process's memory cgroup. Opens the segment by name (the same file the caller maps).

    Args:
        name: the segment (``xtk_<pid>_<16 hex>``).
        offset: first byte.
        nbytes: bytes from ``offset``.

    Returns:
        True when they are committed; False when they cannot be committed ahead: the
        filesystem cannot, or the segment's name is gone (its owner unlinked it; the mapping
        stays valid). The pages then fault in as they are written, as they did before.

    Raises:
        ShmFullError: /dev/shm or the memory limit is full; nothing was allocated or written.
        ValueError: not a segment name.
    """
    if nbytes <= 0:
        return True
    fd = _open_segment(name)
    if fd is None:
        return False
    try:
        return _fallocate(fd, name, offset, nbytes)
    finally:
        os.close(fd)


def back_ranges(name: str, ranges: list[tuple[int, int]]) -> int | None:
    """Make sure every byte of these ranges of a segment has memory behind it before reading it.

    The owner of a sparse segment runs this on the bytes a producer references: a read of a
    page nobody wrote nor committed allocates one, and on a full /dev/shm that is a SIGBUS in
    the reader. Ranges a producer wrote are checked with ``SEEK_HOLE`` (no allocation; about
    5 us per MiB); a hole (or a committed page never written, which ``SEEK_HOLE`` also reports)
    is allocated with ``posix_fallocate``.

    Args:
        name: the segment.
        ranges: ``(start, end)`` byte ranges inside the segment, in any order.

    Returns:
        Bytes that were handed to ``posix_fallocate`` (0 when every range was written), or
        None when the segment's name is gone (nothing could be checked).

    Raises:
        ShmFullError: a hole cannot be allocated (/dev/shm or the memory limit is full).
        ValueError: not a segment name.
    """
    spans: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if spans and start <= spans[-1][1] + ALIGN:  # alignment padding: one span
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    if not spans:
        return 0
    fd = _open_segment(name)
    if fd is None:
        return None
    allocated = 0
    try:
        for start, end in spans:
            try:
                hole = os.lseek(fd, start, os.SEEK_HOLE)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: no SEEK_HOLE here, allocate
                    raise
                hole = start
            if hole < end:
                _fallocate(fd, name, hole, end - hole)
                allocated += end - hole
    finally:
        os.close(fd)
    return allocated


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def new_segment_name() -> str:
    """Return a fresh segment name ``xtk_<pid>_<16 hex>``."""
    return f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"


def check_name(name: Any) -> str:
    """Return ``name`` if it is an xtoken segment name, else raise.

    Raises:
        ValueError: not a str of the form ``xtk_<pid>_<16 hex>``.
    """
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"shm segment name {name!r} is not an xtoken segment (expected xtk_<pid>_<16 hex>); "
            "only segments made by xtoken_core.ipc.ShmSegment can be opened"
        )
    return name


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _uint8_view(mm: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over the whole mapping that keeps the mapping alive (see module doc)."""
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def _read_only_uint8_view(mm: mmap.mmap) -> torch.Tensor:
    """``_uint8_view`` of a ``PROT_READ`` mapping. torch has no read-only tensors and warns
    about a non-writable array; the page protection is what enforces it here (a write is a
    SIGSEGV, never a silent change of the owner's bytes), so the warning says nothing new."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def _view(base_S: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
    """``shape`` of ``dtype`` at byte ``offset`` of the uint8 tensor ``base_S`` (a view)."""
    nbytes = math.prod(shape) * dtype.itemsize
    flat = base_S[offset : offset + nbytes]
    if dtype != torch.uint8:
        flat = flat.view(dtype)
    return flat.view(shape)


@dataclass(frozen=True)
class ShmTensorHandle:
    """Where a tensor lives in a shared-memory segment; ``to_dict`` is what travels.

    A dense tensor is ``shape`` of ``dtype`` at byte ``offset``. A jagged tensor (``offsets_at``
    set) is values ``shape = [R, *D]`` at ``offset`` plus int64 offsets ``[N+1]`` at byte
    ``offsets_at``; it opens as a ``JaggedColumn``.

    Attributes:
        name: segment name (``xtk_<pid>_<16 hex>``).
        size: segment size in bytes (checked against the file on open).
        offset: byte offset of the (values) data, a multiple of the dtype's itemsize.
        nbytes: ``prod(shape) * itemsize``.
        dtype: a wire dtype.
        shape: the tensor (values) shape.
        offsets_at: byte offset of the jagged offsets, or None for a dense tensor.
        num_rows: N for a jagged tensor (0 for a dense one).
    """

    name: str
    size: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets_at: int | None = None
    num_rows: int = 0

    @property
    def jagged(self) -> bool:
        """True for a jagged handle."""
        return self.offsets_at is not None

    def to_dict(self) -> dict[str, Any]:
        """Return the msgpack-able description ``{kind: "shm", name, size, offset, nbytes, dtype,
        shape[, offsets: {offset, num_rows}]}``."""
        out: dict[str, Any] = {
            "kind": "shm",
            "name": self.name,
            "size": self.size,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
        }
        if self.offsets_at is not None:
            out["offsets"] = {"offset": self.offsets_at, "num_rows": self.num_rows}
        return out

    @classmethod
    def from_dict(cls, d: Any) -> ShmTensorHandle:
        """Parse and check a handle received from another process (no file is touched).

        Args:
            d: the dict ``to_dict`` made.

        Returns:
            The handle.

        Raises:
            ValueError: a missing key, wrong kind, bad name, out-of-bounds or misaligned offset,
                unknown dtype, or a shape that does not match ``nbytes``.
        """
        if not isinstance(d, dict) or d.get("kind") != "shm":
            raise ValueError(f"not a shm tensor handle: {_short(d)}; expected {{kind: 'shm', ...}}")
        missing = [k for k in ("name", "size", "offset", "nbytes", "dtype", "shape") if k not in d]
        if missing:
            raise ValueError(f"shm handle misses {missing}: {_short(d)}")
        jag = d.get("offsets")
        if jag is not None:
            if not isinstance(jag, dict) or "offset" not in jag or "num_rows" not in jag:
                raise ValueError(f"shm handle offsets must be {{offset, num_rows}}, got {jag!r}")
            offsets_at, num_rows = jag["offset"], jag["num_rows"]
        else:
            offsets_at, num_rows = None, 0
        dtype = WIRE_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise ValueError(
                f"shm handle dtype {d['dtype']!r} is not a wire dtype; use one of "
                f"{sorted(WIRE_DTYPES)}"
            )
        shape = d["shape"]
        if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
            raise ValueError(f"shm handle shape {shape!r} must be a list of <= {MAX_NDIM} ints")
        return validated(
            cls(
                check_name(d["name"]),
                d["size"],
                d["offset"],
                d["nbytes"],
                dtype,
                tuple(shape),
                offsets_at,
                num_rows,
            )
        )

    def open(self, *, unlink: bool = True) -> torch.Tensor | JaggedColumn:
        """Map the segment and return the tensor (see ``ShmReader.open``)."""
        return ShmReader(unlink=unlink).open(self)


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0


def validated(h: ShmTensorHandle) -> ShmTensorHandle:
    """Return ``h`` after checking its numbers against each other (not against the file).

    Raises:
        ValueError: naming the field that is out of range.
    """
    check_name(h.name)
    if not _is_uint(h.size) or not 0 < h.size <= MAX_SEGMENT_BYTES:
        raise ValueError(f"shm handle size {h.size!r} must be an int in (0, 2**40]")
    if not all(_is_uint(s) and s <= 2**48 for s in h.shape):
        raise ValueError(f"shm handle shape {list(h.shape)!r} must hold non-negative ints")
    item = h.dtype.itemsize
    if not _is_uint(h.nbytes) or h.nbytes != math.prod(h.shape) * item:
        raise ValueError(
            f"shm handle nbytes {h.nbytes!r} != prod(shape {list(h.shape)}) * itemsize {item} "
            f"of {DTYPE_NAMES.get(h.dtype, h.dtype)}"
        )
    if not _is_uint(h.offset) or h.offset % item or h.offset + h.nbytes > h.size:
        raise ValueError(
            f"shm handle offset {h.offset!r} + nbytes {h.nbytes} is outside the {h.size}-byte "
            f"segment or not a multiple of itemsize {item}"
        )
    if h.offsets_at is not None:
        if not h.shape:
            raise ValueError("jagged shm handle needs values of >= 1 dim [R, *D]")
        n = h.num_rows
        if not _is_uint(n) or n > 2**48:
            raise ValueError(f"jagged shm handle num_rows {n!r} must be a non-negative int")
        end = h.offsets_at + (n + 1) * 8 if _is_uint(h.offsets_at) else -1
        if not _is_uint(h.offsets_at) or h.offsets_at % 8 or end > h.size:
            raise ValueError(
                f"jagged shm handle offsets at {h.offsets_at!r} ({n + 1} int64) are outside the "
                f"{h.size}-byte segment or not 8-byte aligned"
            )
    elif h.num_rows != 0:
        raise ValueError(f"dense shm handle has num_rows {h.num_rows!r}; only jagged ones do")
    return h


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 200 else text[:200] + "..."


def _shm_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor that may go into shared memory; ValueError for an unsupported dtype."""
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(
            f"tensor dtype {tensor.dtype} cannot go into shm; use one of {sorted(WIRE_DTYPES)}"
        )
    return tensor.numel() * tensor.element_size()


class ShmSegment:
    """Producer side: one shared-memory segment this process created and writes tensors into.

    Use ``ShmSegment.create(nbytes)`` (``layout_bytes`` sizes a set of tensors), then ``write`` /
    ``write_jagged`` each tensor, send the handles, and ``close()`` when done; ``unlink()``
    after the consumer answered (a no-op if it already adopted the segment). As a context
    manager it closes and unlinks on exit.

    Args: use ``create``.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._mm: mmap.mmap | None = mm
        self._used = 0
        self._linked = True

    @classmethod
    def create(cls, nbytes: int, *, commit: bool = True) -> ShmSegment:
        """Create and map a new segment of at least ``nbytes`` (rounded up to ``ALIGN``).

        With ``commit`` the pages are allocated and mapped up front (``posix_fallocate``,
        ``MAP_POPULATE``), so a full /dev/shm fails here with an ``OSError`` instead of a SIGBUS
        on the first write. Without it the file is sparse: creating it costs microseconds and
        no memory whatever its size, and whoever writes into it commits the bytes first
        (``ShmRegion`` does; a server's pool lends such segments).

        Args:
            nbytes: bytes needed (``layout_bytes`` of the tensors to write).
            commit: allocate the memory now (False: sparse).

        Returns:
            The segment, mapped read-write.

        Raises:
            ValueError: ``nbytes`` negative or above 1 TiB.
            OSError: /dev/shm missing, or full (``ENOSPC``, with ``commit``); nothing is left
                behind.
        """
        if not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_SEGMENT_BYTES:
            raise ValueError(f"nbytes={nbytes!r}: a segment holds 0 .. 2**40 bytes")
        size = max(ALIGN, align_up(nbytes))
        name = new_segment_name()
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if commit:
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
            else:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            _unlink_quietly(name)
            raise
        os.close(fd)
        return cls(name, size, mm)

    @staticmethod
    def layout_bytes(nbytes_list: list[int]) -> int:
        """Bytes a segment needs for buffers of these sizes, each at an aligned offset."""
        return sum(align_up(n) for n in nbytes_list)

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the next aligned offset; returns the offset.

        Raises:
            ValueError: the segment has no room left (size it with ``layout_bytes``).
        """
        offset = align_up(self._used)
        if offset + nbytes > self.size:
            raise ValueError(
                f"shm segment {self.name} of {self.size} bytes has no room for {nbytes} more at "
                f"offset {offset}; size it with ShmSegment.layout_bytes"
            )
        self._used = offset + nbytes
        return offset

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A writable tensor over bytes of this segment (to fill it in place).

        Drop the views before ``close``; a live view makes ``close`` raise ``BufferError``.
        """
        if self._mm is None:
            raise ValueError(f"shm segment {self.name} is closed")
        return _view(_uint8_view(self._mm), offset, dtype, tuple(shape))

    def base(self) -> torch.Tensor:
        """A uint8 tensor ``[size]`` over the whole mapping (keeps the mapping alive, so
        ``close`` raises ``BufferError`` while it or a view of it lives)."""
        if self._mm is None:
            raise ValueError(f"shm segment {self.name} is closed")
        return _uint8_view(self._mm)

    def _copy_in(self, offset: int, src: torch.Tensor) -> None:
        if self._mm is None:
            raise ValueError(f"shm segment {self.name} is closed")
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return
        src = src.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        src = src.contiguous().reshape(-1)
        if src.dtype != torch.uint8:
            src = src.view(torch.uint8)
        # one memcpy into the mapping (no intermediate copy, no export left behind)
        self._mm[offset : offset + nbytes] = memoryview(src.numpy())

    def write(self, tensor: torch.Tensor) -> ShmTensorHandle:
        """Copy a dense tensor into the segment.

        Args:
            tensor: any shape, a wire dtype, any device (copied to the host).

        Returns:
            Its handle.

        Raises:
            ValueError: unsupported dtype, or no room left.
        """
        nbytes = _shm_nbytes(tensor)
        offset = self.alloc(nbytes)
        self._copy_in(offset, tensor)
        return ShmTensorHandle(
            self.name, self.size, offset, nbytes, tensor.dtype, tuple(tensor.shape)
        )

    def write_jagged(self, column: JaggedColumn) -> ShmTensorHandle:
        """Copy a jagged column (values ``[R, *D]`` + offsets ``[N+1]``) into the segment.

        Args:
            column: the column; its offsets must start at 0 (as ``JaggedColumn`` checks).

        Returns:
            The jagged handle (opens as a ``JaggedColumn``).

        Raises:
            ValueError: unsupported dtype, or no room left.
        """
        values_RD, offsets_N1 = column.values, column.offsets
        values = self.write(values_RD)
        offsets_at = self.alloc(offsets_N1.numel() * 8)
        self._copy_in(offsets_at, offsets_N1.to(torch.int64))
        return ShmTensorHandle(
            self.name,
            self.size,
            values.offset,
            values.nbytes,
            values.dtype,
            values.shape,
            offsets_at,
            offsets_N1.numel() - 1,
        )

    def close(self) -> None:
        """Unmap this process's view (the segment itself lives on until unlinked and unmapped
        everywhere). Raises ``BufferError`` while tensors from ``view`` are alive."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def unlink(self) -> None:
        """Remove the name (idempotent; a consumer that adopted it removed it already)."""
        if self._linked:
            self._linked = False
            _unlink_quietly(self.name)

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self.unlink()

    def __repr__(self) -> str:
        return f"ShmSegment({self.name!r}, size={self.size}, used={self._used})"


class ShmRegion:
    """Producer side: a byte range of a segment that another process owns and lent to us.

    A queue server's pool reserves ``[offset, offset + nbytes)`` of one of its segments for one
    put; the producer maps the segment (``ShmReader``, cached by name, so a warm put maps
    nothing), then either builds tensors in place (``empty``) or copies them in (``write``),
    and sends the handles. Tensors already inside the region are referenced, not copied.

    The segment may be sparse: every ``alloc`` (so ``empty``, ``write``) first commits the bytes
    it hands out (``commit``), and ``commit(n)`` commits the first ``n`` bytes ahead in one call
    (a put that knows its layout). A full /dev/shm is then a ``ShmFullError`` before any byte is
    written, never a SIGBUS.

    Args:
        name: the segment name.
        size: the segment size in bytes.
        base_S: uint8 tensor ``[size]`` over the mapped segment.
        offset: first byte of the region (a multiple of ``ALIGN``).
        nbytes: bytes of the region.
        token: the reservation's token (what a put names to use it).
        committed: the segment's bytes below this offset are known to be committed already
            (a producer that wrote them before: nothing to allocate again).

    Raises:
        ValueError: the region does not lie inside the segment.
    """

    def __init__(
        self,
        name: str,
        size: int,
        base_S: torch.Tensor,
        offset: int,
        nbytes: int,
        token: str = "",
        *,
        committed: int = 0,
    ) -> None:
        if not (_is_uint(offset) and _is_uint(nbytes) and offset % ALIGN == 0):
            raise ValueError(f"shm region offset {offset!r} / nbytes {nbytes!r} are not valid")
        if offset + nbytes > size or base_S.numel() != size:
            raise ValueError(
                f"shm region [{offset}, {offset + nbytes}) is outside segment {name} of {size} bytes"
            )
        self.name, self.size, self.offset, self.nbytes, self.token = (
            name,
            size,
            offset,
            nbytes,
            token,
        )
        self._base_S = base_S
        self._ptr = base_S.data_ptr()
        self._used = offset
        # bytes [offset, _committed) have memory behind them
        self._committed = max(offset, min(committed, offset + nbytes))
        self._can_commit = True

    @property
    def committed(self) -> int:
        """Segment offset below which the region's bytes are committed (by this region or
        known before)."""
        return self._committed

    def commit(self, nbytes: int) -> None:
        """Commit the memory of the next ``nbytes`` bytes that ``alloc`` will hand out (up to
        the region's end), in one call, ahead of writing them; later allocs inside them commit
        nothing more. Where pages cannot be committed ahead (a filesystem without fallocate,
        a segment whose owner already unlinked it) they fault in as they are written.

        Raises:
            ShmFullError: /dev/shm or the memory limit is full (nothing is written; retryable).
        """
        self._commit_to(min(align_up(self._used) + nbytes, self.offset + self.nbytes))

    def _commit_to(self, end: int) -> None:
        if end <= self._committed or not self._can_commit:
            return
        self._can_commit = commit(self.name, self._committed, end - self._committed)
        self._committed = end

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # an unused reservation is reclaimed by its owner when it expires

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` at the next aligned offset of the region, committing their memory
        first; returns the offset.

        Raises:
            ValueError: the region has no room left (reserve more bytes).
            ShmFullError: /dev/shm or the memory limit is full (no room is used; retryable).
        """
        offset = align_up(self._used)
        if offset + nbytes > self.offset + self.nbytes:
            raise ValueError(
                f"shm region of {self.nbytes} bytes has no room for {nbytes} more bytes at "
                f"offset {offset - self.offset}; reserve at least layout_bytes of the tensors"
            )
        self._commit_to(offset + nbytes)
        self._used = offset + nbytes
        return offset

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialized tensor inside the region, to fill in place (zero extra copy).

        Raises:
            ValueError: ``dtype`` is not a wire dtype, or no room is left.
        """
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} cannot go into shm; use one of {sorted(WIRE_DTYPES)}")
        shape = tuple(int(d) for d in shape)
        offset = self.alloc(math.prod(shape) * dtype.itemsize)
        return _view(self._base_S, offset, dtype, shape)

    def locate(self, tensor: torch.Tensor) -> int | None:
        """Byte offset in the segment of a contiguous tensor that lies inside the region, else
        None (it will be copied in)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr() - self._ptr
        end = start + tensor.numel() * tensor.element_size()
        if self.offset <= start and end <= self.offset + self.nbytes:
            return start
        return None

    def write(self, tensor: torch.Tensor) -> ShmTensorHandle:
        """The handle of a dense tensor: in place if it lies in the region, else copied in.

        Raises:
            ValueError: unsupported dtype, or no room left.
        """
        nbytes = _shm_nbytes(tensor)
        offset = self.locate(tensor)
        if offset is None:
            offset = self.alloc(nbytes)
            if nbytes:
                src = tensor.detach().cpu().contiguous()
                # one libc memcpy (large copies use streaming stores); bounds checked by alloc
                ctypes.memmove(self._ptr + offset, src.data_ptr(), nbytes)
        return ShmTensorHandle(
            self.name, self.size, offset, nbytes, tensor.dtype, tuple(tensor.shape)
        )

    def write_jagged(self, column: JaggedColumn) -> ShmTensorHandle:
        """The jagged handle of a column (values and int64 offsets placed as by ``write``)."""
        values = self.write(column.values)
        offsets = self.write(column.offsets.to(torch.int64))
        return ShmTensorHandle(
            self.name,
            self.size,
            values.offset,
            values.nbytes,
            values.dtype,
            values.shape,
            offsets.offset,
            column.offsets.numel() - 1,
        )

    def __repr__(self) -> str:
        return f"ShmRegion({self.name!r}, offset={self.offset}, nbytes={self.nbytes})"


def _unlink_quietly(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


class ShmReader:
    """Consumer side: opens handles, mapping each segment once.

    A reader made for one received message adopts each segment on first use (``unlink=True``).
    A long-lived reader (``unlink=False, max_cached=K``) keeps the K most recently used
    mappings of segments that someone else owns (a queue server's pool), so that a warm read
    maps nothing; evicting a mapping never invalidates tensors already returned (they hold it).

    Args:
        unlink: adopt each segment (unlink its name right after mapping it).
        segments: name -> uint8 tensor over a segment this process already maps (its own pool);
            such names are resolved without opening any file and never unlinked.
        max_cached: most mappings kept (least recently used dropped first); None = no bound.
        known_only: refuse every name not in ``segments`` before touching any file (a server
            that accepts references only into the regions it lent).
        writable: map segments read-write; False maps them ``PROT_READ`` (a consumer of
            someone else's segment: its tensors cannot change the owner's bytes, a write into
            them is a SIGSEGV).

    Attributes:
        refs: ``(name, start, end)`` byte ranges of every buffer opened in a known segment, in
            order (a server checks them against what the sender was allowed to reference).
    """

    def __init__(
        self,
        *,
        unlink: bool = True,
        segments: Mapping[str, torch.Tensor] | None = None,
        max_cached: int | None = None,
        known_only: bool = False,
        writable: bool = True,
    ) -> None:
        if max_cached is not None and max_cached < 1:
            raise ValueError(f"max_cached={max_cached}: keep at least 1 mapping, or None")
        self.unlink = unlink
        self.known_only = known_only
        self.writable = writable
        self.known = segments if segments is not None else {}
        self.max_cached = max_cached
        self._maps: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.refs: list[tuple[str, int, int]] = []

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` views a segment this reader mapped (not a known one)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(base_S.data_ptr() == ptr for base_S in self._maps.values())

    def segment(self, name: str, size: int) -> torch.Tensor:
        """Map segment ``name`` (checked) and return a uint8 tensor ``[size]`` over it.

        Raises:
            ValueError: a bad name, a missing file, another owner, not a regular file, or a
                file size other than ``size``.
        """
        base_S = self.known.get(name)
        if base_S is None:
            base_S = self._maps.get(name)
            if base_S is not None:
                self._maps.move_to_end(name)
        if base_S is not None:
            if base_S.numel() != size:
                raise ValueError(
                    f"shm segment {name} is {base_S.numel()} bytes, a handle says {size}"
                )
            return base_S
        check_name(name)
        if self.known_only:
            raise ValueError(
                f"shm segment {name} was not lent by this server; a put may reference only the "
                "region of its own reservation (reserve, then put with its token: "
                "QueueClient.reserve or shm='auto'); other segments are refused untouched"
            )
        flags = os.O_RDWR if self.writable else os.O_RDONLY
        try:
            fd = os.open(_path(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(
                f"shm segment {name} does not exist (already adopted, its producer gave up, or "
                "it lives on another host / in another container's /dev/shm)"
            ) from None
        except OSError as e:
            raise ValueError(f"shm segment {name} cannot be opened: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(
                    f"shm segment {name} is not a regular file owned by uid {os.geteuid()} "
                    f"(uid {st.st_uid}); refused"
                )
            if st.st_size != size:
                raise ValueError(
                    f"shm segment {name} is {st.st_size} bytes, the handle says {size}; refused"
                )
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        if self.unlink:
            _unlink_quietly(name)
        base_S = _uint8_view(mm) if self.writable else _read_only_uint8_view(mm)
        del mm  # the array export inside base_S keeps the mapping alive, nothing else does
        self._maps[name] = base_S
        if self.max_cached is not None and len(self._maps) > self.max_cached:
            self._maps.popitem(last=False)  # tensors handed out keep their own reference
        return base_S

    def open(self, handle: ShmTensorHandle | dict[str, Any]) -> torch.Tensor | JaggedColumn:
        """Return the tensor a handle describes, a zero-copy view of the mapping.

        Args:
            handle: a ``ShmTensorHandle`` or the dict of ``to_dict``.

        Returns:
            A tensor of ``shape``, or a ``JaggedColumn`` (values ``[R, *D]``, offsets
            ``[N+1]``) for a jagged handle. Writable unless the reader is ``writable=False``;
            the mapping lives as long as it does.

        Raises:
            ValueError: anything wrong with the handle, the segment, or the jagged offsets.
        """
        h = handle if isinstance(handle, ShmTensorHandle) else ShmTensorHandle.from_dict(handle)
        if isinstance(handle, ShmTensorHandle):
            validated(h)
        base_S = self.segment(h.name, h.size)
        if h.name in self.known:
            self.refs.append((h.name, h.offset, h.offset + h.nbytes))
            if h.offsets_at is not None:
                self.refs.append((h.name, h.offsets_at, h.offsets_at + (h.num_rows + 1) * 8))
        values = _view(base_S, h.offset, h.dtype, h.shape)
        if h.dtype == torch.bool and h.nbytes:
            if int(base_S[h.offset : h.offset + h.nbytes].max()) > 1:
                raise ValueError(f"bool tensor in shm segment {h.name} holds bytes other than 0/1")
        if h.offsets_at is None:
            return values
        offsets_N1 = _view(base_S, h.offsets_at, torch.int64, (h.num_rows + 1,))
        offs = offsets_N1.numpy()
        if int(offs[0]) != 0 or int(offs[-1]) != h.shape[0] or bool((np.diff(offs) < 0).any()):
            raise ValueError(
                f"jagged offsets in shm segment {h.name} must run from 0 to R={h.shape[0]} "
                f"without decreasing; got {offs[:4].tolist()}...{int(offs[-1])}"
            )
        column = JaggedColumn.__new__(JaggedColumn)  # checked just above
        column.values, column.offsets = values, offsets_N1
        return column


def open_handle(handle: ShmTensorHandle | dict[str, Any], *, unlink: bool = True):
    """Open one handle (``ShmReader(unlink=unlink).open(handle)``)."""
    return ShmReader(unlink=unlink).open(handle)


def write_tensors(tensors: list[torch.Tensor | JaggedColumn]) -> tuple[ShmSegment, list]:
    """Write several tensors / jagged columns into one new segment.

    Args:
        tensors: dense tensors and ``JaggedColumn`` s.

    Returns:
        ``(segment, handles)``, handles in input order. Close and unlink the segment when the
        consumer answered.

    Raises:
        ValueError: unsupported dtype.
        OSError: /dev/shm is missing or full.
    """
    sizes: list[int] = []
    for t in tensors:
        if isinstance(t, JaggedColumn):
            sizes += [t.values.numel() * t.values.element_size(), t.offsets.numel() * 8]
        else:
            sizes.append(t.numel() * t.element_size())
    segment = ShmSegment.create(ShmSegment.layout_bytes(sizes))
    try:
        handles = [
            segment.write_jagged(t) if isinstance(t, JaggedColumn) else segment.write(t)
            for t in tensors
        ]
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return segment, handles


def sweep_orphans(*, min_age_s: float = 300.0) -> list[str]:
    """Unlink xtoken segments of this uid whose creator process is gone and that are old.

    A producer killed between creating a segment and handing it over leaves its file behind;
    a server runs this now and then. Both conditions are needed: the pid is checked in this
    pid namespace only, and a young segment may still be on its way to a consumer.

    Args:
        min_age_s: only segments not modified for this long.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = NAME_RE.fullmatch(name)
        if m is None:
            continue
        try:
            st = os.stat(_path(name), follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.geteuid() or now - st.st_mtime < min_age_s:
            continue
        if _pid_alive(int(m.group(1))):
            continue
        if _unlink_quietly(name):
            removed.append(name)
    if removed:
        logger.info("[ipc] removed %d orphaned shm segments", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
