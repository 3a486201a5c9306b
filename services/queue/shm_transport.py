"""Same-host puts and gets through the server's shared-memory pool (client side).

Over loopback TCP a put's bytes are copied twice by the kernel (into the socket and out of it)
and capped at the loopback rate. Through the pool (services/queue/shm_pool.py) a put is:
``reserve`` (a small round trip: the server lends a region of one of its /dev/shm segments),
one memcpy of the tensors into it (or none: ``QueueClient.reserve`` + ``ShmRegion.empty`` build
them in place), and a put of references (ext 3/4, xtoken_core/wire/shm.py). The client maps
each pool segment once (cached by name), so a warm put touches no fresh page; the server stores
views of its own mapping and recycles the segment when the samples are cleared.

Gets: ``claim(..., shm=True)`` / ``get(..., shm=True)`` ask for references instead of frames
for the fields stored in the pool; the client returns views of its mapping.

**Lifetime contract of shm views.** A view returned by a claim/get with ``shm=True`` shows the
sample's bytes until that sample is removed from the queue (``clear`` of its key or partition,
by anyone); after that the server may lend the segment to another put, and the view then shows
that put's bytes. The view never becomes invalid memory (the mapping lives as long as the
tensor, even after the server unlinked the segment or exited). Views are read-only by contract:
writing into one changes the stored sample for every reader. ``copy=True`` returns private
tensors instead (one memcpy out of the segment). Fields whose rows are not one contiguous run
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

A server that says ``shm: true`` but not ``shm_pool`` gets the older per-put segments: the
client writes a fresh segment per put, the server adopts (maps and unlinks) it. A client killed
between writing such a segment and sending it leaves a file that ``sweep_orphans`` removes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from services.queue import errors as codes
from services.queue.errors import QueueError
from xtoken_core.ipc.shm import SHM_DIR, ShmReader, ShmRegion, check_name, sweep_orphans
from xtoken_core.wire import BAD_BODY, UNKNOWN_TYPE, JaggedColumn
from xtoken_core.wire.shm import (
    fields_into_region,
    fields_layout_bytes,
    fields_nbytes,
    fields_to_shm,
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
        # per-put segments only where they beat frames (not over a unix socket)
        self._per_put_ok = mode == "always" or address.startswith(_LOOPBACK_TCP)
        self.server: dict[str, Any] | None = None
        self.puts = 0
        # mappings of the server's pool segments, shared by puts and shm replies
        self.reader = ShmReader(unlink=False, max_cached=MAX_CACHED_SEGMENTS)
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
        if self.server is None:
            self.server = client.hello()
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
        try:
            base_S = self.reader.segment(reply["name"], reply["size"])
            return ShmRegion(
                reply["name"],
                reply["size"],
                base_S,
                reply["offset"],
                reply["nbytes"],
                reply["token"],
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
                cannot be used.
        """
        if region is None and not self.pool(client):
            if not self.enabled:
                return None
            if self.server.get("shm") and self._per_put_ok:
                return self._put_per_segment(client, body, wait_s)
            self.give_up("the server has no shared-memory pool")
            return None
        if region is None:
            try:
                region = self.reserve(client, fields_layout_bytes(body["fields"]), wait_s)
            except QueueError as e:
                if e.code not in (codes.SHM_UNAVAILABLE, UNKNOWN_TYPE):
                    raise
                self.give_up(str(e))
                return None
        fields = fields_into_region(body["fields"], region)
        reply = client.request(
            "put", {**body, "fields": fields, "reservation": region.token}, wait_s=wait_s
        )
        self.puts += 1
        return reply

    def _put_per_segment(
        self, client: Any, body: dict[str, Any], wait_s: float
    ) -> dict[str, Any] | None:
        """The older path: one fresh segment per put, adopted by the server."""
        try:
            segment, fields = fields_to_shm(body["fields"])
        except OSError as e:
            self.give_up(f"no shared memory segment: {e} (is /dev/shm full?)")
            return None
        try:
            reply = client.request("put", {**body, "fields": fields}, wait_s=wait_s)
        except QueueError as e:
            if e.code == BAD_BODY and e.message.startswith(("shm:", "unknown ext")):
                self.give_up(f"the server could not adopt the segment: {e}")
                return None
            raise
        finally:
            segment.unlink()
        self.puts += 1
        return reply

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
