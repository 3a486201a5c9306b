"""The queue's durable log (``--data-dir``): append-only records, a writer thread, replay, compaction.

A record is one state change in the wire encoding (``encode_message``: a msgpack body, tensors
as raw frames; never pickle), framed on disk as::

    head    magic b"XTKR" | crc32 u32 | payload length u64        (16 bytes, little-endian)
    payload frame count u32 | frame lengths u64 x count | frames

A put is logged as the request's own frames (type ``put``; no second encoding), other changes
as a ``reply`` message whose body names the ``op``. The CRC covers the whole payload, so a record cut by a SIGKILL (short) or garbled by a crash
(bad CRC) is detected on replay; the log is truncated before it and appending goes on from there.

Files: ``DIR/log.<generation>`` (16 digits). A compaction writes the store's state as records
(a snapshot) to ``log.<g+1>.tmp``, fsyncs it, renames it to ``log.<g+1>`` and removes
``log.<g>``: replay reads the newest complete generation, which is always a snapshot followed
by the changes made after it. Records are written by one thread, in the order they were
appended; ``written`` (a sequence number) says how far the OS has them (they survive a SIGKILL
of the process), ``synced`` how far they were fsynced (they survive a crash of the machine).
The fsync policy: ``always`` (fsync before ``synced`` moves; group commit), ``interval`` (every
``fsync_interval_s``), ``never`` (the OS writes back on its own).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from xtoken_core.wire import WireError, WireLimits, decode_message, encode_message

logger = logging.getLogger(__name__)

FILE_MAGIC = b"XTKQLOG1"
RECORD_MAGIC = b"XTKR"
RECORD_HEAD = struct.Struct("<4sIQ")
FSYNC_POLICIES = ("always", "interval", "never")
# Records are plain messages of the wire encoding, with room for a snapshot of a large block.
RECORD_LIMITS = WireLimits(
    max_message_bytes=1 << 40, max_frames=1 << 16, max_body_bytes=1 << 31, max_ndim=32
)
_LOG_NAME = re.compile(r"^log\.(\d{16})$")
# writev takes at most this many buffers at once (IOV_MAX is 1024 on Linux).
_IOV_MAX = 1024
# Bytes per write call (see _writev_all).
WRITE_CHUNK = 1 << 20
# Records nobody waits for (puts answered at once) are written in batches: the writer waits up to
# this long for more before it writes, unless a record somebody waits for (an ack) comes.
LAZY_S = 0.005
# The writer thread's nice value: on a busy host the event loop and the clients go first (a put
# answered at once is not delayed by the write of the one before it).
WRITER_NICE = 19


def encode_record(op: str, body: dict[str, Any]) -> list[Any]:
    """One state change as frames: ``{"op": op, **body}`` in the wire encoding.

    Args:
        op: ``put``, ``ack``, ``clear``, ``register``, ``consumed``, ``tombstones``.
        body: msgpack-able values, tensors and JaggedColumns (as in a request body).

    Returns:
        ``[header, body, *tensor_buffers]`` (tensor buffers alias the tensors).
    """
    return encode_message("reply", {"op": op, **body}, limits=RECORD_LIMITS)


def frame_record(frames: list[Any]) -> tuple[list[Any], int, int]:
    """The on-disk buffers of one record: head, frame table, frames; with the CRC computed.

    Returns:
        ``(buffers, nbytes, crc)``.
    """
    views = [memoryview(f).cast("B") for f in frames]
    table = struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views))
    crc = zlib.crc32(table)
    for v in views:
        crc = zlib.crc32(v, crc)
    length = len(table) + sum(v.nbytes for v in views)
    head = RECORD_HEAD.pack(RECORD_MAGIC, crc, length)
    return [head, table, *views], RECORD_HEAD.size + length, crc


@dataclass
class Replay:
    """What a replay read.

    Attributes:
        records: complete records applied.
        nbytes: bytes of the log kept (up to the last good record).
        truncated: bytes cut off the tail (a torn or corrupt record).
        seconds: wall time of the replay.
    """

    records: int = 0
    nbytes: int = 0
    truncated: int = 0
    seconds: float = 0.0


def read_records(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(end_offset, body)`` for every good record of a log file, stopping at the first
    torn or corrupt one (its offset is the last ``end_offset`` yielded, or the file header).

    Tensors of a body alias a private buffer of that record (nothing is shared with the file).

    Raises:
        ValueError: the file does not start with the log magic (not a queue log).
    """
    with open(path, "rb") as f:
        magic = f.read(len(FILE_MAGIC))
        if magic != FILE_MAGIC:
            raise ValueError(
                f"{path} is not a queue log (magic {magic!r}); point --data-dir at a "
                "directory of the queue's own files"
            )
        end = len(FILE_MAGIC)
        while True:
            head = f.read(RECORD_HEAD.size)
            if len(head) < RECORD_HEAD.size:
                return
            magic, crc, length = RECORD_HEAD.unpack(head)
            if magic != RECORD_MAGIC or length < 4:
                return
            buf = bytearray(length)
            if f.readinto(buf) != length or zlib.crc32(buf) != crc:
                return
            view = memoryview(buf)
            (count,) = struct.unpack_from("<I", view, 0)
            if 4 + 8 * count > length:
                return
            lens = struct.unpack_from(f"<{count}Q", view, 4)
            pos = 4 + 8 * count
            frames = []
            for n in lens:
                frames.append(view[pos : pos + n])
                pos += n
            if pos != length:
                return
            try:
                msg = decode_message(frames, limits=RECORD_LIMITS, jagged="column")
            except WireError:
                return
            end += RECORD_HEAD.size + length
            body = msg.body
            if msg.msg_type != "reply":  # a request logged as it was received (a put)
                body = {**body, "op": msg.msg_type}
            yield end, body


def log_files(data_dir: str) -> list[tuple[int, str]]:
    """``(generation, path)`` of the complete log files in ``data_dir``, oldest first."""
    out = []
    for name in os.listdir(data_dir):
        m = _LOG_NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(data_dir, name)))
    return sorted(out)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writev_all(fd: int, buffers: list[Any]) -> None:
    """Write every buffer, in writev calls of at most ``WRITE_CHUNK`` bytes (short writes
    resumed). One large write costs several times the same bytes in 1 MiB pieces (the kernel
    throttles dirty pages per call), so large buffers are sliced."""
    batch: list[Any] = []
    size = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        for start in range(0, view.nbytes, WRITE_CHUNK):
            piece = view[start : start + WRITE_CHUNK]
            if batch and (size + piece.nbytes > WRITE_CHUNK or len(batch) == _IOV_MAX):
                _writev_some(fd, batch)
                batch, size = [], 0
            batch.append(piece)
            size += piece.nbytes
    if batch:
        _writev_some(fd, batch)


def _writev_some(fd: int, batch: list[memoryview]) -> None:
    while batch:
        n = os.writev(fd, batch)
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch = batch[1:]
        if batch and n:
            batch[0] = batch[0][n:]


class DurableLog:
    """The append-only log of one queue server, written by a background thread.

    Args:
        data_dir: the directory (created if missing; one server per directory).
        fsync: ``always``, ``interval`` or ``never`` (see the module docstring).
        fsync_interval_s: with ``interval``, the longest a written record stays un-fsynced.
        notify: called from the writer thread after records were written (wakes the loop).

    Raises:
        ValueError: an unknown fsync policy or a non-positive interval.
    """

    def __init__(
        self,
        data_dir: str,
        *,
        fsync: str = "interval",
        fsync_interval_s: float = 1.0,
        notify: Callable[[], None] | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync={fsync!r}: use one of {FSYNC_POLICIES} (--fsync)")
        if not fsync_interval_s > 0:
            raise ValueError(f"fsync_interval_s={fsync_interval_s}: must be > 0 (--fsync-interval)")
        self.data_dir = os.path.abspath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self._notify = notify or (lambda: None)
        self.generation = 0
        self.file_bytes = 0  # bytes of the current log file
        self.appended = 0  # sequence number of the last record appended
        self.written = 0  # ... of the last record the OS has (survives a SIGKILL)
        self.synced = 0  # ... of the last record fsynced (survives a machine crash)
        self.pending_bytes = 0  # bytes appended, not written yet
        self.compactions = 0
        self.error: BaseException | None = None
        self._fd = -1
        self._queue: collections.deque[tuple[int, str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._urgent = False  # a queued record is waited for
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- recovery

    def replay(self, apply: Callable[[dict[str, Any]], None]) -> Replay:
        """Apply every good record of the newest log to ``apply``, truncate a torn tail, and
        open the log for appending (call once, before ``start``).

        Args:
            apply: called with each record body (``op`` and its fields), in log order.

        Returns:
            What was read.
        """
        t0 = time.perf_counter()
        files = log_files(self.data_dir)
        for name in os.listdir(self.data_dir):
            if name.startswith("log.") and name.endswith(".tmp"):
                os.unlink(os.path.join(self.data_dir, name))  # a compaction that did not finish
        out = Replay()
        if not files:
            self.generation = 1
            self._create(self._path(1))
            out.seconds = time.perf_counter() - t0
            return out
        self.generation, path = files[-1]
        for _, old in files[:-1]:
            os.unlink(old)  # a compaction finished but did not remove its predecessor
        end = len(FILE_MAGIC)
        for record_end, body in read_records(path):
            apply(body)
            out.records += 1
            end = record_end
        size = os.path.getsize(path)
        out.nbytes, out.truncated = end, size - end
        if out.truncated:
            logger.warning(
                "[queue] %s: a torn or corrupt record at byte %d (%d bytes) cut off the log",
                path,
                end,
                out.truncated,
            )
        self._fd = os.open(path, os.O_WRONLY)
        os.ftruncate(self._fd, end)
        os.lseek(self._fd, end, os.SEEK_SET)
        if out.truncated:
            os.fsync(self._fd)
        self.file_bytes = end
        out.seconds = time.perf_counter() - t0
        return out

    def _path(self, generation: int) -> str:
        return os.path.join(self.data_dir, f"log.{generation:016d}")

    def _create(self, path: str) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, FILE_MAGIC)
        os.fsync(fd)
        _fsync_dir(self.data_dir)
        self._fd = fd
        self.file_bytes = len(FILE_MAGIC)
        return fd

    # ---------------------------------------------------------------- appending

    def start(self) -> None:
        """Start the writer thread."""
        self._thread = threading.Thread(target=self._run, name="queue-log", daemon=True)
        self._thread.start()

    def append(self, op: str, body: dict[str, Any], urgent: bool = True) -> int:
        """Queue one record; returns its sequence number (``written >= seq`` once the OS has it).

        The tensors of ``body`` are referenced until the record is written: do not change them.

        Args:
            op, body: the record (``encode_record``).
            urgent: somebody waits for it (written at once); False lets the writer wait up to
                ``LAZY_S`` to write it with the records that follow.
        """
        return self._push("record", encode_record(op, body), urgent)

    def append_frames(self, frames: list[Any], urgent: bool = True) -> int:
        """Queue a request as it was received (``[header, body, *tensor frames]`` of a put: its
        message type is the record's ``op``), without encoding it again."""
        return self._push("record", frames, urgent)

    def compact(self, snapshot: list[list[Any]]) -> int:
        """Start a new log generation with ``snapshot`` (encoded records of the whole state as
        of now); the records appended after this call follow it there."""
        return self._push("rotate", snapshot, True)

    def _push(self, kind: str, item: Any, urgent: bool) -> int:
        if self.error is not None:
            raise RuntimeError(f"the queue log in {self.data_dir} failed: {self.error}")
        nbytes = (
            sum(memoryview(f).nbytes for f in item)
            if kind == "record"
            else sum(memoryview(f).nbytes for rec in item for f in rec)
        )
        with self._cond:
            self.appended += 1
            self.pending_bytes += nbytes
            if urgent or not self._queue:
                self._cond.notify()
            self._urgent = self._urgent or urgent
            self._queue.append((self.appended, kind, item))
            return self.appended

    def durable(self, seq: int, synced: bool) -> bool:
        """Whether record ``seq`` is written (``synced``: and fsynced)."""
        return (self.synced if synced else self.written) >= seq

    def close(self) -> None:
        """Write what is queued, fsync, stop the writer and close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        if self._fd >= 0:
            if self.error is None:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):  # not Linux, or not allowed: normal priority
            pass
        last_sync = time.monotonic()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    timeout = None
                    if self.fsync == "interval" and self.synced < self.written:
                        timeout = max(0.0, last_sync + self.fsync_interval_s - time.monotonic())
                        if timeout == 0:
                            break
                    self._cond.wait(timeout)
                if self._queue and not self._urgent and not self._closing:
                    self._cond.wait(LAZY_S)  # more puts coming: write them in one go
                batch = list(self._queue)
                self._queue.clear()
                self._urgent = False
                if not batch and self._closing:
                    return
            try:
                nbytes = 0
                for _, kind, item in batch:
                    if kind == "record":
                        buffers, n, _ = frame_record(item)
                        _writev_all(self._fd, buffers)
                        self.file_bytes += n
                        nbytes += sum(memoryview(f).nbytes for f in item)
                    else:
                        self._rotate(item)
                        nbytes += sum(memoryview(f).nbytes for rec in item for f in rec)
                last = batch[-1][0] if batch else self.written
                sync = self.fsync == "always" or (
                    self.fsync == "interval"
                    and time.monotonic() - last_sync >= self.fsync_interval_s
                )
                with self._cond:
                    self.written = last
                    self.pending_bytes -= nbytes
                if sync and self.synced < last:
                    os.fsync(self._fd)
                    last_sync = time.monotonic()
                    self.synced = last
            except BaseException as e:  # disk full, I/O error: the server must stop
                logger.exception("[queue] the log writer failed")
                self.error = e
                self._notify()
                return
            del batch
            self._notify()

    def _rotate(self, snapshot: list[list[Any]]) -> None:
        """Write the snapshot as the next generation and switch to it (writer thread)."""
        generation = self.generation + 1
        path = self._path(generation)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        size = len(FILE_MAGIC)
        try:
            os.write(fd, FILE_MAGIC)
            for frames in snapshot:
                buffers, n, _ = frame_record(frames)
                _writev_all(fd, buffers)
                size += n
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        os.rename(tmp, path)
        _fsync_dir(self.data_dir)
        old_fd, old_path = self._fd, self._path(self.generation)
        self._fd, self.generation, self.file_bytes = fd, generation, size
        os.close(old_fd)
        os.unlink(old_path)
        self.compactions += 1
        # Everything before the rotation is in the snapshot, which is fsynced.
        self.synced = max(self.synced, self.written)


def apply_record(store: Any, body: dict[str, Any]) -> None:
    """Apply one replayed record to a ``SampleStore`` (what the running server did).

    Raises:
        ValueError: an unknown op (a log written by a newer server).
    """
    op = body.get("op")
    partition = body.get("partition")
    if op == "put":
        result = store.put(partition, body["keys"], body["fields"])
        if result.blocked:
            logger.warning(
                "[queue] replay: a put of %d samples to %r does not fit in --capacity "
                "(lowered since?): dropped",
                len(body["keys"]),
                partition,
            )
    elif op in ("ack", "consumed"):
        store.consume(partition, body["task"], body["keys"])
    elif op == "clear":
        store.clear(partition, body.get("keys"))
    elif op == "register":
        store.register(partition, body["task"])
    elif op == "tombstones":
        store.restore_tombstones(partition, body["hashes"], body["dropped"])
    else:
        raise ValueError(
            f"log record op {op!r} is unknown to this server; recover with the version that "
            "wrote the log"
        )
