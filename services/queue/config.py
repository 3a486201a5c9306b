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
        ValueError: not a size, not finite, or not positive.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not understood; write e.g. 512MiB, 8GiB, 2GB or 1e9")
    try:
        size = int(float(m.group(1)) * _UNITS[unit])
    except OverflowError:  # 1e999: an infinite float
        raise ValueError(f"size {text!r} is not finite; write e.g. 512MiB or 8GiB") from None
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
    """Settings of one queue server process: ``xtoken queue serve`` has a flag per field (its
    help says what the field does), and a run config's ``queue`` section is this class. A server
    holds samples in memory (or, with ``data_dir``, in a durable log) up to ``capacity_bytes``,
    passes same-host puts through a shared-memory pool, leases what a claim takes, and refuses
    waits, leases and messages past its bounds with ``bad_request`` naming the bound.

    Raises:
        ValueError: a setting out of range or two that contradict each other (names the flag).
    """

    bind: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={
            "help": "ZMQ endpoint: tcp://HOST:PORT (PORT * = any free) or ipc://PATH",
            "context": "queue",
            "trained": False,
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
            "trained": False,
        },
    )
    put_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds a put waits for capacity when it gives no timeout_ms",
            "trained": False,
        },
    )
    claim_timeout_s: float = field(
        default=1.0,
        metadata={
            "help": "seconds a claim waits for data when it gives no timeout_ms",
            "trained": False,
        },
    )
    lease_s: float = field(
        default=60.0,
        metadata={
            "help": "lease seconds when a claim gives no lease_ms",
            "trained": False,
        },
    )
    busy_poll_us: int = field(
        default=300,
        metadata={
            "help": "after requests, poll without sleeping (yielding the core) this many "
            "microseconds before blocking: shorter round trips on a host slow to wake a process; "
            "0 = off",
            "trained": False,
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
            "trained": False,
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
            "trained": False,
        },
    )
    shm_reserve_s: float = field(
        default=60.0,
        metadata={
            "flag": "shm-reserve-timeout-s",
            "help": "seconds a shared-memory reservation stays valid without its put",
            "trained": False,
        },
    )
    max_claim_wait_s: float = field(
        default=300.0,
        metadata={
            "help": "largest wait (seconds) a claim may ask for; a longer timeout_ms is refused",
            "trained": False,
        },
    )
    max_put_wait_s: float = field(
        default=3600.0,
        metadata={
            "help": "largest wait (seconds) a put or reserve may ask for",
            "trained": False,
        },
    )
    max_lease_s: float = field(
        default=3600.0,
        metadata={
            "help": "longest lease (seconds) a claim may ask for; a longer lease_ms is refused: "
            "bounds how long a gone client's claim holds its samples",
            "trained": False,
        },
    )
    heartbeat_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds between pings of each client connection; one silent for 3 pings is "
            "closed and its parked requests dropped (0 = off)",
            "trained": False,
        },
    )
    tombstone_max_keys: int = field(
        default=DEFAULT_MAX_KEYS,
        metadata={
            "flag": "tombstones",
            "help": "most keys per partition remembered as consumed once retention dropped their "
            "samples (8 bytes each; past it the oldest quarter is forgotten)",
            "trained": False,
        },
    )
    data_dir: str | None = field(
        default=None,
        metadata={
            "path": "dir",
            "default_text": "memory only",
            "help": "durable mode: log samples not yet consumed, consumed sets, registrations "
            "and tombstones to this directory and recover them on the next start (leases do not "
            "survive; the shared-memory pool is off)",
            "trained": False,
        },
    )
    fsync: Literal["always", "interval", "never"] = field(
        default="interval",
        metadata={
            "help": "with --data-dir: always = answer puts, acks and clears once fsynced; "
            "interval = fsync every --fsync-interval-s, answer acks and clears once written "
            "(survive a SIGKILL) and puts at once while the log lags by less than --log-lag; "
            "never = no fsync",
            "trained": False,
        },
    )
    fsync_interval_s: float = field(
        default=1.0,
        metadata={
            "help": "seconds between fsyncs of the log with --fsync interval",
            "trained": False,
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
            "trained": False,
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
            "trained": False,
        },
    )
    salvage: bool = field(
        default=False,
        metadata={
            "help": "with --data-dir: keep the valid records after a corrupt one in the middle "
            "of the log and drop only its bad bytes (without it such a log stops the start, exit "
            "code 3)",
            "trained": False,
        },
    )
    max_message_bytes: int | None = field(
        default=None,
        metadata={
            "parse": parse_size,
            "metavar": "SIZE",
            "default_text": "the wire default, 2GiB",
            "help": "largest accepted message",
            "trained": False,
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
            "trained": False,
        },
    )
    pool_idle_s: float = field(
        default=30.0,
        metadata={
            "help": "unlink free shared-memory pool segments unused this long: an idle server "
            "gives its pool's memory back",
            "trained": False,
        },
    )
    shm_verify: bool = field(
        default=True,
        metadata={
            "help": "hash what each shared-memory put stores and check it before every read: "
            "bytes another process wrote into a pool file after the put are refused, never "
            "served (costs a hash pass, ~4 GB/s, over put and read bytes)",
            "trained": False,
        },
    )
    insecure: bool = field(
        default=False,
        metadata={
            "help": "serve a --bind reachable from other hosts without a token (refused otherwise)",
            "trained": False,
        },
    )
    log_every_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds between [queue] stats log lines (samples, bytes, rates, parked "
            "requests, connects and errors since the last; 0 = off). Connects and the first "
            "error of each kind per interval are logged as they happen",
            "trained": False,
        },
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata={
            "help": "most client connections kept open (each QueueClient holds one); one more is "
            "refused in its handshake, before it sends anything",
            "trained": False,
        },
    )
    # the shared secret every client presents in its hello (None: anyone who can connect may
    # talk to the server); never a flag, as ps would show it, and no key of a run config
    auth_token: str | None = field(
        default=None,
        repr=False,
        metadata={
            "cli": False,
            "derived": "the token of auth_token_file, else XTOKEN_QUEUE_TOKEN",
            "trained": False,
        },
    )
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
