"""Settings of a queue server process (``xtoken queue serve`` generates its flags from them).

No heavy imports: the CLI builds its parser from :class:`ServerConfig`, so each default is
written once, here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.endpoint import check_endpoint
from services.queue.auth import TOKEN_ENV, check_token, is_loopback

__all__ = ["DEFAULT_MAX_KEYS", "ServerConfig", "format_size", "parse_size"]

DEFAULT_MAX_KEYS = 1 << 24  # tombstones per partition: 16 Mi keys = 128 MiB of hashes at most
# Most client connections a server keeps open by default (each QueueClient holds one).
DEFAULT_MAX_CONNECTIONS = 1024

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parse a byte size: ``512MiB``, ``8GiB``, ``1e9``, ``2GB``, ``1048576``.

    Args:
        text: a number (int or float notation) with an optional unit (B, KB/MB/GB/TB powers of
            1000, KiB/MiB/GiB/TiB powers of 1024; case-insensitive).

    Returns:
        The size in bytes.

    Raises:
        ValueError: not a size, or not positive.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not understood; write e.g. 512MiB, 8GiB, 2GB or 1e9")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {text!r} must be > 0")
    return size


def parse_size_or_zero(text: str) -> int:
    """:func:`parse_size`, or 0 for ``"0"`` (a pool kept empty)."""
    return 0 if str(text).strip() == "0" else parse_size(text)


def format_size(nbytes: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``1.2 GiB`` (powers of 1024).

    Args:
        nbytes: bytes (may be a float rate).

    Returns:
        The size with one decimal and a binary unit (whole bytes below 1 KiB).
    """
    size = float(nbytes)
    if abs(size) < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


@dataclass
class ServerConfig:
    """Settings of one queue server process (``xtoken queue serve``: a flag per field).

    Args:
        bind: ZMQ endpoint, ``tcp://host:port`` (port ``*`` = any free port) or ``ipc://path``.
        capacity_bytes: store capacity (``--capacity``).
        put_timeout_s: how long a put waits for capacity when it gives no ``timeout_ms``.
        claim_timeout_s: how long a claim waits for data when it gives no ``timeout_ms``.
        lease_s: lease length when a claim gives no ``lease_ms``.
        max_message_bytes: largest accepted message (``--max-message-bytes``); None: the wire
            default. :attr:`limits` holds the wire limits enforced on every message.
        busy_poll_us: after handling requests, poll the socket without sleeping for this long
            before blocking (``--busy-poll-us``). A sleeping process is woken in ~0.1 ms on a
            loaded or virtualized host, a spinning one at once: this trades up to this much CPU
            per burst of requests for round trips 2-3x shorter. 0 always blocks. Paused for a
            second whenever another task holds the server's core (``BusyPoll``).
        shm_pool_free_bytes: most bytes of free shared-memory segments kept for reuse
            (``--shm-pool-free``); they count against the capacity and are dropped first when
            room is needed.
        shm_reserve_s: seconds a shared-memory reservation stays valid without a put
            (``--shm-reserve-timeout-s``).
        shm_reserve_max_bytes: most bytes held reserved and not yet stored per authenticated
            identity; the queue's one credential is its token (or none), so this bounds all
            clients together, however many instance ids or connections they use. None = a
            quarter of ``capacity_bytes``. A larger reserve is refused at once (``bad_request``;
            the client sends frames), one that would pass it with the reservations already held
            gets ``shm_busy`` at once (the client sends that put as frames) instead of waiting.
        tombstone_max_keys: most keys per partition remembered as consumed after retention
            dropped their samples (``--tombstones``; 8 bytes each).
        max_claim_wait_s: largest ``timeout_ms`` a claim may ask for (``--max-claim-wait-s``);
            a larger one is refused (``bad_request`` naming the bound).
        max_put_wait_s: largest ``timeout_ms`` a put or reserve may ask for
            (``--max-put-wait-s``).
        max_lease_s: largest ``lease_ms`` a claim may ask for (``--max-lease-s``); a longer one is
            refused (``bad_request`` naming the bound): a lease outlives its client by at most
            this much.
        heartbeat_s: the server pings every client connection this often (ZMTP heartbeats,
            answered by the client's zmq I/O thread) and closes one that sent nothing for 3
            periods (``--heartbeat-s``; 0 = off): a hung or unreachable client's parked requests
            are then dropped like those of a client whose process died.
        data_dir: durable mode (``--data-dir``): samples not yet consumed, consumed sets,
            registrations and tombstones are logged there (durable.py, written by a writer
            process that holds the directory's lock with the server) and recovered on the next
            start; None keeps everything in memory. Leases never survive a restart.
        fsync: ``always`` (every put, ack and clear is answered once fsynced), ``interval``
            (fsync every ``fsync_interval_s``; acks and clears are answered once written, puts
            at once while the log lags by less than ``log_lag_bytes``) or ``never``
            (``--fsync``).
        fsync_interval_s: with ``interval``, seconds between fsyncs (``--fsync-interval-s``).
        log_lag_bytes: most bytes of answered puts not yet written to the log
            (``--log-lag``): past it, puts are answered once written.
        salvage: durable mode: a corrupt record in the middle of the log is dropped and the
            valid records after it are kept (``--salvage``); without it such a log stops the
            start (``CorruptLogError``, exit code 3, naming the file and offset).
        compact_min_bytes: the log is compacted to a snapshot once it is larger than this and
            twice the bytes stored (``--compact-min``).
        auth_token_file: a file holding the token (``--auth-token-file``); the shell reads it
            (else ``XTOKEN_QUEUE_TOKEN``, auth.py) into ``auth_token``.
        auth_token: the shared secret every client presents in its hello; None serves anyone
            who can connect. Never a flag: ``ps`` would show it.
        insecure: allow a bind reachable from other hosts without a token (``--insecure``).
        max_connections: most client connections the server keeps open
            (``--max-connections``; each ``QueueClient`` holds one). One more is refused in its
            ZMTP handshake, before it can send a message: the client raises a retryable
            ``too_many_connections`` naming this setting.
        pool_idle_s: a free shared-memory segment unused this long is unlinked
            (``--pool-idle-s``): an idle server gives its pool's memory back.
        shm_verify: hash the bytes of every put stored in the shared-memory pool and check
            them before any read serves or copies them (``--shm-verify``, on by default): any
            process of the server's user (root in a container) can open a pool file and write
            into it, and such a change is then refused (``corrupt``, the samples dropped)
            instead of being served. Costs one hash pass (~4 GB/s, xxh3) over a put's bytes
            and over the rows each read returns; ``--no-shm-verify`` where nothing else can
            reach the queue's /dev/shm.
        log_every_s: seconds between ``[queue] stats:`` log lines (``--log-every-s``; 0 = off).

    Raises:
        ValueError: a non-positive capacity or a negative timeout.
    """

    bind: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={
            "help": "ZMQ endpoint: tcp://HOST:PORT (PORT * = any free) or ipc://PATH",
            "context": "queue",
        },
    )
    capacity_bytes: int = field(
        default=8 * 1024**3,
        metadata={
            "flag": "capacity",
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "8GiB",
            "help": "bytes of samples the queue holds before puts wait",
        },
    )
    put_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds a put waits for capacity when it gives no timeout_ms",
            "deprecated_flags": ("put-timeout",),
        },
    )
    claim_timeout_s: float = field(
        default=1.0,
        metadata={
            "help": "seconds a claim waits for data when it gives no timeout_ms",
            "deprecated_flags": ("claim-timeout",),
        },
    )
    lease_s: float = field(
        default=60.0,
        metadata={
            "help": "lease seconds when a claim gives no lease_ms",
            "deprecated_flags": ("lease",),
        },
    )
    busy_poll_us: int = field(
        default=300,
        metadata={
            "help": "after requests, poll without sleeping (yielding the core) this many "
            "microseconds before blocking: shorter round trips on a host slow to wake a process; "
            "0 = off"
        },
    )
    shm_pool_free_bytes: int = field(
        default=1 << 30,
        metadata={
            "flag": "shm-pool-free",
            "parse": parse_size_or_zero,
            "metavar": "SIZE",
            "default_text": "1GiB",
            "help": "most bytes of free shared-memory segments kept for reuse by same-host puts; "
            "they count against --capacity and are dropped first when room is needed",
        },
    )
    shm_reserve_max_bytes: int | None = field(
        default=None,
        metadata={
            "flag": "shm-reserve-max",
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "a quarter of --capacity",
            "help": "most bytes all clients together may hold reserved (not yet put) in the "
            "shared-memory pool; a put past it travels as frames",
        },
    )
    shm_reserve_s: float = field(
        default=60.0,
        metadata={
            "flag": "shm-reserve-timeout-s",
            "help": "seconds a shared-memory reservation stays valid without its put",
            "deprecated_flags": ("shm-reserve-timeout",),
        },
    )
    max_claim_wait_s: float = field(
        default=300.0,
        metadata={
            "help": "largest wait (seconds) a claim may ask for; a longer timeout_ms is refused",
            "deprecated_flags": ("max-claim-wait",),
        },
    )
    max_put_wait_s: float = field(
        default=3600.0,
        metadata={
            "help": "largest wait (seconds) a put or reserve may ask for",
            "deprecated_flags": ("max-put-wait",),
        },
    )
    max_lease_s: float = field(
        default=3600.0,
        metadata={
            "help": "longest lease (seconds) a claim may ask for; a longer lease_ms is refused: "
            "bounds how long a gone client's claim holds its samples",
            "deprecated_flags": ("max-lease",),
        },
    )
    heartbeat_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds between pings of each client connection; one silent for 3 pings is "
            "closed and its parked requests dropped (0 = off)",
            "deprecated_flags": ("heartbeat",),
        },
    )
    tombstone_max_keys: int = field(
        default=DEFAULT_MAX_KEYS,
        metadata={
            "flag": "tombstones",
            "help": "most keys per partition remembered as consumed once retention dropped their "
            "samples (8 bytes each; past it the oldest quarter is forgotten)",
        },
    )
    data_dir: str | None = field(
        default=None,
        metadata={
            "path": "file",
            "default_text": "memory only",
            "help": "durable mode: log samples not yet consumed, consumed sets, registrations "
            "and tombstones to this directory and recover them on the next start (leases do not "
            "survive; the shared-memory pool is off)",
        },
    )
    fsync: Literal["always", "interval", "never"] = field(
        default="interval",
        metadata={
            "help": "with --data-dir: always = answer puts, acks and clears once fsynced; "
            "interval = fsync every --fsync-interval-s, answer acks and clears once written "
            "(survive a SIGKILL) and puts at once while the log lags by less than --log-lag; "
            "never = no fsync"
        },
    )
    fsync_interval_s: float = field(
        default=1.0,
        metadata={
            "help": "seconds between fsyncs of the log with --fsync interval",
            "deprecated_flags": ("fsync-interval",),
        },
    )
    log_lag_bytes: int = field(
        default=256 * 1024**2,
        metadata={
            "flag": "log-lag",
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "256MiB",
            "help": "most bytes of answered puts not yet written to the log; past it puts are "
            "answered once written",
        },
    )
    compact_min_bytes: int = field(
        default=64 * 1024**2,
        metadata={
            "flag": "compact-min",
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "64MiB",
            "help": "compact the log to a snapshot once it is larger than this and twice the "
            "bytes stored (bounds the recovery time)",
        },
    )
    salvage: bool = field(
        default=False,
        metadata={
            "help": "with --data-dir: keep the valid records after a corrupt one in the middle "
            "of the log and drop only its bad bytes (without it such a log stops the start, exit "
            "code 3)"
        },
    )
    max_message_bytes: int | None = field(
        default=None,
        metadata={
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "the wire default, 2GiB",
            "help": "largest accepted message",
        },
    )
    auth_token_file: str | None = field(
        default=None,
        metadata={
            "path": "file",
            "metavar": "FILE",
            "default_text": "the XTOKEN_QUEUE_TOKEN environment variable, else the file "
            "XTOKEN_QUEUE_TOKEN_FILE names, else no authentication",
            "help": "require clients to present the token in FILE in their hello; clients read "
            "the same variables",
        },
    )
    pool_idle_s: float = field(
        default=30.0,
        metadata={
            "help": "unlink free shared-memory pool segments unused this long: an idle server "
            "gives its pool's memory back"
        },
    )
    shm_verify: bool = field(
        default=True,
        metadata={
            "help": "hash what each shared-memory put stores and check it before every read: "
            "bytes another process wrote into a pool file after the put are refused, never "
            "served (costs a hash pass, ~4 GB/s, over put and read bytes)"
        },
    )
    insecure: bool = field(
        default=False,
        metadata={
            "help": "serve a --bind reachable from other hosts without a token (refused otherwise)"
        },
    )
    log_every_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds between [queue] stats log lines (samples, bytes, rates, parked "
            "requests, connects and errors since the last; 0 = off). Connects and the first "
            "error of each kind per interval are logged as they happen",
            "deprecated_flags": ("log-every",),
        },
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata={
            "help": "most client connections kept open (each QueueClient holds one); one more is "
            "refused in its handshake, before it sends anything"
        },
    )
    auth_token: str | None = field(default=None, repr=False, metadata={"cli": False})
    # the wire limits of every message, from max_message_bytes
    limits: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_endpoint(self.bind, "--bind")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token is empty: give a token or None (--auth-token-file)")
        if self.auth_token is not None:
            check_token(self.auth_token, "auth_token (--auth-token-file)")
        if self.max_connections < 1:
            raise ValueError(
                f"max_connections={self.max_connections}: must be >= 1 (--max-connections; each "
                "QueueClient holds one connection)"
            )
        if self.auth_token is None and not self.insecure and not is_loopback(self.bind):
            raise ValueError(
                f"bind={self.bind!r} is reachable from other hosts, and this queue has no token "
                f"(anyone could read, ack or clear its data): give it one with "
                f"--auth-token-file FILE or {TOKEN_ENV} (clients read the same variable or "
                "XTOKEN_QUEUE_TOKEN_FILE), bind tcp://127.0.0.1:PORT, or pass --insecure to "
                "serve unauthenticated anyway"
            )
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={self.capacity_bytes}: must be > 0 (--capacity)")
        for name in ("put_timeout_s", "claim_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s={self.lease_s}: must be > 0 (--lease-s)")
        if self.lease_s > self.max_lease_s:
            raise ValueError(
                f"lease_s={self.lease_s} is above max_lease_s={self.max_lease_s} "
                "(--lease-s, --max-lease-s): lower --lease-s or raise --max-lease-s"
            )
        if not 0 <= self.busy_poll_us <= 1_000_000:
            raise ValueError(
                f"busy_poll_us={self.busy_poll_us}: must be in [0, 1e6] (--busy-poll-us; 0 = off)"
            )
        if self.shm_pool_free_bytes < 0:
            raise ValueError(
                f"shm_pool_free_bytes={self.shm_pool_free_bytes}: must be >= 0 (--shm-pool-free)"
            )
        if self.shm_reserve_max_bytes is None:
            self.shm_reserve_max_bytes = max(1, self.capacity_bytes // 4)
        if self.shm_reserve_max_bytes <= 0:
            raise ValueError(
                f"shm_reserve_max_bytes={self.shm_reserve_max_bytes}: must be > 0 "
                "(None = a quarter of the capacity)"
            )
        for name, flag in (("max_claim_wait_s", "claim"), ("max_put_wait_s", "put")):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (--max-{flag}-wait)")
        if self.claim_timeout_s > self.max_claim_wait_s:
            raise ValueError(
                f"claim_timeout_s={self.claim_timeout_s} is above max_claim_wait_s="
                f"{self.max_claim_wait_s} (--claim-timeout-s, --max-claim-wait-s)"
            )
        if self.put_timeout_s > self.max_put_wait_s:
            raise ValueError(
                f"put_timeout_s={self.put_timeout_s} is above max_put_wait_s="
                f"{self.max_put_wait_s} (--put-timeout-s, --max-put-wait-s)"
            )
        if self.heartbeat_s < 0:
            raise ValueError(
                f"heartbeat_s={self.heartbeat_s}: must be >= 0 (--heartbeat-s, 0 = off)"
            )
        if self.tombstone_max_keys < 1:
            raise ValueError(
                f"tombstone_max_keys={self.tombstone_max_keys}: must be >= 1 (--tombstones)"
            )
        if self.fsync not in ("always", "interval", "never"):
            raise ValueError(f"fsync={self.fsync!r}: use always, interval or never (--fsync)")
        if not self.fsync_interval_s > 0:
            raise ValueError(
                f"fsync_interval_s={self.fsync_interval_s}: must be > 0 (--fsync-interval-s)"
            )
        if self.log_lag_bytes < 0 or self.compact_min_bytes <= 0:
            raise ValueError(
                f"log_lag_bytes={self.log_lag_bytes} must be >= 0 (--log-lag) and "
                f"compact_min_bytes={self.compact_min_bytes} > 0 (--compact-min)"
            )
        if not self.pool_idle_s > 0:
            raise ValueError(f"pool_idle_s={self.pool_idle_s}: must be > 0 (--pool-idle-s)")
        if not self.shm_reserve_s > 0:
            raise ValueError(
                f"shm_reserve_s={self.shm_reserve_s}: must be > 0 (--shm-reserve-timeout-s)"
            )
        from xtoken_core.wire.errors import DEFAULT_LIMITS, WireLimits

        self.limits = DEFAULT_LIMITS
        if self.max_message_bytes:
            self.limits = WireLimits(
                max_message_bytes=self.max_message_bytes,
                max_body_bytes=min(DEFAULT_LIMITS.max_body_bytes, self.max_message_bytes),
            )
