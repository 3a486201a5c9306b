"""The queue server's log lines for operators: connects, error replies, a periodic stats line."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from services.queue.config import format_size

logger = logging.getLogger("services.queue.server")


class OpLog:
    """What an operator reads in the server log (no sockets; the server calls it).

    Each error code is logged with its message once per interval and counted; the stats line
    (every ``every_s``; 0 = off) says how many of each there were.

    Args:
        every_s: seconds between stats lines (``--log-every-s``); 0 turns them off.
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._next = time.monotonic() + every_s
        self._connects = 0
        self._errors: collections.Counter[str] = collections.Counter()

    def connect(self, client: str) -> None:
        """A client said hello (a new connection, or one again after a server restart)."""
        self._connects += 1
        logger.info("[queue] client %s connected", client or "(unnamed)")

    def error(self, code: str, message: str, request_type: str | None) -> None:
        """An error reply; the first of each code per interval is logged with its message."""
        if code not in self._errors:
            logger.warning(
                "[queue] error reply to a %s: %s: %s", request_type or "request", code, message
            )
        self._errors[code] += 1

    def due(self, now: float) -> bool:
        """Whether a stats line is due at ``now`` (monotonic seconds)."""
        return self.every_s > 0 and now >= self._next

    def stats(self, stats: dict[str, Any], now: float) -> None:
        """Log the stats line (from the server's ``stats`` reply) and start a new interval."""
        self._next = now + self.every_s
        used, cap = stats.get("bytes_used", 0), stats.get("capacity_bytes", 0)
        rates, parts = stats.get("rates", {}), stats.get("partitions", {})
        errors = sum(self._errors.values())
        by_code = ", ".join(f"{c} {n}" for c, n in sorted(self._errors.items()))
        logger.info(
            "[queue] stats: %d samples in %d partition%s, %s of %s (%.0f%%), put %.1f samples/s "
            "%s/s, claim %.1f samples/s %s/s, %d leases, %d parked puts, %d parked claims; "
            "last %gs: %d connect%s, %d error%s%s",
            stats.get("samples", 0),
            len(parts),
            "" if len(parts) == 1 else "s",
            format_size(used),
            format_size(cap),
            100.0 * used / max(cap, 1),
            rates.get("put_samples_per_s", 0.0),
            format_size(rates.get("put_bytes_per_s", 0.0)),
            rates.get("claim_samples_per_s", 0.0),
            format_size(rates.get("claim_bytes_per_s", 0.0)),
            stats.get("leases", 0),
            stats.get("parked_puts", 0),
            stats.get("parked_claims", 0),
            self.every_s,
            self._connects,
            "" if self._connects == 1 else "s",
            errors,
            "" if errors == 1 else "s",
            f" ({by_code})" if errors else "",
        )
        self._connects = 0
        self._errors.clear()
