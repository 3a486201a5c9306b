"""The queue's durable log (``--data-dir``): append-only records, replay, compaction, the lock on
the data directory, and the server's end of the log writer process (log_writer.py).

A record is one state change in the wire encoding (``encode_message``: a msgpack body, tensors
as raw frames; never pickle), framed on disk as::

    head    magic b"XTKR" | crc32 u32 | payload length u64        (16 bytes, little-endian)
    payload frame count u32 | frame lengths u64 x count | frames

A put is logged as the request's own frames (type ``put``; no second encoding), other changes
as a ``reply`` message whose body names the ``op``. The CRC covers the whole payload, so a record
cut by a SIGKILL (short) or garbled by a crash (bad CRC) is detected on replay. At the tail (no
valid record after it) that is a torn write: the log is truncated before it and appending goes
on from there. In the middle (a valid record follows: the replay resynchronizes on the next
record magic whose CRC holds) it is corruption: the server does not start (``CorruptLogError``,
exit code 3, naming the file and offset) unless ``--salvage``, which drops the bad bytes, keeps
every valid record after them and rewrites the log without them.

Files: ``DIR/log.<generation>`` (16 digits) and ``DIR/lock`` (dir_lock.py). A compaction writes
the store's state as records (a snapshot) to ``log.<g+1>.tmp``, fsyncs it, renames it to
``log.<g+1>`` and removes ``log.<g>``: replay reads the newest complete generation, which is
always a snapshot followed by the changes made after it.

Records are written by a writer process (log_writer.py), in the order they were appended: the
server's loop sends it each record over a zmq PAIR socket, small frames copied, large ones as
their address and length: the writer reads them from the server's memory (``process_vm_readv``;
the server keeps them until they are written), or, where the OS does not allow that, they are
sent zero-copy (this log's zmq I/O thread copies them out, not the loop). The writer computes
the CRC, writes, fsyncs and reports back. ``written`` (a sequence number) says how far the OS
has the records (they survive a SIGKILL of the server), ``synced`` how far they were fsynced
(they survive a crash of the machine). The fsync policy: ``always`` (fsync before ``synced``
moves; group commit), ``interval`` (every ``fsync_interval_s``), ``never`` (the OS writes back
on its own).

The lock: ``replay`` takes an flock on ``DIR/lock`` (waiting up to ``lock_wait_s``, then a
``ValueError`` naming the pids that hold it) and the writer inherits it, so the directory stays
locked while either process lives: a restarted server never replays a log an old writer still
appends to. The writer dies with the server (log_writer.py). If the writer dies first,
``poll`` logs it and sets ``error``; ``append`` then raises, and the server stops (exit 1)
without answering a change it could not log.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from services.queue.dir_lock import LOCK_WAIT_S, DirLock
from services.queue.log_writer import (
    CLOSE,
    FILE_MAGIC,
    FSYNC_POLICIES,
    HEAD,
    OPEN,
    OPEN_BODY,
    PROGRESS,
    RECORD,
    RECORD_HEAD,
    RECORD_MAGIC,
    SNAPSHOT,
    SWITCH,
    fsync_dir,
    log_path,
)
from services.queue.transport import COPY_BELOW
from xtoken_core.wire import WireError, WireLimits, decode_message, encode_message

logger = logging.getLogger(__name__)

# Records are plain messages of the wire encoding, with room for a snapshot of a large block.
RECORD_LIMITS = WireLimits(
    max_message_bytes=1 << 40, max_frames=1 << 16, max_body_bytes=1 << 31, max_ndim=32
)
_LOG_NAME = re.compile(r"^log\.(\d{16})$")
# How long the writer may take to start and connect, and to finish what was appended at close.
WRITER_START_S = 30.0
CLOSE_S = 60.0
_PR_SET_PTRACER = 0x59616D61
# The directory holding the ``services`` package: the writer process imports it from there.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encode_record(op: str, body: dict[str, Any]) -> list[Any]:
    """One state change as frames: ``{"op": op, **body}`` in the wire encoding.

    Args:
        op: ``put``, ``ack``, ``clear``, ``register``, ``consumed``, ``tombstones``,
            ``acked_leases``.
        body: msgpack-able values, tensors and JaggedColumns (as in a request body).

    Returns:
        ``[header, body, *tensor_buffers]`` (tensor buffers alias the tensors).
    """
    return encode_message("reply", {"op": op, **body}, limits=RECORD_LIMITS)


@dataclass
class Replay:
    """What a replay read.

    Attributes:
        records: complete records applied.
        nbytes: bytes of the log kept (up to the last good record).
        truncated: bytes cut off the tail (a torn record).
        salvaged: corrupt bytes dropped from the middle of the log (``--salvage``).
        seconds: wall time of the replay.
    """

    records: int = 0
    nbytes: int = 0
    truncated: int = 0
    salvaged: int = 0
    seconds: float = 0.0


class CorruptLogError(RuntimeError):
    """A record in the middle of a log is corrupt (valid records follow it): not a torn tail.

    Not retryable: the server refuses to start (exit code 3) rather than drop the records after
    it; ``--salvage`` keeps them and drops only the bad bytes.

    Attributes:
        path: the log file.
        offset: byte offset of the corrupt record.
        resume: byte offset of the next valid record.
    """

    def __init__(self, path: str, offset: int, resume: int) -> None:
        self.path, self.offset, self.resume = path, offset, resume
        super().__init__(
            f"{path}: corrupt record at byte {offset} ({resume - offset} bytes up to the next "
            f"valid record at byte {resume}); the records after it were not replayed. Restore "
            "the directory from a copy, or start with --salvage to keep every valid record and "
            "drop the bad bytes (the changes they held are lost)"
        )


def _record_at(buf: Any, pos: int) -> tuple[int, dict[str, Any]] | None:
    """``(end_offset, body)`` of a whole, valid record at ``pos`` of ``buf``, else None."""
    size = len(buf)
    if pos + RECORD_HEAD.size > size:
        return None
    magic, crc, length = RECORD_HEAD.unpack_from(buf, pos)
    start = pos + RECORD_HEAD.size
    if magic != RECORD_MAGIC or length < 4 or start + length > size:
        return None
    window = memoryview(buf)[start : start + length]
    try:
        if zlib.crc32(window) != crc:
            return None
        payload = bytearray(window)  # private: the tensors of the body alias it
    finally:
        window.release()
    view = memoryview(payload)
    (count,) = struct.unpack_from("<I", view, 0)
    if 4 + 8 * count > length:
        return None
    lens = struct.unpack_from(f"<{count}Q", view, 4)
    pos = 4 + 8 * count
    frames = []
    for n in lens:
        frames.append(view[pos : pos + n])
        pos += n
    if pos != length:
        return None
    try:
        msg = decode_message(frames, limits=RECORD_LIMITS, jagged="column")
    except WireError:
        return None
    body = msg.body
    if msg.msg_type != "reply":  # a request logged as it was received (a put)
        body = {**body, "op": msg.msg_type}
    return start + length, body


def _next_record(buf: Any, pos: int) -> int | None:
    """Offset of the first valid record after ``pos`` (resynchronizing on the record magic)."""
    while True:
        pos = buf.find(RECORD_MAGIC, pos + 1)
        if pos < 0:
            return None
        if _record_at(buf, pos) is not None:
            return pos


def read_records(
    path: str, *, salvage: bool = False, skipped: list[tuple[int, int]] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(end_offset, body)`` for every good record of a log file, up to a torn tail.

    A bad record (short, wrong CRC, undecodable) followed by no valid record is a torn tail: the
    iteration ends there (its offset is the last ``end_offset`` yielded, or the file header).
    One followed by a valid record is corruption: ``CorruptLogError``, or with ``salvage`` the
    bad bytes are skipped (appended to ``skipped`` as ``(start, end)``) and reading resumes at
    the next valid record.

    Tensors of a body alias a private buffer of that record (nothing is shared with the file).

    Raises:
        ValueError: the file does not start with the log magic (not a queue log).
        CorruptLogError: a corrupt record with valid records after it (not with ``salvage``).
    """
    with open(path, "rb") as f:
        magic = f.read(len(FILE_MAGIC))
        if magic != FILE_MAGIC:
            raise ValueError(
                f"{path} is not a queue log (magic {magic!r}); point --data-dir at a "
                "directory of the queue's own files"
            )
        if os.fstat(f.fileno()).st_size == len(FILE_MAGIC):
            return
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = len(FILE_MAGIC)
        while pos < len(buf):
            record = _record_at(buf, pos)
            if record is None:
                resume = _next_record(buf, pos)
                if resume is None:
                    return  # a torn tail
                if not salvage:
                    raise CorruptLogError(path, pos, resume)
                logger.error(
                    "[queue] --salvage: %s: corrupt record at byte %d, %d bytes dropped; "
                    "replay resumes at byte %d",
                    path,
                    pos,
                    resume - pos,
                    resume,
                )
                if skipped is not None:
                    skipped.append((pos, resume))
                pos = resume
                continue
            pos, body = record
            yield pos, body
    finally:
        buf.close()


def log_files(data_dir: str) -> list[tuple[int, str]]:
    """``(generation, path)`` of the complete log files in ``data_dir``, oldest first."""
    out = []
    for name in os.listdir(data_dir):
        m = _LOG_NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(data_dir, name)))
    return sorted(out)


class DurableLog:
    """The append-only log of one queue server, written by its writer process.

    Args:
        data_dir: the directory (created if missing; one server per directory: see the lock).
        fsync: ``always``, ``interval`` or ``never`` (see the module docstring).
        fsync_interval_s: with ``interval``, the longest a written record stays un-fsynced.
        lock_wait_s: how long ``replay`` waits for the directory's lock.
        remote_reads: let the writer read large frames from this process's memory where the
            OS allows it (``log_writer.RemoteReader``); False sends every frame through the
            socket.
        salvage: a corrupt record in the middle of the log is dropped and the valid records
            after it are kept (``--salvage``); without it ``replay`` raises ``CorruptLogError``.

    Raises:
        ValueError: an unknown fsync policy or a non-positive interval.
    """

    def __init__(
        self,
        data_dir: str,
        *,
        fsync: str = "interval",
        fsync_interval_s: float = 1.0,
        lock_wait_s: float = LOCK_WAIT_S,
        remote_reads: bool = True,
        salvage: bool = False,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync={fsync!r}: use one of {FSYNC_POLICIES} (--fsync)")
        if not fsync_interval_s > 0:
            raise ValueError(
                f"fsync_interval_s={fsync_interval_s}: must be > 0 (--fsync-interval-s)"
            )
        self.data_dir = os.path.abspath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.lock_wait_s = lock_wait_s
        self.salvage = salvage
        # as the writer last reported them
        self.generation = 0
        self.file_bytes = 0  # bytes of the current log file
        self.written = 0  # sequence number of the last record the OS has (survives a SIGKILL)
        self.synced = 0  # ... of the last record fsynced (survives a machine crash)
        self.compactions = 0
        self.appended = 0  # sequence number of the last record appended
        self.error: RuntimeError | None = None  # the writer failed or died: nothing is logged
        self.writer_pid: int | None = None
        self._appended_bytes = 0
        self._written_bytes = 0
        self._lock: DirLock | None = None
        self._proc: subprocess.Popen | None = None
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._live: socket.socket | None = None  # EOF once the writer exited
        self._live_poll = select.poll()
        self.remote_reads = remote_reads
        self._remote = False  # the writer reads large frames from this process's memory
        # records whose frames the writer reads from here: (seq written when done, frames)
        self._held: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self._ipc_dir = ""
        self._opened = False  # the writer appends (``start`` returned)
        self._closing = False

    @property
    def pending_bytes(self) -> int:
        """Frame bytes appended and not yet reported written."""
        return self._appended_bytes - self._written_bytes

    # ---------------------------------------------------------------- recovery

    def replay(self, apply: Callable[[dict[str, Any]], None]) -> Replay:
        """Lock the directory, start the writer process, apply every good record of the newest
        log to ``apply`` and truncate a torn tail (call once, then ``start``).

        Args:
            apply: called with each record body (``op`` and its fields), in log order.

        Returns:
            What was read.

        Raises:
            ValueError: the directory is locked by another server (or its writer) for longer
                than ``lock_wait_s``; or its log is not a queue log.
            CorruptLogError: a corrupt record with valid records after it (without
                ``salvage``); nothing was changed on disk.
        """
        self._lock = DirLock(self.data_dir, self.lock_wait_s)
        t0 = time.perf_counter()
        try:
            self._spawn()  # it starts while the log is read
            out = self._replay(apply)
        except BaseException:
            self._release()
            raise
        out.seconds = time.perf_counter() - t0
        return out

    def _replay(self, apply: Callable[[dict[str, Any]], None]) -> Replay:
        files = log_files(self.data_dir)
        for name in os.listdir(self.data_dir):
            if name.startswith("log.") and name.endswith(".tmp"):
                os.unlink(os.path.join(self.data_dir, name))  # a compaction that did not finish
        out = Replay()
        if not files:
            self.generation = 1
            fd = os.open(log_path(self.data_dir, 1), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, FILE_MAGIC)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.data_dir)
            self.file_bytes = len(FILE_MAGIC)
            return out
        self.generation, path = files[-1]
        for _, old in files[:-1]:
            os.unlink(old)  # a compaction finished but did not remove its predecessor
        end = len(FILE_MAGIC)
        skipped: list[tuple[int, int]] = []
        for record_end, body in read_records(path, salvage=self.salvage, skipped=skipped):
            apply(body)
            out.records += 1
            end = record_end
        size = os.path.getsize(path)
        out.nbytes, out.truncated = end, size - end
        if skipped:
            end = self._rewrite_without(path, skipped, end)
            out.salvaged = sum(b - a for a, b in skipped)
            out.nbytes = end
        if out.truncated:
            logger.warning(
                "[queue] %s: a torn or corrupt record at byte %d (%d bytes) cut off the log",
                path,
                end,
                out.truncated,
            )
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, end)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.file_bytes = end
        return out

    def _rewrite_without(self, path: str, skipped: list[tuple[int, int]], end: int) -> int:
        """Replace the log by a copy without the ``skipped`` byte ranges and anything past
        ``end`` (``--salvage``), so that the next start reads it whole; returns its size."""
        tmp = path + ".tmp"
        keep, pos = [], len(FILE_MAGIC)
        for start, stop in skipped:
            keep.append((pos, start))
            pos = stop
        keep.append((pos, end))
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(FILE_MAGIC)
            for start, stop in keep:
                src.seek(start)
                while start < stop:
                    chunk = src.read(min(stop - start, 1 << 24))
                    dst.write(chunk)
                    start += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
            size = dst.tell()
        os.replace(tmp, path)
        fsync_dir(self.data_dir)
        logger.warning(
            "[queue] --salvage: %s rewritten without %d corrupt byte range(s) (%d bytes)",
            path,
            len(skipped),
            sum(b - a for a, b in skipped),
        )
        return size

    # ---------------------------------------------------------------- appending

    def _spawn(self) -> None:
        """Start the writer process; it connects while the server replays (then ``start``)."""
        self._ctx = zmq.Context(io_threads=1)  # the log's copies off the clients' I/O thread
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # the server bounds the lag (--log-lag), not zmq
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = tempfile.mkdtemp(prefix="xtoken-log-")  # 0700: only this user connects
        endpoint = f"ipc://{self._ipc_dir}/writer"
        self._sock.bind(endpoint)
        self._live, child_live = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "services.queue.log_writer", "--endpoint", endpoint]
        cmd += ["--parent-pid", str(os.getpid()), "--live-fd", str(child_live.fileno())]
        cmd += ["--lock-fd", str(self._lock.fd), "--data-dir", self.data_dir]
        cmd += ["--fsync", self.fsync, "--fsync-interval-s", repr(self.fsync_interval_s)]
        try:
            self._proc = subprocess.Popen(
                cmd,
                pass_fds=(child_live.fileno(), self._lock.fd),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_live.close()
        self.writer_pid = self._proc.pid
        if self.remote_reads:  # Yama (ptrace_scope 1) lets a process read only its descendants
            try:
                ctypes.CDLL(None).prctl(_PR_SET_PTRACER, self._proc.pid, 0, 0, 0)
            except AttributeError:  # not Linux: the writer's probe fails, frames go inline
                pass
        self._live_poll.register(self._live, select.POLLIN)

    def start(self) -> None:
        """Have the writer (started by ``replay``) open the log where the replay ended, and wait
        until it did.

        Call it from the thread that lives as long as the log (the main thread): on Linux the
        writer is killed when that thread ends (``PR_SET_PDEATHSIG``).

        Raises:
            RuntimeError: the writer did not start (its output is in the server's log).
        """
        assert self._proc is not None and not self._opened, "replay first, then start once"
        deadline = time.monotonic() + WRITER_START_S
        probe = bytearray(os.urandom(64) if self.remote_reads else b"")
        address = ctypes.addressof((ctypes.c_char * len(probe)).from_buffer(probe)) if probe else 0
        body = OPEN_BODY.pack(
            self.generation, self.file_bytes, address, len(probe), zlib.crc32(probe)
        )
        opening = [HEAD.pack(OPEN, 1, 0), body]
        try:
            while True:
                try:  # a PAIR socket refuses until its peer connected
                    self._sock.send_multipart(opening, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self._check_starting(deadline)
                    time.sleep(0.005)
            while not self._sock.poll(100):
                self._check_starting(deadline)
            ready = self._sock.recv()
            if ready[:1] != b"o":
                self._take(ready)  # what failed
                raise self.error or RuntimeError(f"unexpected {ready[:1]!r} from the log writer")
            self._remote = self.remote_reads and ready[1:] == b"\x01"
        except BaseException:
            self._release()
            raise
        self._opened = True
        shutil.rmtree(self._ipc_dir, ignore_errors=True)  # connected: nobody else can connect
        self._ipc_dir = ""
        self._lock.name_holders(os.getpid(), self.writer_pid)
        logger.info(
            "[queue] log writer pid %d appends to %s (large frames %s)",
            self.writer_pid,
            self.data_dir,
            "read from this process's memory" if self._remote else "through the socket",
        )

    def _check_starting(self, deadline: float) -> None:
        if self._proc.poll() is not None or time.monotonic() > deadline:
            self._proc.kill()
            raise RuntimeError(
                f"the log writer of {self.data_dir} did not start (exit code "
                f"{self._proc.wait()}, {WRITER_START_S:g}s at most); its output is above"
            )

    def pollables(self) -> list[Any]:
        """What the server's poller watches: the writer's reports, and its end (EOF)."""
        return [self._sock, self._live.fileno()]

    def append(self, op: str, body: dict[str, Any], urgent: bool = True) -> int:
        """Send one record to the writer; returns its sequence number (``written >= seq`` once
        the OS has it).

        The tensors of ``body`` are referenced until zmq sent them: do not change them.

        Args:
            op, body: the record (``encode_record``).
            urgent: somebody waits for it: the writer reports it at once (else within
                ``log_writer.REPORT_S``).

        Raises:
            RuntimeError: the writer failed or died (``error``).
        """
        return self._send(RECORD, encode_record(op, body), urgent)

    def append_frames(self, frames: list[Any], urgent: bool = True) -> int:
        """Send a request as it was received (``[header, body, *tensor frames]`` of a put: its
        message type is the record's ``op``), without encoding it again."""
        return self._send(RECORD, frames, urgent)

    def compact(self, snapshot: list[list[Any]]) -> int:
        """Start a new log generation with ``snapshot`` (encoded records of the whole state as
        of now); the records appended after this call follow it there."""
        for frames in snapshot:
            self._send(SNAPSHOT, frames, False)
        return self._send(SWITCH, [], True)

    def _send(self, kind: bytes, frames: list[Any], urgent: bool) -> int:
        if self.error is not None:
            raise RuntimeError(f"the queue log in {self.data_dir} failed: {self.error}")
        seq = 0
        if kind != SNAPSHOT:
            self.appended += 1
            seq = self.appended
        parts: list[int] = []  # (address, length) per frame; address 0: sent inline
        inline = []
        for frame in frames:
            view = memoryview(frame)
            address = 0
            if self._remote and view.nbytes >= COPY_BELOW and view.c_contiguous:
                try:
                    address = ctypes.addressof((ctypes.c_char * view.nbytes).from_buffer(view))
                except TypeError:  # read-only
                    pass
            if not address:
                inline.append((frame, view.nbytes))
            parts += (address, view.nbytes)
        self._appended_bytes += sum(parts[1::2])
        send = self._sock.send
        try:  # a PAIR socket without its peer would block: the writer is gone
            send(HEAD.pack(kind, urgent, seq), zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            self._writer_gone()
            raise RuntimeError(f"the queue log in {self.data_dir} failed: {self.error}") from None
        # frame by frame: send_multipart costs 3x as much; a large inline frame goes zero-copy
        # (this log's zmq I/O thread copies it out), a zmq.Frame from a client as it is
        send(struct.pack(f"<{len(parts)}Q", *parts), zmq.SNDMORE if inline else 0)
        last = len(inline) - 1
        for i, (frame, size) in enumerate(inline):
            send(frame, zmq.SNDMORE if i < last else 0, copy=size < COPY_BELOW)
        if len(inline) < len(frames):  # the writer reads the others where they are: keep them
            self._held.append((seq or self.appended + 1, frames))  # a snapshot's: its switch
        return seq

    def durable(self, seq: int, synced: bool) -> bool:
        """Whether record ``seq`` is written (``synced``: and fsynced), as last reported."""
        return (self.synced if synced else self.written) >= seq

    def poll(self) -> None:
        """Take in the writer's reports; notice a writer that died (then ``error`` is set)."""
        sock = self._sock
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            self._take(sock.recv())
        if self.error is None and not self._closing and self._live_poll.poll(0):
            self._writer_gone()

    def _writer_gone(self) -> None:
        """The writer exited: take what it reported last, then ``error`` names its end."""
        while self.error is None and self._sock.poll(200):
            self._take(self._sock.recv())
        if self.error is None:
            code = self._proc.wait()
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self._fail(f"the log writer (pid {self.writer_pid}) exited ({how})")

    def _take(self, msg: bytes) -> None:
        if msg[:1] == b"p":
            (
                self.written,
                self.synced,
                self._written_bytes,
                self.generation,
                self.file_bytes,
                self.compactions,
            ) = PROGRESS.unpack(msg[1:])
            held = self._held
            while held and held[0][0] <= self.written:
                held.popleft()
        else:
            self._fail(f"the log writer (pid {self.writer_pid}) failed: {msg[1:].decode()}")

    def _fail(self, message: str) -> None:
        logger.error(
            "[queue] %s; nothing more is logged: changes not written are not answered", message
        )
        self.error = RuntimeError(message)

    def close(self) -> None:
        """Have the writer write and fsync everything appended, and exit; release the lock."""
        proc = self._proc
        if self._opened and not self._closing and self.error is None:
            self._closing = True
            try:
                self._sock.send(HEAD.pack(CLOSE, 1, 0), zmq.NOBLOCK)
            except zmq.Again:
                self._writer_gone()
            deadline = time.monotonic() + CLOSE_S
            while self.error is None and self.synced < self.appended:
                if self._sock.poll(100):
                    self._take(self._sock.recv())
                elif proc.poll() is not None and not self._sock.poll(500):
                    self._fail(f"the log writer (pid {self.writer_pid}) exited before the close")
                elif time.monotonic() > deadline:
                    self._fail(f"the log writer did not finish within {CLOSE_S:g}s of the close")
        self._closing = True
        self._release()

    def _release(self) -> None:
        """Stop the writer (waiting for it to exit), close the sockets, release the lock."""
        if self._proc is not None:
            try:
                self._proc.wait(5 if self._opened else 0)
            except subprocess.TimeoutExpired:  # never opened, or stuck
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._held.clear()  # the writer is gone: nothing reads them any more
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = ""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = self._ctx = None
        if self._live is not None:
            self._live.close()
            self._live = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


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
    elif op == "acked_leases":
        pass  # the server's record of acked leases (server.py), not the store's
    else:
        raise ValueError(
            f"log record op {op!r} is unknown to this server; recover with the version that "
            "wrote the log"
        )
