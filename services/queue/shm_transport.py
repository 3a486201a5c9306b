"""Same-host puts through shared memory: the client writes a put's tensors into one /dev/shm segment.

Over loopback TCP a put's bytes are copied twice by the kernel (into the socket and out of it)
and capped at the loopback rate; through shared memory the client copies them once into a
segment and sends a small message of references (ext 3/4, xtoken_core/wire/shm.py). The server
adopts the segment (maps it, unlinks its name) and stores views of it; replies still go out as
frames.

Modes (``QueueClient(..., shm=...)``):
  * ``"auto"`` (default): for a loopback TCP address (``tcp://127.x``, ``tcp://localhost``,
    ``tcp://[::1]``), puts of at least ``shm_min_bytes`` go through shared memory once the
    server's hello says ``shm: true``. Not for ``ipc://``: a unix socket moved W1 puts faster
    than a fresh segment (whose page allocation dominates) in benchmarks/queue/bench_shm_put.py. Anything that stops it (a server
    without it, a /dev/shm that is full or private to another container) falls back to frames
    for the rest of the client's life, with one warning.
  * ``"never"``: always frames.
  * ``"always"``: every put through shared memory, whatever its size or address (``ipc://``
    included); failures raise.

Ownership: the client unlinks the segment after the server answered (a no-op when the server
adopted it), so a server that never got the message leaves nothing behind; a client killed
after sending leaves the segment to the server, which adopts it when it reads the message. A
client killed between writing a segment and handing the message to the kernel leaves a file:
every new shm-enabled client removes such files of dead processes (``sweep_orphans``).
"""

from __future__ import annotations

import logging
from typing import Any

from services.queue import errors as codes
from services.queue.errors import QueueError
from xtoken_core.ipc.shm import sweep_orphans
from xtoken_core.wire import BAD_BODY
from xtoken_core.wire.shm import fields_nbytes, fields_to_shm

logger = logging.getLogger(__name__)

SHM_MODES = ("auto", "never", "always")
DEFAULT_SHM_MIN_BYTES = 1 << 20
# A segment of a dead process this old is an orphan: its put never left the process.
ORPHAN_AGE_S = 60.0
_LOOPBACK_TCP = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")
_LOCAL_PREFIXES = ("ipc://", "inproc://", *_LOOPBACK_TCP)


def is_same_host(address: str) -> bool:
    """True for addresses that can only reach a server on this host."""
    return address.startswith(_LOCAL_PREFIXES)


class ShmPuts:
    """Decides which puts go through shared memory and sends them (one per client).

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
        self.min_bytes = min_bytes if mode == "auto" else 0
        self.enabled = mode == "always" or (mode == "auto" and address.startswith(_LOOPBACK_TCP))
        self.server_ok: bool | None = None
        self.puts = 0
        if self.enabled:
            # segments of producers killed before their put left the process (see module doc)
            sweep_orphans(min_age_s=ORPHAN_AGE_S)

    def wants(self, fields: Any) -> bool:
        """Whether a put of these fields should go through shared memory."""
        return self.enabled and (self.min_bytes == 0 or fields_nbytes(fields) >= self.min_bytes)

    def _give_up(self, why: str) -> None:
        if self.mode == "always":
            raise QueueError(
                codes.BAD_REQUEST, f"shm='always' but {why}; use shm='auto' to fall back to frames"
            )
        logger.warning("[queue-client] shared-memory puts off (%s): sending frames", why)
        self.enabled = False

    def put(self, client: Any, body: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
        """Send a put through shared memory.

        Args:
            client: the ``QueueClient`` (its ``hello`` and ``request`` are used).
            body: the put body with tensor fields.
            wait_s: server-side wait of the put.

        Returns:
            The reply, or None when the put must be sent as frames instead (auto mode).

        Raises:
            QueueError: the server's error reply; in ``always`` mode also when shared memory
                cannot be used.
        """
        if self.server_ok is None:
            self.server_ok = bool(client.hello().get("shm"))
        if not self.server_ok:
            self._give_up("the server does not adopt shared-memory tensors")
            return None
        try:
            segment, fields = fields_to_shm(body["fields"])
        except OSError as e:
            self._give_up(f"no shared memory segment: {e} (is /dev/shm full?)")
            return None
        try:
            reply = client.request("put", {**body, "fields": fields}, wait_s=wait_s)
        except QueueError as e:
            if e.code == BAD_BODY and e.message.startswith(("shm:", "unknown ext")):
                self._give_up(f"the server could not adopt the segment: {e}")
                return None
            raise
        finally:
            segment.unlink()
        self.puts += 1
        return reply
