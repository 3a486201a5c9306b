"""`xtoken queue`: run a transfer-queue server (`serve`) or print its stats (`stats`)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys

from services.common import config as cfg
from services.common.flags import INTERNAL
from services.queue.config import ServerConfig, format_size

__all__ = ["EXIT_BAD_DATA", "add_arguments", "run"]

logger = logging.getLogger(__name__)

# `queue serve` exit code when the data in --data-dir is bad (a corrupt log record), as opposed
# to bad settings (2): the operator restores the directory or starts with --salvage.
EXIT_BAD_DATA = 3


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
    """Add the `serve` (flags generated from :class:`ServerConfig`), `stats` and operator
    sub-subcommands."""
    sub = parser.add_subparsers(
        dest="queue_command", metavar="{serve,stats,list,peek,clear,drain}", required=True
    )
    serve = sub.add_parser(
        "serve",
        help="run a queue server until SIGTERM/SIGINT (exit 0 after the drain, 2 on bad settings, "
        "3 on a corrupt --data-dir log)",
    )
    cfg.add_arguments(serve, ServerConfig)
    # internal (hidden from --help): the ready handshake, {"pid", "name": "queue", "endpoint"}
    # JSON once listening
    serve.add_argument("--ready-file", default=None, help=INTERNAL)
    stats = sub.add_parser("stats", help="print a queue server's stats")
    stats.add_argument(
        "--queue",
        required=True,
        type=_endpoint_arg("--queue"),
        help="server endpoint, e.g. tcp://host:5555",
    )
    stats.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    stats.add_argument(
        "--timeout-s", type=float, default=5.0, help="seconds to wait for a reply (default 5)"
    )
    _add_operator_commands(sub)


def run(args: argparse.Namespace) -> int:
    """Run the chosen queue command; returns the exit status."""
    if args.queue_command == "serve":
        return _serve(args)
    if args.queue_command in _OPERATOR_COMMANDS:
        return _OPERATOR_COMMANDS[args.queue_command](args)
    return _stats(args)


def _serve(args: argparse.Namespace) -> int:
    from services.common.lifecycle import Lifecycle, run_process

    def main(lifecycle: Lifecycle) -> int:
        from services.queue.auth import load_token
        from services.queue.server import serve

        data = cfg.args_to_dict(ServerConfig, args)
        if data.get("auth_token") is None:  # the token file, else the environment's token
            data["auth_token"] = load_token(data.get("auth_token_file"))
        config = cfg.from_parsed(ServerConfig, data, args)  # ConfigError: exit code 2
        import zmq

        from services.queue.durable import CorruptLogError

        try:
            return serve(config, lifecycle)
        except CorruptLogError as e:
            logger.error("[queue] error: %s", e)
            return EXIT_BAD_DATA
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
                config.bind,
                why,
            )
            return 2  # a bad setting (--bind), as --help says

    return run_process(
        "queue", main, ready_file=args.ready_file, log_level=getattr(args, "log_level", "INFO")
    )


def _stats(args: argparse.Namespace) -> int:
    from services.queue.client import QueueClient
    from services.queue.errors import QueueError

    try:
        with QueueClient(args.queue, timeout_s=args.timeout_s, retries=0) as client:
            stats = client.stats()
    except QueueError as e:
        if e.code == "timeout":
            print(
                f"xtoken queue stats: no reply from {args.queue} within {args.timeout_s:g}s; is the "
                "server up? check --queue or raise --timeout-s",
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
        f"bytes {format_size(used)} / {format_size(cap)} ({100.0 * used / max(cap, 1):.1f}%)  "
        f"samples {stats.get('samples', 0)}"
        f"  leases {stats.get('leases', 0)}  parked claims {stats.get('parked_claims', 0)}"
        f"  parked puts {stats.get('parked_puts', 0)}",
        f"put {rates.get('put_samples_per_s', 0.0):.1f} samples/s "
        f"{format_size(rates.get('put_bytes_per_s', 0.0))}/s   claim "
        f"{rates.get('claim_samples_per_s', 0.0):.1f} samples/s "
        f"{format_size(rates.get('claim_bytes_per_s', 0.0))}/s "
        f"(last {rates.get('window_s', 0)}s)",
    ]
    pool = stats.get("shm_pool")
    if pool:
        by_state = pool.get("bytes_by_state", {})
        lines.append(
            f"shm pool {pool.get('segments', 0)} segments {format_size(pool.get('bytes', 0))} "
            f"(stored {format_size(by_state.get('stored', 0))}, "
            f"free {format_size(by_state.get('free', 0))}, "
            f"reserved {format_size(by_state.get('reserved', 0))})  created {pool.get('created', 0)}  "
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
                f"{name:<20} {part['samples']:>9} {format_size(part['bytes']):>14}"
                if i == 0
                else f"{'':<20} {'':>9} {'':>14}"
            )
            lines.append(f"{head} {task:<16} {t['consumed']!s:>9} {t['leased']!s:>7}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- operator commands


def _add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``list``, ``peek``, ``clear`` and ``drain`` (each talks to a running server)."""

    def command(name: str, help: str, partition: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument(
            "--queue",
            required=True,
            type=_endpoint_arg("--queue"),
            help="server endpoint, e.g. tcp://host:5555",
        )
        p.add_argument(
            "--timeout-s", type=float, default=5.0, help="seconds to wait for a reply (default 5)"
        )
        if partition:
            p.add_argument("--partition", required=True, help="partition name")
        return p

    listing = command("list", "list partitions with samples, bytes and tasks", partition=False)
    listing.add_argument("--json", action="store_true", help="print the partitions as JSON")
    peek = command("peek", "print keys and field shapes of a partition's first samples")
    peek.add_argument("-n", type=int, default=5, help="samples to show (default 5)")
    clear = command("clear", "remove every sample of a partition (needs --yes)")
    clear.add_argument("--yes", action="store_true", help="really clear the partition")
    drain = command("drain", "claim and ack every sample a task has not consumed; count them")
    drain.add_argument("--task", required=True, help="the task whose samples are consumed")
    drain.add_argument("--batch", type=int, default=256, help="samples per claim (default 256)")
    drain.add_argument(
        "--wait-s",
        type=float,
        default=0.0,
        help="seconds a claim waits for more data before the drain stops (default 0: stop "
        "when nothing is ready)",
    )
    drain.add_argument(
        "--register",
        action="store_true",
        help="register --task for the partition (retention: samples every registered task "
        "acked are dropped)",
    )


def _operator(args: argparse.Namespace, action) -> int:
    """Run ``action(client)`` against ``--queue``; a failure is one line naming the flags."""
    from services.queue.client import QueueClient
    from services.queue.errors import QueueError

    name = f"xtoken queue {args.queue_command}"
    try:
        with QueueClient(args.queue, timeout_s=args.timeout_s, retries=0) as client:
            return action(client)
    except QueueError as e:
        if e.code == "timeout":
            print(
                f"{name}: no reply from {args.queue} within {args.timeout_s:g}s; is the server "
                "up? check --queue or raise --timeout-s",
                file=sys.stderr,
            )
        else:
            print(f"{name}: {e}", file=sys.stderr)
        return 1


def _list(args: argparse.Namespace) -> int:
    def action(client) -> int:
        parts = client.stats().get("partitions", {})
        if args.json:
            print(json.dumps(parts, indent=2, sort_keys=True))
        else:
            print(format_partitions(parts))
        return 0

    return _operator(args, action)


def format_partitions(parts: dict) -> str:
    """Render the ``partitions`` of a stats reply, one row per partition.

    Args:
        parts: partition name -> ``{"samples", "bytes", "sample_bytes", "tasks"}``.

    Returns:
        A table; tasks as ``name consumed/leased``.
    """
    lines = [
        f"{'partition':<24} {'samples':>9} {'held':>10} {'samples':>10}  tasks (consumed/leased)"
    ]
    for name, part in sorted(parts.items()):
        tasks = ", ".join(
            f"{t} {s['consumed']}/{s['leased']}" for t, s in sorted(part.get("tasks", {}).items())
        )
        lines.append(
            f"{name:<24} {part['samples']:>9} {format_size(part.get('bytes', 0)):>10} "
            f"{format_size(part.get('sample_bytes', 0)):>10}  {tasks or '-'}"
        )
    if not parts:
        lines.append("(no partitions)")
    return "\n".join(lines)


def _field_shape(value) -> list[str]:
    """Per row of a read field: ``dtype [dims] (jagged)`` or ``dtype [dims]``."""
    from xtoken_core.wire.tensors import JaggedColumn

    if isinstance(value, JaggedColumn):
        offs = value.offsets.tolist()
        tail = list(value.values.shape[1:])
        dtype = str(value.values.dtype).removeprefix("torch.")
        return [f"{dtype} {[b - a, *tail]} (jagged)" for a, b in zip(offs, offs[1:])]
    if hasattr(value, "is_nested") and value.is_nested:
        dtype = str(value.dtype).removeprefix("torch.")
        return [f"{dtype} {list(row.shape)} (jagged)" for row in value.unbind()]
    dtype = str(value.dtype).removeprefix("torch.")
    return [f"{dtype} {list(value.shape[1:])}" for _ in range(value.shape[0])]


def _peek(args: argparse.Namespace) -> int:
    if args.n < 1:
        print("xtoken queue peek: -n must be >= 1", file=sys.stderr)
        return 2

    def action(client) -> int:
        listing = client.list(args.partition)
        keys = listing["keys"]
        print(f"partition {args.partition}: {len(keys)} samples, fields {listing['fields']}")
        if not keys:
            return 0
        fields = client.get(args.partition, keys[: args.n])["fields"]
        shapes = {name: _field_shape(value) for name, value in sorted(fields.items())}
        for i, key in enumerate(keys[: args.n]):
            print(key)
            for name, rows in shapes.items():
                print(f"  {name} {rows[i]}")
        return 0

    return _operator(args, action)


def _clear(args: argparse.Namespace) -> int:
    def action(client) -> int:
        if not args.yes:
            part = client.stats().get("partitions", {}).get(args.partition)
            what = (
                f"{part['samples']} samples ({format_size(part.get('bytes', 0))})"
                if part
                else "nothing (no such partition)"
            )
            print(
                f"xtoken queue clear: would remove {what} of partition {args.partition!r} "
                f"from {args.queue}; pass --yes to clear it",
                file=sys.stderr,
            )
            return 2
        count = client.clear(args.partition)["count"]
        print(f"cleared {count} samples of partition {args.partition!r}")
        return 0

    return _operator(args, action)


def _drain(args: argparse.Namespace) -> int:
    if args.batch < 1:
        print("xtoken queue drain: --batch must be >= 1", file=sys.stderr)
        return 2

    def action(client) -> int:
        drained = 0
        while True:
            # no fields: only keys travel; the lease is acked at once
            reply = client.claim(
                args.partition,
                args.task,
                [],
                args.batch,
                fields=[],
                timeout_s=args.wait_s,
                register=args.register,
            )
            if not reply["keys"]:
                break
            drained += client.ack(args.partition, args.task, reply["lease_id"])["count"]
        print(f"drained {drained} samples of partition {args.partition!r} under task {args.task!r}")
        return 0

    return _operator(args, action)


_OPERATOR_COMMANDS = {"list": _list, "peek": _peek, "clear": _clear, "drain": _drain}
