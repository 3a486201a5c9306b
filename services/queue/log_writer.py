"""The durable log's writer process: checksums, writes and fsyncs the records its server sends.

Started by ``DurableLog.replay`` (durable.py) as ``python -m services.queue.log_writer``, never by
hand, so that it starts while the log is read. It imports neither torch nor the wire codec (a
record's frames are written as received), and its CPU work (CRC32 and the copy into the page
cache) runs beside the server's event loop, never under its GIL.

Messages over one zmq PAIR socket (ipc, in a private directory the server removes once the
writer connected):

    server -> writer   [head, *frames]   head = kind u8 | urgent u8 | seq u64 (little-endian)
        o  open (first, once the server replayed the log): ``OPEN_BODY``
        r  a record, written to the current generation: [head, parts, *inline frames]; parts
           = (address u64, length u64) per frame of the record, address 0 for the next inline
           frame, else the frame is read from the server's memory (``RemoteReader``)
        s  a record of a snapshot, as ``r``: written to the next generation's ``.tmp`` file
        g  switch to that snapshot (``seq``: the compaction); fsync, rename, remove the old file
        c  close: write what came before, fsync, report, exit 0
    writer -> server   b"o" + u8 once open (1: it reads the server's memory; 0: the server sends
                       every frame inline); b"p" + PROGRESS (written, synced, written_bytes,
                       generation, file_bytes, compactions) after records somebody waits for
                       (``urgent``), an fsync or a switch, else at most every ``REPORT_S``;
                       b"e" + text when writing failed (then it exits 1).

The server keeps a record's frames alive until the writer reports it written, so an address it
sent stays valid (and unchanged: stored samples are never written to) while the writer reads.

The writer dies with its server: ``PR_SET_PDEATHSIG`` (Linux) kills it when the thread that
started it ends, and it exits once its end of the liveness socket pair reads EOF (the server's end
closed: the server exited, however). It inherits the server's lock on the data directory (one
open file description: the lock is held while either process lives). SIGINT and SIGTERM are
ignored: a terminal's Ctrl-C or a process-group SIGTERM reaches the server, which drains and then
sends ``c``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import logging
import os
import signal
import struct
import sys
import time
import zlib
from typing import Any

import zmq

logger = logging.getLogger(__name__)

FILE_MAGIC = b"XTKQLOG1"
RECORD_MAGIC = b"XTKR"
RECORD_HEAD = struct.Struct("<4sIQ")
FSYNC_POLICIES = ("always", "interval", "never")
# server -> writer: kind, urgent, sequence number
HEAD = struct.Struct("<cBQ")
OPEN, RECORD, SNAPSHOT, SWITCH, CLOSE = b"o", b"r", b"s", b"g", b"c"
# after OPEN: the generation to append to, the offset of its end, and a probe of the server's
# memory (address, length, crc32) that says whether ``RemoteReader`` may be used
OPEN_BODY = struct.Struct("<QQQQI")
# writer -> server after b"p": written, synced, written_bytes, generation, file_bytes, compactions
PROGRESS = struct.Struct("<6Q")
# writev takes at most this many buffers at once (IOV_MAX is 1024 on Linux).
_IOV_MAX = 1024
# Bytes per write call (see writev_all).
WRITE_CHUNK = 1 << 20
# Progress nobody waits for is reported at most this often (the server's view of the lag).
REPORT_S = 0.02
# Messages taken in one go before writing, fsyncing and reporting (group commit, bounded).
DRAIN_MAX = 256
# The writer's nice value: on a busy host the event loop and the clients go first (a put
# answered at once is not delayed by the write of the one before it).
WRITER_NICE = 19
_PR_SET_PDEATHSIG = 1


def log_path(data_dir: str, generation: int) -> str:
    """The file of one log generation."""
    return os.path.join(data_dir, f"log.{generation:016d}")


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class RemoteReader:
    """Reads the server's memory (``process_vm_readv``) into one reusable buffer: a record's
    large frames are copied once, by the writer, instead of through a socket (a copy in each
    process's zmq I/O thread).

    Args:
        pid: the server's pid (it allowed this process with ``PR_SET_PTRACER`` where Yama asks).
        size: the buffer's bytes (the most one ``read`` returns).

    Raises:
        OSError: the C library has no ``process_vm_readv`` (not Linux).
    """

    def __init__(self, pid: int, size: int = WRITE_CHUNK) -> None:
        self.pid = pid
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._base = ctypes.addressof((ctypes.c_char * size).from_buffer(self._buf))
        try:
            readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
        except AttributeError:
            raise OSError(errno.ENOSYS, "no process_vm_readv in the C library") from None
        readv.restype = ctypes.c_ssize_t
        iov = ctypes.POINTER(_IOVec)
        readv.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
        self._readv = readv

    def read(self, address: int, n: int) -> memoryview:
        """``n`` bytes (at most the buffer's size) of the server's memory at ``address``; the
        view is valid until the next ``read``.

        Raises:
            OSError: not allowed (ptrace rules, seccomp) or the server is gone.
        """
        done = 0
        while done < n:
            local = _IOVec(self._base + done, n - done)
            remote = _IOVec(address + done, n - done)
            got = self._readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                code = ctypes.get_errno() or errno.EIO
                raise OSError(code, f"process_vm_readv of pid {self.pid}: {os.strerror(code)}")
            done += got
        return self._view[:n]


def write_record(
    fd: int, offset: int, parts: list[tuple[int, int]], inline: list[Any], reader: Any
) -> int:
    """Write one record at ``offset`` (the end of ``fd``'s file) and return its bytes.

    Args:
        parts: ``(address, length)`` per frame of the record: address 0 = the next of ``inline``,
            else the frame is in the server's memory (read with ``reader``).
        inline: the frames that came in the message.
        reader: a ``RemoteReader`` (None when every frame is inline).

    A record read from the server's memory is streamed: ``WRITE_CHUNK`` pieces are read,
    checksummed and written while in the cache, then the head (with the CRC) is written over a
    zeroed one. Until then the record reads as torn (no magic), so a crash in between leaves
    nothing a replay would apply.
    """
    table = struct.pack(f"<I{len(parts)}Q", len(parts), *(n for _, n in parts))
    length = len(table) + sum(n for _, n in parts)
    crc = zlib.crc32(table)
    if all(address == 0 for address, _ in parts):  # in one writev, head first
        views = [memoryview(f).cast("B") for f in inline]
        for v in views:
            crc = zlib.crc32(v, crc)
        writev_all(fd, [RECORD_HEAD.pack(RECORD_MAGIC, crc, length), table, *views])
        return RECORD_HEAD.size + length
    pending: list[Any] = [bytes(RECORD_HEAD.size), table]
    frames = iter(inline)
    for address, n in parts:
        if address == 0:
            view = memoryview(next(frames)).cast("B")
            crc = zlib.crc32(view, crc)
            pending.append(view)
            continue
        for start in range(0, n, WRITE_CHUNK):
            piece = reader.read(address + start, min(WRITE_CHUNK, n - start))
            crc = zlib.crc32(piece, crc)
            pending.append(piece)
            writev_all(fd, pending)  # before the reader's buffer is read into again
            pending = []
    writev_all(fd, pending)
    os.pwrite(fd, RECORD_HEAD.pack(RECORD_MAGIC, crc, length), offset)
    return RECORD_HEAD.size + length


def fsync_dir(path: str) -> None:
    """fsync a directory (a file created or renamed in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writev_all(fd: int, buffers: list[Any]) -> None:
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


class LogFile:
    """The writer's side of one log: the open generation, a snapshot being written, counters.

    Args:
        data_dir: the log's directory.
        generation: the generation to append to (its file exists, ``offset`` bytes long).
        offset: where appending goes on (the end of its last good record).
        fsync: ``always``, ``interval`` or ``never``.
        fsync_interval_s: with ``interval``, the longest a written record stays un-fsynced.
    """

    def __init__(
        self, data_dir: str, generation: int, offset: int, fsync: str, fsync_interval_s: float
    ) -> None:
        self.data_dir = data_dir
        self.generation = generation
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.fd = os.open(log_path(data_dir, generation), os.O_WRONLY)
        os.lseek(self.fd, offset, os.SEEK_SET)
        self.file_bytes = offset
        self.written = self.synced = 0  # sequence numbers
        self.written_bytes = 0  # frame bytes of the records written (the server's measure)
        self.compactions = 0
        self.last_sync = time.monotonic()
        self._tmp_fd = -1  # the snapshot of a compaction in progress
        self._tmp_bytes = 0

    def progress(self) -> bytes:
        """The progress report (``PROGRESS`` after ``b"p"``)."""
        return b"p" + PROGRESS.pack(
            self.written,
            self.synced,
            self.written_bytes,
            self.generation,
            self.file_bytes,
            self.compactions,
        )

    def handle(self, kind: bytes, seq: int, frames: list[Any], reader: Any) -> None:
        """Apply one message of the server (``RECORD``, ``SNAPSHOT`` or ``SWITCH``): ``frames``
        are its frames after the head (``PARTS``, then the inline frames)."""
        if kind == SWITCH:
            if self._tmp_fd < 0:
                self._open_snapshot()  # an empty store: the snapshot is the file header
            self._switch()
        elif kind in (RECORD, SNAPSHOT):
            table = frames[0].bytes
            flat = struct.unpack(f"<{len(table) // 8}Q", table)
            parts = list(zip(flat[::2], flat[1::2]))
            if kind == RECORD:
                self.file_bytes += write_record(self.fd, self.file_bytes, parts, frames[1:], reader)
            else:
                if self._tmp_fd < 0:
                    self._open_snapshot()
                self._tmp_bytes += write_record(
                    self._tmp_fd, self._tmp_bytes, parts, frames[1:], reader
                )
            self.written_bytes += sum(flat[1::2])
        else:
            raise ValueError(f"unknown message kind {kind!r} from the queue server")
        if seq:
            assert seq == self.written + 1, (seq, self.written)
            self.written = seq
            if kind == SWITCH:  # everything up to here is in the fsynced snapshot
                self.synced = seq

    def sync_due(self, closing: bool) -> bool:
        """Whether the records written so far are to be fsynced now."""
        if self.synced >= self.written:
            return False
        return (
            closing
            or self.fsync == "always"
            or (
                self.fsync == "interval"
                and time.monotonic() - self.last_sync >= self.fsync_interval_s
            )
        )

    def sync(self) -> None:
        """fsync the current generation; ``synced`` catches up with ``written``."""
        os.fsync(self.fd)
        self.last_sync = time.monotonic()
        self.synced = self.written

    def next_sync_s(self) -> float | None:
        """Seconds until the ``interval`` fsync of what is written (None: none due)."""
        if self.fsync != "interval" or self.synced >= self.written:
            return None
        return max(0.0, self.last_sync + self.fsync_interval_s - time.monotonic())

    def close(self) -> None:
        """Close the files (a snapshot not switched to is left as ``.tmp``: replay removes it)."""
        if self._tmp_fd >= 0:
            os.close(self._tmp_fd)
            self._tmp_fd = -1
        os.close(self.fd)

    def _open_snapshot(self) -> None:
        tmp = log_path(self.data_dir, self.generation + 1) + ".tmp"
        self._tmp_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(self._tmp_fd, FILE_MAGIC)
        self._tmp_bytes = len(FILE_MAGIC)

    def _switch(self) -> None:
        generation = self.generation + 1
        path = log_path(self.data_dir, generation)
        os.fsync(self._tmp_fd)
        os.rename(path + ".tmp", path)
        fsync_dir(self.data_dir)
        old_fd, old_path = self.fd, log_path(self.data_dir, self.generation)
        self.fd, self.generation, self.file_bytes = self._tmp_fd, generation, self._tmp_bytes
        self._tmp_fd = -1
        os.close(old_fd)
        os.unlink(old_path)
        self.compactions += 1
        self.last_sync = time.monotonic()


def serve(sock: zmq.Socket, live_fd: int, log: LogFile, reader: RemoteReader | None) -> int:
    """Write what the server sends until it says ``close`` (0) or is gone (0; what it sent last
    may be unwritten: its replies were never sent). A failed write is reported (``b"e"``), 1."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(live_fd, zmq.POLLIN)
    reported = (0, 0)  # (written, synced) of the last report
    last_report = 0.0
    closing = False
    while not closing:
        timeouts = [log.next_sync_s()]
        if (log.written, log.synced) != reported:
            timeouts.append(max(0.0, last_report + REPORT_S - time.monotonic()))
        timeouts = [t for t in timeouts if t is not None]
        ready = dict(poller.poll(int(min(timeouts) * 1000) + 1 if timeouts else None))
        if ready.get(live_fd):  # the server is gone: nobody to report to
            sock.setsockopt(zmq.LINGER, 0)
            return 0
        urgent = False
        try:
            for _ in range(DRAIN_MAX):
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                kind, wait, seq = HEAD.unpack(msg[0].bytes)
                if kind == CLOSE:
                    closing = urgent = True
                    break
                log.handle(kind, seq, msg[1:], reader)
                urgent = urgent or bool(wait) or kind == SWITCH
            if log.sync_due(closing):
                log.sync()
                urgent = True
        except Exception as e:  # disk full, I/O error: the server must stop
            logger.exception("[queue] the log writer failed")
            sock.send(b"e" + f"{type(e).__name__}: {e}".encode())
            return 1
        now = time.monotonic()
        if (log.written, log.synced) != reported and (urgent or now - last_report >= REPORT_S):
            sock.send(log.progress())
            reported, last_report = (log.written, log.synced), now
        elif closing:
            sock.send(log.progress())
    log.close()
    return 0


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux); exit if the parent
    is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the liveness socket alone
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """The writer process (see the module docstring); arguments come from ``DurableLog``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--live-fd", type=int, required=True)
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--fsync", choices=FSYNC_POLICIES, required=True)
    parser.add_argument("--fsync-interval-s", type=float, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        os.nice(WRITER_NICE)
    except OSError:  # not allowed: normal priority
        pass
    # args.lock_fd stays open (inherited) until this process exits: the data directory's lock.
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.RCVHWM, 0)  # the server bounds the lag (--log-lag), not zmq
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(args.endpoint)
    # started while the server replays: where to append comes once it is done
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(args.live_fd, zmq.POLLIN)
    if args.live_fd in dict(poller.poll()):
        return 0
    msg = sock.recv_multipart()
    kind, _, _ = HEAD.unpack(msg[0])
    if kind != OPEN:
        raise ValueError(f"message kind {kind!r} before open from the queue server")
    generation, offset, probe, probe_len, probe_crc = OPEN_BODY.unpack(msg[1])
    try:
        log = LogFile(args.data_dir, generation, offset, args.fsync, args.fsync_interval_s)
    except OSError as e:
        sock.send(b"e" + f"cannot open the log: {e}".encode())
        return 1
    reader: RemoteReader | None = None
    try:
        reader = RemoteReader(args.parent_pid)
        if zlib.crc32(reader.read(probe, probe_len)) != probe_crc:
            raise OSError(errno.EFAULT, "the probe read back different bytes")
    except OSError as e:
        reader = None
        logger.info("[queue] log records come through the socket: %s", e)
    sock.send(b"o" + bytes([reader is not None]))  # ready
    code = serve(sock, args.live_fd, log, reader)
    sock.close()
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
