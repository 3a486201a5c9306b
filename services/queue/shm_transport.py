"""Same-host puts and gets through the server's shared-memory pool (client side).

Over loopback TCP a put's bytes are copied twice by the kernel (into the socket and out of it)
and capped at the loopback rate. Through the pool (services/queue/shm_pool.py) a put is:
``reserve`` (a small round trip: the server lends a region of one of its /dev/shm segments,
sparse: no memory is committed yet), one ``posix_fallocate`` of the bytes the put will write
(``ShmRegion.commit``: memory is committed as it is written, by the writer), one memcpy of the
tensors into it (or none: ``QueueClient.reserve`` + ``ShmRegion.empty`` build them in place),
and a put of references (ext 3/4, xtoken_core/wire/shm.py). When /dev/shm cannot hold the bytes
(``ShmFullError``, before any byte is written) the put is sent as frames naming the reservation,
which gives the segment back at once (``auto``; one warning, frames from then on), or raises a
retryable ``shm_unavailable`` (``always``). The client maps
each pool segment once (cached by name), so a warm put touches no fresh page; the server stores
views of its own mapping and recycles the segment when the samples are cleared.

Gets: ``claim(..., shm=True)`` / ``get(..., shm=True)`` ask for references instead of frames
for the fields stored in the pool; the client returns views of its mapping.

**Lifetime contract of shm views.** A view returned by a claim/get with ``shm=True`` shows the
sample's bytes until that sample is removed from the queue (``clear`` of its key or partition,
by anyone); after that the server may lend the segment to another put, and the view then shows
that put's bytes. The view never becomes invalid memory (the mapping lives as long as the
tensor, even after the server unlinked the segment or exited). Views are read-only: the client
maps the pool ``PROT_READ`` for them, so a write into one is a SIGSEGV in the writer, never a
change of the stored sample (torch has no read-only tensors to raise instead). ``copy=True``
returns private, writable tensors (one memcpy out of the segment). Fields whose rows are not one contiguous run
of one stored put, or that were put as frames, still travel as frames.

Modes (``QueueClient(..., shm=...)``):
  * ``"auto"`` (default): for a same-host address (``ipc://``, ``tcp://127.x``,
    ``tcp://localhost``, ``tcp://[::1]``), puts of at least ``shm_min_bytes`` go through the
    pool once the server's hello says ``shm_pool: true``. For any other address (``tcp://queue:
    5555`` from a container beside the server's) the client reads the probe segment named in
    the hello (``shm_probe``: a random nonce in the server's /dev/shm) and uses the pool only
    when it finds the nonce, i.e. it shares the server's /dev/shm (docker ``ipc:
    service:queue``); otherwise it sends frames, silently. Anything that stops it (a server
    without it, a /dev/shm the server cannot grow or that is private to another container)
    falls back to frames for the rest of the client's life, with one warning.
  * ``"never"``: always frames.
  * ``"always"``: every put through shared memory, whatever its size or address; failures raise.

Puts reference only the region of their own reservation: the server refuses any other segment
(one the producer created, another server's, its probe) untouched, so a producer cannot make it
adopt, unlink or store bytes someone else can change.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from services.queue import errors as codes
from services.queue.errors import QueueError
from xtoken_core.ipc.shm import (
    SHM_DIR,
    ShmFullError,
    ShmReader,
    ShmRegion,
    check_name,
    sweep_orphans,
)
from xtoken_core.wire import BAD_BODY, UNKNOWN_TYPE, JaggedColumn
from xtoken_core.wire.shm import (
    fields_into_region,
    fields_layout_bytes,
    fields_nbytes,
)

logger = logging.getLogger(__name__)

SHM_MODES = ("auto", "never", "always")
DEFAULT_SHM_MIN_BYTES = 1 << 20
# A segment of a dead process this old is an orphan: its put never left the process, or its
# server was killed.
ORPHAN_AGE_S = 60.0
# Pool segments a client keeps mapped (least recently used dropped; views keep their own).
MAX_CACHED_SEGMENTS = 64
_LOOPBACK_TCP = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")
_LOCAL_PREFIXES = ("ipc://", "inproc://", *_LOOPBACK_TCP)


def is_same_host(address: str) -> bool:
    """True for addresses that can only reach a server on this host."""
    return address.startswith(_LOCAL_PREFIXES)


def shares_server_shm(probe: Any) -> bool:
    """Whether this process sees the server's /dev/shm: the hello's probe segment holds its nonce.

    Args:
        probe: the hello's ``shm_probe`` (``{name, nonce}``), or anything else (False).

    Returns:
        True only when the named segment exists here and starts with exactly the nonce.
    """
    if not isinstance(probe, dict):
        return False
    nonce = probe.get("nonce")
    if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
        return False
    try:
        name = check_name(probe.get("name"))
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (ValueError, OSError):
        return False
    try:
        return os.read(fd, len(nonce)) == nonce.encode()
    except OSError:
        return False
    finally:
        os.close(fd)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(0, int(round(seconds * 1000)))


class ShmPuts:
    """Decides which puts go through shared memory, sends them, and opens shm replies.

    One per client (not thread-safe, like the client).

    Args:
        address: the server endpoint.
        mode: ``"auto"``, ``"never"`` or ``"always"``.
        min_bytes: in ``auto`` mode, the smallest tensor payload sent through shared memory.

    Raises:
        ValueError: an unknown mode or a negative ``min_bytes``.
    """

    def __init__(self, address: str, mode: str, min_bytes: int) -> None:
        if mode not in SHM_MODES:
            raise ValueError(f"shm={mode!r}: use one of {SHM_MODES}")
        if min_bytes < 0:
            raise ValueError(f"shm_min_bytes={min_bytes}: must be >= 0")
        self.mode = mode
        self.address = address
        self.min_bytes = min_bytes if mode == "auto" else 0
        local = is_same_host(address)
        self.enabled = mode != "never"
        # auto, other address: the pool only if the hello's probe shows a shared /dev/shm
        self._probe_first = mode == "auto" and not local
        self.server: dict[str, Any] | None = None
        self.server_epoch: str | None = None  # the instance ``server`` (its hello) describes
        self.puts = 0
        self.rereserved = 0  # puts whose reservation an earlier server instance made
        self.busy = 0  # puts sent as frames because reservations held --shm-reserve-max
        self._region_epochs: dict[str, str | None] = {}  # reservation token -> instance
        # segment name -> bytes from 0 this client committed in it: pages stay allocated while
        # the segment lives and a name is never reused, so a warm put commits nothing again
        self._committed: dict[str, int] = {}
        # mappings of the server's pool segments: read-write for the regions this client
        # reserves and writes, read-only (PROT_READ) for the views claims and gets return, so
        # that a consumer cannot change a stored sample under every other reader
        self.writer = ShmReader(unlink=False, max_cached=MAX_CACHED_SEGMENTS)
        self.reader = ShmReader(unlink=False, max_cached=MAX_CACHED_SEGMENTS, writable=False)
        if self.enabled and local:
            # segments of producers killed before their put left the process (see module doc);
            # not through a probe: another container's pids are not ours to judge
            sweep_orphans(min_age_s=ORPHAN_AGE_S)

    def wants(self, fields: Any) -> bool:
        """Whether a put of these fields should go through shared memory."""
        return self.enabled and (self.min_bytes == 0 or fields_nbytes(fields) >= self.min_bytes)

    def pool(self, client: Any) -> bool:
        """Whether puts and replies may use the server's pool (asks hello once)."""
        if not self.enabled:
            return False
        if self.server is not None and client.epoch != self.server_epoch:
            self.server = None  # the server restarted: its replacement may lend no pool
        if self.server is None:
            self.server = client.hello()
            self.server_epoch = client.epoch
        if self._probe_first:
            self._probe_first = False
            if not shares_server_shm(self.server.get("shm_probe")):
                logger.debug("[queue-client] %s: no shared /dev/shm, frames", self.address)
                self.enabled = False
                return False
        return bool(self.server.get("shm_pool"))

    def give_up(self, why: str) -> None:
        """Stop using shared memory (one warning); in ``always`` mode raise instead.

        Raises:
            QueueError: in ``always`` mode.
        """
        if self.mode == "always":
            raise QueueError(
                codes.BAD_REQUEST, f"shm='always' but {why}; use shm='auto' to fall back to frames"
            )
        logger.warning("[queue-client] shared-memory puts off (%s): sending frames", why)
        self.enabled = False

    def reserve(self, client: Any, nbytes: int, timeout_s: float | None) -> ShmRegion:
        """Reserve a region of the server's pool and map it (cached by segment name).

        Args:
            client: the ``QueueClient``.
            nbytes: bytes needed (``fields_layout_bytes`` of the tensors).
            timeout_s: how long the server may wait for capacity (None: server default).

        Returns:
            The region, with its token.

        Raises:
            QueueError: the server's error (``queue_full``, ``shm_unavailable``, ...), or
                ``bad_request`` when the segment cannot be mapped here (another host or
                container: use frames).
        """
        reply = client.request(
            "reserve", {"nbytes": nbytes, "timeout_ms": _ms(timeout_s)}, wait_s=timeout_s or 0.0
        )
        if len(self._region_epochs) > 1024:
            self._region_epochs.clear()
        self._region_epochs[reply["token"]] = client.epoch
        try:
            base_S = self.writer.segment(reply["name"], reply["size"])
            return ShmRegion(
                reply["name"],
                reply["size"],
                base_S,
                reply["offset"],
                reply["nbytes"],
                reply["token"],
                committed=self._committed.get(reply["name"], 0),
            )
        except ValueError as e:
            raise QueueError(
                codes.SHM_UNAVAILABLE,
                f"cannot map the server's shared-memory segment: {e}; the server is not on this "
                "host or not in this /dev/shm: use shm='never'",
            ) from None

    def put(
        self,
        client: Any,
        body: dict[str, Any],
        wait_s: float,
        region: ShmRegion | None = None,
    ) -> dict[str, Any] | None:
        """Send a put through shared memory.

        Args:
            client: the ``QueueClient`` (its ``hello`` and ``request`` are used).
            body: the put body with tensor fields.
            wait_s: server-side wait of the put.
            region: a reservation the caller made (tensors built in it are not copied).

        Returns:
            The reply, or None when the put must be sent as frames instead (auto mode).

        Raises:
            QueueError: the server's error reply; in ``always`` mode also when shared memory
                cannot be used (``shm_unavailable``, retryable when /dev/shm is full).
        """
        if region is None and not self.pool(client):
            if not self.enabled:
                return None
            self.give_up("the server has no shared-memory pool")
            return None
        nbytes = 0
        if region is None:
            nbytes = fields_layout_bytes(body["fields"])
            limit = self.server.get("shm_reserve_max_bytes", nbytes)
            if nbytes > limit and self.mode != "always":
                return None  # more than may be held reserved: this put travels as frames
            try:
                region = self.reserve(client, nbytes, wait_s)
            except QueueError as e:
                if e.code == codes.SHM_BUSY:
                    self.busy += 1  # reservations hold --shm-reserve-max: this put as frames
                    return None
                if e.code not in (codes.SHM_UNAVAILABLE, UNKNOWN_TYPE):
                    raise
                self.give_up(str(e))
                return None
        epoch = self._region_epochs.get(region.token, client.epoch)
        try:
            region.commit(nbytes)  # our own region: all its pages in one call, before writing
            fields = fields_into_region(body["fields"], region)
        except ShmFullError as e:
            return self._put_frames_instead(client, body, wait_s, region, epoch, e)
        if region.offset <= self._committed.get(region.name, 0) < region.committed:
            if len(self._committed) > 4 * MAX_CACHED_SEGMENTS:
                self._committed.clear()
            self._committed[region.name] = region.committed
        try:
            reply = client.request(
                "put", {**body, "fields": fields, "reservation": region.token}, wait_s=wait_s
            )
        except QueueError as e:
            if e.code not in (codes.BAD_REQUEST, BAD_BODY) or client.epoch == epoch:
                raise
            # The reservation is of an instance that died (the put was sent again to its
            # replacement, or reserved before the restart): reserve on this one and copy the
            # fields over, or send frames if it lends no pool.
            self.rereserved += 1
            logger.warning(
                "[queue-client] %s restarted: the put's reservation is stale, reserving again",
                self.address,
            )
            if not self.pool(client):
                return client.request("put", body, wait_s=wait_s)
            return self.put(client, body, wait_s)
        self.puts += 1
        return reply

    def _put_frames_instead(
        self,
        client: Any,
        body: dict[str, Any],
        wait_s: float,
        region: ShmRegion,
        epoch: str | None,
        error: ShmFullError,
    ) -> dict[str, Any]:
        """/dev/shm cannot hold the put (nothing was written): send it as frames naming the
        reservation, so that the server takes the segment back at once; shared memory stays
        off for this client (one warning). In ``always`` mode raise instead.

        Raises:
            QueueError: ``shm_unavailable`` (retryable) in ``always`` mode; the server's error.
        """
        if self.mode == "always":
            raise QueueError(
                codes.SHM_UNAVAILABLE,
                f"shm='always' but {error.strerror}; retry when memory is freed, or use "
                "shm='auto' to fall back to frames over the socket",
                retryable=True,
            )
        if self.enabled:
            self.give_up(error.strerror)
        try:
            return client.request("put", {**body, "reservation": region.token}, wait_s=wait_s)
        except QueueError as e:
            if e.code not in (codes.BAD_REQUEST, BAD_BODY) or client.epoch == epoch:
                raise
            return client.request("put", body, wait_s=wait_s)  # a stale reservation: no token

    def private(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` with every view of a pool segment replaced by a private copy."""
        out = {}
        for name, value in fields.items():
            if isinstance(value, JaggedColumn):
                owned = self.reader.owns
                if owned(value.values) or owned(value.offsets):
                    value = JaggedColumn(value.values.clone(), value.offsets.clone())
            elif isinstance(value, torch.Tensor) and self.reader.owns(value):
                value = value.clone()
            out[name] = value
        return out
