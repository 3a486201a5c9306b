"""`xtoken queue`: run a transfer-queue server (`serve`) or print its stats (`stats`)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import re
import sys

logger = logging.getLogger(__name__)

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


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_or_zero_arg(text: str) -> int:
    return 0 if str(text).strip() == "0" else _size_arg(text)


def _endpoint_arg(flag: str):
    """An argparse type that accepts a ZMQ endpoint and names ``flag`` otherwise."""
    from services.common.endpoint import check_endpoint

    def parse(text: str) -> str:
        try:
            return check_endpoint(text, flag)
        except ValueError as e:
            # argparse already says "argument --bind: "
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` and `stats` sub-subcommands."""
    sub = parser.add_subparsers(dest="queue_command", metavar="{serve,stats}", required=True)
    serve = sub.add_parser(
        "serve",
        help="run a queue server until SIGTERM/SIGINT (exit 0 after the drain, 2 on bad settings)",
    )
    serve.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        type=_endpoint_arg("--bind"),
        help="ZMQ endpoint: tcp://HOST:PORT (PORT * = any free) or ipc://PATH",
    )
    serve.add_argument(
        "--capacity",
        type=_size_arg,
        default=parse_size("8GiB"),
        help="bytes of samples the queue holds before puts wait (default 8GiB)",
    )
    serve.add_argument(
        "--put-timeout",
        type=float,
        default=30.0,
        help="seconds a put waits for capacity when it gives no timeout_ms",
    )
    serve.add_argument(
        "--claim-timeout",
        type=float,
        default=1.0,
        help="seconds a claim waits for data when it gives no timeout_ms",
    )
    serve.add_argument(
        "--lease", type=float, default=60.0, help="lease seconds when a claim gives no lease_ms"
    )
    serve.add_argument(
        "--busy-poll-us",
        type=int,
        default=300,
        help="after requests, poll without sleeping (yielding the core) this many microseconds "
        "before blocking: shorter round trips on a host slow to wake a process; 0 = off "
        "(default 300)",
    )
    serve.add_argument(
        "--shm-pool-free",
        type=_size_or_zero_arg,
        default=parse_size("1GiB"),
        help="most bytes of free shared-memory segments kept for reuse by same-host puts; "
        "they count against --capacity and are dropped first when room is needed (default 1GiB)",
    )
    serve.add_argument(
        "--shm-reserve-max",
        type=_size_arg,
        default=None,
        help="most bytes one client may hold reserved in the shared-memory pool at once "
        "(default a quarter of --capacity)",
    )
    serve.add_argument(
        "--shm-reserve-timeout",
        type=float,
        default=60.0,
        help="seconds a shared-memory reservation stays valid without its put (default 60)",
    )
    serve.add_argument(
        "--max-claim-wait",
        type=float,
        default=300.0,
        help="largest wait (seconds) a claim may ask for; a longer timeout_ms is refused "
        "(default 300)",
    )
    serve.add_argument(
        "--max-put-wait",
        type=float,
        default=3600.0,
        help="largest wait (seconds) a put or reserve may ask for (default 3600)",
    )
    serve.add_argument(
        "--heartbeat",
        type=float,
        default=10.0,
        help="seconds between pings of each client connection; one silent for 3 pings is "
        "closed and its parked requests dropped (0 = off; default 10)",
    )
    serve.add_argument(
        "--tombstones",
        type=int,
        default=1 << 24,
        help="most keys per partition remembered as consumed once retention dropped their "
        "samples (8 bytes each; past it the oldest quarter is forgotten; default 16777216)",
    )
    serve.add_argument(
        "--data-dir",
        default=None,
        help="durable mode: log samples not yet consumed, consumed sets, registrations and "
        "tombstones to this directory and recover them on the next start (leases do not "
        "survive; the shared-memory pool is off). Default: memory only",
    )
    serve.add_argument(
        "--fsync",
        choices=("always", "interval", "never"),
        default="interval",
        help="with --data-dir: always = answer puts, acks and clears once fsynced; interval = "
        "fsync every --fsync-interval, answer acks and clears once written (survive a SIGKILL) "
        "and puts at once while the log lags by less than --log-lag; never = no fsync "
        "(default interval)",
    )
    serve.add_argument(
        "--fsync-interval",
        type=float,
        default=1.0,
        help="seconds between fsyncs of the log with --fsync interval (default 1)",
    )
    serve.add_argument(
        "--log-lag",
        type=_size_arg,
        default=256 * 1024**2,
        help="most bytes of answered puts not yet written to the log; past it puts are "
        "answered once written (default 256MiB)",
    )
    serve.add_argument(
        "--compact-min",
        type=_size_arg,
        default=64 * 1024**2,
        help="compact the log to a snapshot once it is larger than this and twice the bytes "
        "stored (default 64MiB; bounds the recovery time)",
    )
    serve.add_argument(
        "--max-message-bytes",
        type=_size_arg,
        default=None,
        help="largest accepted message (default: the wire default, 2GiB)",
    )
    serve.add_argument(
        "--ready-file",
        default=None,
        help='once listening, write {"pid", "name": "queue", "endpoint"} JSON to this file',
    )
    stats = sub.add_parser("stats", help="print a queue server's stats")
    stats.add_argument(
        "--queue",
        required=True,
        type=_endpoint_arg("--queue"),
        help="server endpoint, e.g. tcp://host:5555",
    )
    stats.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")


def run(args: argparse.Namespace) -> int:
    """Run the chosen queue command; returns the exit status."""
    if args.queue_command == "serve":
        return _serve(args)
    return _stats(args)


def _serve(args: argparse.Namespace) -> int:
    from services.common.lifecycle import Lifecycle, run_process

    def main(lifecycle: Lifecycle) -> int:
        from services.queue.server import ServerConfig, serve
        from xtoken_core.wire import DEFAULT_LIMITS, WireLimits

        limits = DEFAULT_LIMITS
        if args.max_message_bytes:
            limits = WireLimits(
                max_message_bytes=args.max_message_bytes,
                max_body_bytes=min(DEFAULT_LIMITS.max_body_bytes, args.max_message_bytes),
            )
        config = ServerConfig(
            bind=args.bind,
            capacity_bytes=args.capacity,
            put_timeout_s=args.put_timeout,
            claim_timeout_s=args.claim_timeout,
            lease_s=args.lease,
            busy_poll_us=args.busy_poll_us,
            shm_pool_free_bytes=args.shm_pool_free,
            shm_reserve_s=args.shm_reserve_timeout,
            shm_reserve_max_bytes=args.shm_reserve_max,
            tombstone_max_keys=args.tombstones,
            max_claim_wait_s=args.max_claim_wait,
            max_put_wait_s=args.max_put_wait,
            heartbeat_s=args.heartbeat,
            data_dir=args.data_dir,
            fsync=args.fsync,
            fsync_interval_s=args.fsync_interval,
            log_lag_bytes=args.log_lag,
            compact_min_bytes=args.compact_min,
            limits=limits,
        )
        import zmq

        try:
            return serve(config, lifecycle)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
                raise
            why = (
                "the address is already in use (another server listens there)"
                if e.errno == errno.EADDRINUSE
                else e.strerror
            )
            logger.error(
                "[queue] error: cannot listen on %s: %s; pass another --bind, e.g. "
                "tcp://127.0.0.1:* for any free port",
                args.bind,
                why,
            )
            return 1

    return run_process(
        "queue", main, ready_file=args.ready_file, log_level=getattr(args, "log_level", "INFO")
    )


def _stats(args: argparse.Namespace) -> int:
    from services.queue.client import QueueClient
    from services.queue.errors import QueueError

    try:
        with QueueClient(args.queue, timeout_s=args.timeout, retries=0) as client:
            stats = client.stats()
    except QueueError as e:
        if e.code == "timeout":
            print(
                f"xtoken queue stats: no reply from {args.queue} within {args.timeout:g}s; is the "
                "server up? check --queue or raise --timeout",
                file=sys.stderr,
            )
        else:
            print(f"xtoken queue stats: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(format_stats(stats))
    return 0


def format_stats(stats: dict) -> str:
    """Render a stats reply as a plain-text table.

    Args:
        stats: the ``stats`` reply body.

    Returns:
        The table, one row per (partition, task).
    """
    used, cap = stats.get("bytes_used", 0), stats.get("capacity_bytes", 0)
    rates = stats.get("rates", {})
    lines = [
        f"bytes {used} / {cap} ({100.0 * used / max(cap, 1):.1f}%)  samples {stats.get('samples', 0)}"
        f"  leases {stats.get('leases', 0)}  parked claims {stats.get('parked_claims', 0)}"
        f"  parked puts {stats.get('parked_puts', 0)}",
        f"put {rates.get('put_samples_per_s', 0.0):.1f} samples/s "
        f"{rates.get('put_bytes_per_s', 0.0) / 1e6:.2f} MB/s   claim "
        f"{rates.get('claim_samples_per_s', 0.0):.1f} samples/s "
        f"{rates.get('claim_bytes_per_s', 0.0) / 1e6:.2f} MB/s "
        f"(last {rates.get('window_s', 0)}s)",
    ]
    pool = stats.get("shm_pool")
    if pool:
        by_state = pool.get("bytes_by_state", {})
        lines.append(
            f"shm pool {pool.get('segments', 0)} segments {pool.get('bytes', 0)} bytes "
            f"(stored {by_state.get('stored', 0)}, free {by_state.get('free', 0)}, "
            f"reserved {by_state.get('reserved', 0)})  created {pool.get('created', 0)}  "
            f"reused {pool.get('reused', 0)}"
        )
    lines += [
        "",
        f"{'partition':<20} {'samples':>9} {'bytes':>14} {'task':<16} {'consumed':>9} {'leased':>7}",
    ]
    for name, part in sorted(stats.get("partitions", {}).items()):
        tasks = sorted(part.get("tasks", {}).items()) or [("-", {"consumed": "", "leased": ""})]
        for i, (task, t) in enumerate(tasks):
            head = (
                f"{name:<20} {part['samples']:>9} {part['bytes']:>14}"
                if i == 0
                else f"{'':<20} {'':>9} {'':>14}"
            )
            lines.append(f"{head} {task:<16} {t['consumed']!s:>9} {t['leased']!s:>7}")
    return "\n".join(lines)
