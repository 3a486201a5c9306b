"""The server's recycled shared-memory pool: segments lent to same-host producers, put by reference.

A producer asks for a region (``reserve``), writes its tensors into it and puts references to
it; the server stores views of its own mapping of the segment (no byte copied, no page
allocated), and takes the segment back when the store drops the last sample that uses it. A
warm put therefore costs one memcpy into pages that are already there, and a claim can hand
out references into the same pages.

Memory is committed as it is written: a new segment is sparse (``ShmSegment.create(commit=
False)``), so a reserve of any size costs microseconds and no memory in the event loop; the
producer allocates the pages it writes before writing them (``ShmRegion``), and a full /dev/shm
is its retryable ``ShmFullError``, not a SIGBUS. The logical accounting is unchanged: a
segment's whole size counts against the capacity and the client's quota from its reserve on.
``check_refs`` makes sure every byte a put references has memory behind it (``back_ranges``)
before the server reads any, so a producer that skipped the commit cannot make it fault.
A freed segment stays committed as far as it was written; idle ones are unlinked.

Segment life cycle (one region = one whole segment)::

    create -> reserved (token, deadline) -> staged (put in progress or parked)
           -> stored (the store holds views) -> free -> reserved ... | unlinked
              reserved -> expired (deadline passed) -> unlinked one period later

* Names are ``xtk_<server pid>_<16 hex>`` (xtoken_core.ipc.shm); ``close`` unlinks all of them on
  a clean exit. A pool that made a segment holds an flock on its lock file
  ``/dev/shm/xtkpool_<instance>.lock`` for the server's life and lists there every segment it
  made: a starting server (``sweep_dead_pools``) removes the segments of every lock file it can
  lock (its server died, even SIGKILLed, whatever its pid: pid 1 of a container again), then the
  file. ``sweep_orphans`` (pid and age) remains for producers' segments.
* Free segments unused for ``idle_s`` are unlinked: an idle server gives its pool back.
* A reservation not used within ``reserve_s`` is retired: never lent again (its producer may
  still be writing), unlinked one period (at least ``RETIRE_MIN_S``) later.
* Sizes are rounded up to 1/8 of their power of two (at most 12.5% slack), so that puts of
  similar sizes reuse each other's segments; a free segment is reused for any request it
  holds with at most 25% slack.
* Bytes: every segment is memory the server holds. Stored ones are counted by the store (they
  are the storage of its blocks); reserved, staged and free ones are ``held_bytes`` and count
  against the same capacity; free ones are dropped first when room is needed and beyond
  ``max_free_bytes``.
* A released segment is reused only after the zero-copy replies sent before its release have
  left the process (``ready``), so a reply is never overwritten while on its way out.
* Checked (``verify``): when a put is stored, the server hashes the bytes it references, 1 MiB
  at a time (xxh3-64 under a per-server random seed), and
  ``check`` hashes the chunks under every row range it is about to read again. A process that
  wrote into the file after the put (any process of the server's user can open it; root in a
  container too) makes the read fail with ``TamperedError``: the changed bytes are never served.

No sockets here: the server shell (server.py) calls it from its event loop.
"""

from __future__ import annotations

import collections
import fcntl
import heapq
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from services.queue import errors as codes
from services.queue.errors import StoreError
from xtoken_core.ipc.shm import (
    ALIGN,
    NAME_RE,
    SHM_DIR,
    ShmFullError,
    ShmSegment,
    align_up,
    back_ranges,
)

logger = logging.getLogger(__name__)


def _digest(buf: memoryview, seed: int) -> int:
    """The seeded xxh3-64 of ``buf`` (~4 GB/s)."""
    return xxhash.xxh3_64_intdigest(buf, seed)


# Smallest segment: below this a frame costs less than a region.
MIN_SEGMENT_BYTES = 1 << 16
# A free segment serves a request of n bytes if it is at most this much larger.
REUSE_SLACK = 1.25
# An expired reservation's segment stays mapped (never lent) at least this long before unlink.
RETIRE_MIN_S = 10.0
# Tokens of completed puts remembered to answer a retried put (same request id) again.
USED_TOKENS = 1024
# Lock files of pools: <SHM_DIR>/xtkpool_<instance>.lock (not an xtk_ segment name).
LOCK_PREFIX = "xtkpool_"
# Stored bytes are hashed in chunks of this size: a read checks only the chunks under its rows.
DIGEST_CHUNK = 1 << 20


class TamperedError(StoreError):
    """Bytes of a stored put changed in its pool segment after the put: a process other than the
    server wrote into the file. Retryable: the server drops that put's samples, a retry reads
    the others.

    Attributes:
        ptr: the segment's mapping address (the storage of the stored views).
        name: the segment's name.
    """

    def __init__(self, ptr: int, name: str, chunk: int) -> None:
        super().__init__(
            codes.CORRUPT,
            f"bytes of shared-memory segment {name} changed after their put (at byte "
            f"{chunk * DIGEST_CHUNK} or later: another process wrote into {SHM_DIR}/{name}); "
            "its samples are dropped, never served: put them again, and keep other processes "
            "out of the queue's /dev/shm (run it under its own user or IPC namespace)",
            retryable=True,
        )
        self.ptr = ptr
        self.name = name


class PoolLock:
    """The lock file of one pool: flock-ed while its server lives, listing its segments.

    Made under a temporary name, locked, then renamed into place, so that a sweeping server
    never sees it unlocked. Names are appended (one line each) as segments are made; the list
    is rewritten when it holds many more names than live segments.

    Args:
        instance: the server instance (its epoch): the file's name.
        directory: where segments live (``/dev/shm``).
    """

    def __init__(self, instance: str, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"{LOCK_PREFIX}{instance}.lock")
        self._fd = self._locked_file(self.path, "")
        self.lines = 0

    @staticmethod
    def _locked_file(path: str, text: str) -> int:
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if text:
                os.write(fd, text.encode())
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def add(self, name: str) -> None:
        """List a segment this pool made (before anything references it)."""
        os.write(self._fd, f"{name}\n".encode())
        self.lines += 1

    def rewrite(self, names: list[str]) -> None:
        """Replace the list by ``names`` (the live segments), atomically."""
        fd = self._locked_file(self.path, "".join(f"{n}\n" for n in names))
        os.close(self._fd)
        self._fd, self.lines = fd, len(names)

    def close(self) -> None:
        """Remove the file and release the lock (clean exit: every segment is unlinked)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.abandon()

    def abandon(self) -> None:
        """Release the lock and keep the file, as a killed server does (tests)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep_dead_pools(directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments of every pool whose lock file nobody holds (its server died), and
    the file; files of this uid only, names of xtoken segments only.

    Returns:
        The segment names removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        if not (entry.startswith(LOCK_PREFIX) and entry.endswith(".lock")):
            continue
        path = os.path.join(directory, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its server lives
            with os.fdopen(os.dup(fd), encoding="utf-8", errors="replace") as f:
                names = f.read().split()
            for name in names:
                if not NAME_RE.fullmatch(name):
                    continue
                seg = os.path.join(directory, name)
                try:
                    if os.stat(seg, follow_symlinks=False).st_uid == os.geteuid():
                        os.unlink(seg)
                        removed.append(name)
                except FileNotFoundError:
                    pass
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    if removed:
        logger.info("[queue] removed %d shm segments of dead queue servers", len(removed))
    return removed


def segment_bytes(nbytes: int) -> int:
    """The segment size for a request of ``nbytes``: rounded up to 1/8 of its power of two."""
    n = max(MIN_SEGMENT_BYTES, align_up(nbytes))
    step = max(ALIGN, 1 << max(0, n.bit_length() - 4))  # 1/8 of the power of two below n
    return (n + step - 1) // step * step


@dataclass(eq=False)
class PoolSegment:
    """One segment of the pool and its state.

    Attributes:
        segment: the mapped segment (name, size).
        base_S: uint8 tensor ``[size]`` over the mapping; stored views share its storage.
        state: ``"free"``, ``"reserved"``, ``"staged"``, ``"stored"`` or ``"expired"``.
        token: the outstanding reservation's token.
        deadline: when an unused reservation is reclaimed (clock seconds).
        released_seq: the server's send counter when the segment was last released.
        uses: how many puts it has carried.
    """

    segment: ShmSegment
    base_S: torch.Tensor
    state: str = "free"
    token: str = ""
    deadline: float = 0.0
    released_seq: int = -1
    uses: int = 0
    owner: bytes = b""  # the client a reserved or staged segment counts against
    freed_at: float = 0.0  # clock seconds when it last became free
    backed: int = 0  # bytes [0, backed) are known to have memory behind them (check_refs)
    written: int = 0  # bytes [0, written) hold what the staged or stored put references
    digests: list[int] | None = None  # of each DIGEST_CHUNK of [0, written), once stored
    condemned: bool = False  # another process wrote into it: unlinked when released

    @property
    def name(self) -> str:
        """The segment name."""
        return self.segment.name

    @property
    def size(self) -> int:
        """The segment size in bytes."""
        return self.segment.size

    @property
    def ptr(self) -> int:
        """Address of the mapping in this process (the storage id of stored views)."""
        return self.base_S.data_ptr()


class ShmPool:
    """Shared-memory segments lent to producers and recycled when their samples are removed.

    Args:
        max_free_bytes: most bytes kept in free segments (more are unlinked).
        reserve_s: seconds a reservation stays valid without a put.
        clock: monotonic seconds; injectable for tests.
        idle_s: a free segment unused this long is unlinked (``--pool-idle-s``).
        instance: names the lock file (``PoolLock``) made with the first segment; None makes
            none (logic-object tests).
        verify: hash what a stored put references and check it before every read (``check``;
            ``--shm-verify``).

    Raises:
        ValueError: negative ``max_free_bytes``, a non-positive ``reserve_s`` or ``idle_s``.
    """

    def __init__(
        self,
        max_free_bytes: int,
        reserve_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = 30.0,
        instance: str | None = None,
        verify: bool = True,
    ) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s={idle_s}: must be > 0 (--pool-idle-s)")
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes={max_free_bytes}: must be >= 0 (--shm-pool-free)")
        if not reserve_s > 0:
            raise ValueError(f"reserve_s={reserve_s}: must be > 0 (--shm-reserve-timeout-s)")
        self.max_free_bytes = int(max_free_bytes)
        self.reserve_s = float(reserve_s)
        self.clock = clock
        self.segments: dict[str, PoolSegment] = {}  # name -> segment (what the decoder resolves)
        self.views: dict[str, torch.Tensor] = {}  # name -> base_S, for ShmReader(segments=...)
        self._by_ptr: dict[int, PoolSegment] = {}
        self._reserved: dict[str, PoolSegment] = {}  # token -> segment
        self._deadlines: list[tuple[float, str]] = []
        self._free: collections.deque[PoolSegment] = collections.deque()
        self._retired: collections.deque[tuple[float, PoolSegment]] = collections.deque()
        self._used_tokens: collections.OrderedDict[str, tuple[int, dict]] = (
            collections.OrderedDict()
        )
        self.held_bytes = 0  # reserved + staged + free: memory the store does not count
        self.free_bytes = 0
        self.created = self.reused = self.unlinked = self.expired = 0
        self._probe: tuple[ShmSegment, str] | None = None
        self._client_bytes: dict[bytes, int] = {}  # owner -> bytes reserved or staged
        self.idle_s = float(idle_s)
        self.idle_unlinked = 0  # free segments given back after idle_s
        self._instance = instance
        self._lock: PoolLock | None = None
        self.verify = verify
        self._seed = secrets.randbits(64)  # digests another process cannot compute ahead
        self.tampered = 0  # reads refused because a stored put's bytes changed

    def _listed(self, segment: ShmSegment) -> ShmSegment:
        """Name a new segment in the lock file, so that a next server sweeps it if this one is
        killed (a segment made just before a kill may escape: ``sweep_orphans`` catches it)."""
        if self._instance is None:
            return segment
        try:
            if self._lock is None:
                self._lock = PoolLock(self._instance)
            elif self._lock.lines > 4 * len(self.segments) + 64:
                self._lock.rewrite(
                    [*self.segments, *([self._probe[0].name] if self._probe else [])]
                )
            self._lock.add(segment.name)
        except OSError as e:
            logger.warning("[queue] shm pool lock file: %s (a SIGKILL would leave segments)", e)
        return segment

    # ---------------------------------------------------------------- probe

    def probe(self) -> dict[str, str] | None:
        """A tiny segment holding a random nonce, created on first use: ``{name, nonce}``.

        A client whose address does not prove it is on this host (``tcp://queue:5555`` from
        another container) reads the segment by name; only a process that sees this server's
        /dev/shm finds the nonce, so the pool is used exactly where it can work. None when no
        segment can be created (the hello then offers no probe).
        """
        if self._probe is None:
            nonce = secrets.token_hex(16)
            try:
                segment = self._listed(ShmSegment.create(len(nonce)))
            except OSError as e:
                logger.warning("[queue] no shared-memory probe segment: %s", e)
                return None
            segment.view(0, torch.uint8, (len(nonce),)).copy_(
                torch.frombuffer(bytearray(nonce.encode()), dtype=torch.uint8)
            )
            self._probe = (segment, nonce)
        segment, nonce = self._probe
        return {"name": segment.name, "nonce": nonce}

    # ---------------------------------------------------------------- reserve

    def client_bytes(self, owner: bytes) -> int:
        """Bytes of the segments ``owner`` holds reserved or staged (not yet stored)."""
        return self._client_bytes.get(owner, 0)

    def _own(self, seg: PoolSegment, owner: bytes) -> None:
        seg.owner = owner
        self._client_bytes[owner] = self._client_bytes.get(owner, 0) + seg.size

    def _disown(self, seg: PoolSegment) -> None:
        if not seg.owner:
            return
        left = self._client_bytes.get(seg.owner, 0) - seg.size
        if left > 0:
            self._client_bytes[seg.owner] = left
        else:
            self._client_bytes.pop(seg.owner, None)
        seg.owner = b""

    def reserve(
        self, nbytes: int, room: int, ready: Callable[[PoolSegment], bool], owner: bytes = b""
    ) -> PoolSegment | None:
        """Lend a segment of at least ``nbytes`` under a fresh token.

        Args:
            nbytes: bytes the producer needs.
            room: capacity bytes not used by the store nor held by the pool.
            ready: whether a free segment may be written again (its replies have left).
            owner: the client it is lent to (its bytes count in ``client_bytes`` until the
                put is stored, refused or the reservation expires).

        Returns:
            The reserved segment, or None when it does not fit in ``room`` even after dropping
            free segments (the caller waits for room or answers ``queue_full``).

        Raises:
            OSError: /dev/shm is full (the caller answers an error; nothing is left behind).
        """
        seg = self._take_free(nbytes, ready)
        if seg is None:
            size = segment_bytes(nbytes)
            while room < size and self._free:
                room += self._drop_oldest_free()  # its bytes were held: the room grows
            if room < size:
                return None
            seg = self._create(size)
        else:
            self.reused += 1
        seg.state = "reserved"
        self._own(seg, owner)
        seg.token = secrets.token_hex(16)
        seg.deadline = self.clock() + self.reserve_s
        self._reserved[seg.token] = seg
        heapq.heappush(self._deadlines, (seg.deadline, seg.token))
        return seg

    def _take_free(self, nbytes: int, ready: Callable[[PoolSegment], bool]) -> PoolSegment | None:
        best = None
        for seg in self._free:
            if nbytes <= seg.size <= REUSE_SLACK * nbytes + MIN_SEGMENT_BYTES and ready(seg):
                if best is None or seg.size < best.size:
                    best = seg
        if best is not None:
            self._free.remove(best)
            self.free_bytes -= best.size
        return best

    def _drop_oldest_free(self) -> int:
        """Unlink the oldest free segment; returns its size."""
        seg = self._free.popleft()
        self.free_bytes -= seg.size
        self._unlink(seg)
        return seg.size

    def trim(self, nbytes: int) -> int:
        """Unlink free segments until ``nbytes`` are given back (or none is left).

        Returns:
            Bytes given back.
        """
        freed = 0
        while freed < nbytes and self._free:
            freed += self._drop_oldest_free()
        return freed

    def _create(self, size: int) -> PoolSegment:
        # sparse: the producer commits what it writes (module doc)
        segment = self._listed(ShmSegment.create(size, commit=False))
        seg = PoolSegment(segment, segment.base())
        self.segments[seg.name] = seg
        self.views[seg.name] = seg.base_S
        self._by_ptr[seg.ptr] = seg
        self.held_bytes += seg.size
        self.created += 1
        return seg

    def _unlink(self, seg: PoolSegment) -> None:
        del self.segments[seg.name]
        del self.views[seg.name]
        del self._by_ptr[seg.ptr]
        self.held_bytes -= seg.size
        seg.segment.unlink()  # the mapping goes when the last view (ours, a reply's) is freed
        self.unlinked += 1

    # ---------------------------------------------------------------- put

    def stage(self, token: object, request_id: int) -> tuple[PoolSegment | None, dict | None]:
        """Take the reservation a put names, before the put is stored.

        Args:
            token: the put body's ``reservation``.
            request_id: the put's request id (a retry of a completed put carries the same).

        Returns:
            ``(segment, None)`` to go on with the put, or ``(None, reply)`` for a retried put
            that was already stored (answer it the same again).

        Raises:
            StoreError: ``bad_request`` for a token that is unknown, expired or already used by
                another put.
        """
        if not isinstance(token, str):
            raise StoreError(
                codes.BAD_REQUEST, f"put.reservation={token!r} must be the token of a reserve reply"
            )
        seg = self._reserved.pop(token, None)
        if seg is None:
            used = self._used_tokens.get(token)
            if used is not None and used[0] == request_id:
                return None, used[1]
            why = "was already used by another put (one put per reservation: reserve again)"
            if used is None:
                why = (
                    "is unknown or expired (reservations last --shm-reserve-timeout-s "
                    f"{self.reserve_s:g}s: reserve right before the put)"
                )
            raise StoreError(codes.BAD_REQUEST, f"shm reservation {token[:12]}... {why}")
        seg.state = "staged"
        return seg, None

    def check_refs(self, seg: PoolSegment | None, refs: list[tuple[str, int, int]]) -> None:
        """Refuse a put whose references into the pool leave its own reserved segment.

        Args:
            seg: the put's staged segment (None: the put named no reservation).
            refs: ``(name, start, end)`` of every shared-memory buffer the put references.

        Then make sure the referenced bytes have memory behind them (they were written, or
        are allocated now), so that no read of them can fault on a full /dev/shm.

        Raises:
            StoreError: ``bad_request`` naming the offending reference; ``shm_unavailable``
                (retryable) when bytes the producer referenced but never wrote cannot be
                allocated.
        """
        ranges: list[tuple[int, int]] = []
        for name, start, end in refs:
            if name not in self.segments:
                continue  # a producer's own segment (adopted; xtoken_core/wire/shm.py)
            if seg is None:
                raise StoreError(
                    codes.BAD_REQUEST,
                    f"put references pool segment {name} without a reservation; send the "
                    "reserve reply's token as put.reservation",
                )
            if name != seg.name or not 0 <= start <= end <= seg.size:
                raise StoreError(
                    codes.BAD_REQUEST,
                    f"put references {name}[{start}:{end}], outside its reservation "
                    f"{seg.name}[0:{seg.size}]",
                )
            seg.written = max(seg.written, end)
            if end > seg.backed:  # pages once backed stay so: a warm put checks nothing
                ranges.append((start, end))
        if not ranges:
            return
        try:
            if back_ranges(seg.name, ranges) is None:
                # the file was removed under a running server: its mapping is still valid
                logger.debug("[queue] shm segment %s is unlinked: refs not checked", seg.name)
                return
        except ShmFullError as e:
            raise StoreError(
                codes.SHM_UNAVAILABLE,
                f"the put references bytes of its reservation that it never wrote, and the "
                f"server cannot back them: {e.strerror}; write (or ShmRegion.commit) every byte "
                "a put references, or send the put as frames",
                retryable=True,
            ) from None
        for start, end in sorted(ranges):  # extend the backed prefix over adjacent ranges
            if start > seg.backed + ALIGN:
                break
            seg.backed = max(seg.backed, end)

    def stored(self, seg: PoolSegment, referenced: bool, request_id: int, reply: dict) -> None:
        """The put is in the store: its bytes are the store's now. Remember the token (to
        answer a retry), and take the segment back at once when the store kept no view of it
        (every cell a duplicate, or copied out)."""
        self._used_tokens[seg.token] = (request_id, reply)
        while len(self._used_tokens) > USED_TOKENS:
            self._used_tokens.popitem(last=False)
        seg.token = ""
        seg.uses += 1
        seg.state = "stored"
        self._disown(seg)
        self.held_bytes -= seg.size
        if not referenced:
            self.release(seg.ptr, -1)
        elif self.verify:
            data = self._bytes(seg)
            seg.digests = [
                _digest(data[i : min(i + DIGEST_CHUNK, seg.written)], self._seed)
                for i in range(0, seg.written, DIGEST_CHUNK)
            ]

    @staticmethod
    def _bytes(seg: PoolSegment) -> memoryview:
        """The segment's mapping as bytes (no copy)."""
        return memoryview(seg.base_S.numpy())

    def check(self, ptr: int, start: int, end: int) -> None:
        """Before bytes ``[start, end)`` of storage ``ptr`` are read (served, copied): if the
        storage is a stored pool segment, make sure they are what its put stored.

        Args:
            ptr: data pointer of the storage the rows view.
            start: first byte of the rows in that storage.
            end: byte after the rows.

        Raises:
            TamperedError: a chunk under the range hashes differently than when it was stored.
        """
        seg = self._by_ptr.get(ptr)
        if seg is None or seg.digests is None or start >= end:
            return
        data = self._bytes(seg)
        first, last = start // DIGEST_CHUNK, min(end, seg.written) - 1
        for chunk in range(first, last // DIGEST_CHUNK + 1):
            at = chunk * DIGEST_CHUNK
            if (
                _digest(data[at : min(at + DIGEST_CHUNK, seg.written)], self._seed)
                != (seg.digests[chunk])
            ):
                self.tampered += 1
                raise TamperedError(ptr, seg.name, chunk)

    def unstage(self, seg: PoolSegment) -> None:
        """A staged put was refused or timed out: the segment is free again (no reply ever
        referenced it)."""
        if seg.state in ("staged", "reserved"):
            self._to_free(seg, -1)

    def release(self, ptr: int, send_seq: int) -> None:
        """The store dropped the last view of a storage: a stored segment becomes free.

        Args:
            ptr: the storage's data pointer (ignored unless it is a stored pool segment).
            send_seq: the server's send counter now (see ``ready`` of ``reserve``).
        """
        seg = self._by_ptr.get(ptr)
        if seg is None or seg.state != "stored":
            return
        self.held_bytes += seg.size
        self._to_free(seg, send_seq)

    def condemn(self, ptr: int) -> None:
        """Never lend the segment at ``ptr`` again (a process other than its producer wrote into
        it): it is unlinked once the store drops its samples."""
        seg = self._by_ptr.get(ptr)
        if seg is not None:
            seg.condemned = True

    def _to_free(self, seg: PoolSegment, send_seq: int) -> None:
        self._disown(seg)
        seg.state, seg.token, seg.released_seq = "free", "", send_seq
        seg.written, seg.digests = 0, None
        seg.freed_at = self.clock()
        if seg.condemned or self.free_bytes + seg.size > self.max_free_bytes:
            self._unlink(seg)
            return
        self._free.append(seg)
        self.free_bytes += seg.size

    # ---------------------------------------------------------------- reads

    def locate(self, tensor: torch.Tensor) -> PoolSegment | None:
        """The stored segment a tensor views, or None."""
        seg = self._by_ptr.get(tensor.untyped_storage().data_ptr())
        return seg if seg is not None and seg.state == "stored" else None

    @property
    def stored_segments(self) -> int:
        """Segments whose views the store holds."""
        return sum(1 for s in self.segments.values() if s.state == "stored")

    # ---------------------------------------------------------------- timers

    def expire(self, now: float | None = None) -> int:
        """Retire reservations past their deadline, and unlink the segments retired one period
        ago; returns how many reservations expired now."""
        now = self.clock() if now is None else now
        n = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token = heapq.heappop(self._deadlines)
            seg = self._reserved.pop(token, None)
            if seg is None:
                continue
            # Never lent again: a producer that stalled past the deadline may still be writing
            # into it. Kept mapped for one more period (its late put gets "expired", not "no
            # such segment"), then unlinked; its bytes stay counted until then.
            logger.info("[queue] shm reservation of %s expired unused: retired", seg.name)
            seg.state, seg.token = "expired", ""
            self._disown(seg)
            self._retired.append((now + max(self.reserve_s, RETIRE_MIN_S), seg))
            n += 1
        while self._retired and self._retired[0][0] <= now:
            self._unlink(self._retired.popleft()[1])
        # free segments, oldest first (appended as freed): given back once unused for idle_s
        while self._free and self._free[0].freed_at + self.idle_s <= now:
            self._drop_oldest_free()
            self.idle_unlinked += 1
        self.expired += n
        return n

    def next_deadline(self) -> float | None:
        """Earliest reservation deadline, retired segment's unlink time or idle free segment's
        unlink time, or None."""
        while self._deadlines and self._deadlines[0][1] not in self._reserved:
            heapq.heappop(self._deadlines)
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self._retired:
            times.append(self._retired[0][0])
        if self._free:
            times.append(self._free[0].freed_at + self.idle_s)
        return min(times) if times else None

    # ---------------------------------------------------------------- lifecycle

    def stats(self) -> dict:
        """Segments and bytes by state, and counters."""
        by_state: collections.Counter[str] = collections.Counter()
        bytes_by_state: collections.Counter[str] = collections.Counter()
        for seg in self.segments.values():
            by_state[seg.state] += 1
            bytes_by_state[seg.state] += seg.size
        return {
            "segments": len(self.segments),
            "bytes": sum(s.size for s in self.segments.values()),
            "held_bytes": self.held_bytes,
            "max_free_bytes": self.max_free_bytes,
            "by_state": dict(by_state),
            "bytes_by_state": dict(bytes_by_state),
            "created": self.created,
            "reused": self.reused,
            "unlinked": self.unlinked,
            "expired": self.expired,
            "idle_unlinked": self.idle_unlinked,
            "verify": self.verify,
            "tampered": self.tampered,
        }

    def close(self) -> int:
        """Unlink every segment (clean exit); returns how many. Mappings stay valid in every
        process that still maps them until it drops them."""
        n = len(self.segments)
        if self._probe is not None:
            self._probe[0].unlink()
            self._probe = None
        for seg in list(self.segments.values()):
            seg.segment.unlink()
        self.segments.clear()
        self.views.clear()
        self._by_ptr.clear()
        self._free.clear()
        self._retired.clear()
        self._reserved.clear()
        self._client_bytes.clear()
        self.held_bytes = self.free_bytes = 0
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if n:
            logger.info("[queue] shm pool: unlinked %d segments", n)
        return n
