"""`xtoken control serve`: the control plane's REST API (uvicorn), settings from flags and env."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve`` and its flags (each defaults to its ``XTOKEN_CONTROL_*`` variable)."""
    from services.common.flags import INTERNAL

    sub = parser.add_subparsers(dest="control_command", metavar="ACTION")
    serve = sub.add_parser(
        "serve",
        help="serve the REST API (OpenAPI at /docs)",
        description="Serve the control plane. Every flag defaults to the environment variable "
        "XTOKEN_CONTROL_<FLAG> (e.g. XTOKEN_CONTROL_TOKEN), then to the built-in default.",
    )
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000; 0: a free one)")
    serve.add_argument("--token", help="bearer token for mutating calls (prefer the env var)")
    serve.add_argument("--runs-root", help="run directories live under it (default runs)")
    serve.add_argument(
        "--data-root", help="comma-separated roots of data, models, projections (default data)"
    )
    serve.add_argument("--db", help="SQLite file (default RUNS_ROOT/control.db)")
    serve.add_argument("--launcher", choices=("local", "ray"), help="default local")
    serve.add_argument("--ray-address", help="Ray cluster address (launcher ray)")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    serve.add_argument(
        "--queue",
        help="address of a running queue server for runs whose config names none (their "
        "partitions prefixed with the run id); default: each run starts its own queue",
    )
    # internal (hidden from --help): the ready handshake, {pid, endpoint} once listening
    serve.add_argument("--ready-file", help=INTERNAL)


def settings_from_args(args: argparse.Namespace):
    """Settings from the environment, overridden by the flags given.

    Raises:
        pydantic.ValidationError: a bad value (names the setting).
    """
    from services.control.settings import Settings

    flags = {
        "host": args.host,
        "port": args.port,
        "token": args.token,
        "runs_root": args.runs_root,
        "data_root": args.data_root,
        "db": args.db,
        "launcher": args.launcher,
        "ray_address": args.ray_address,
        "max_body_bytes": args.max_body_bytes,
        "queue": args.queue,
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; the runs' processes go on (the next start re-attaches)."""
    if getattr(args, "control_command", None) != "serve":
        print("xtoken control: give an action: serve", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from services.common.lifecycle import configure_logging

    configure_logging("control", args.log_level)
    try:
        settings = settings_from_args(args)
        settings.check_bind()
    except ValidationError as e:
        errors = "; ".join(
            f"--{str(err['loc'][0]).replace('_', '-')} (XTOKEN_CONTROL_"
            f"{str(err['loc'][0]).upper()}): {err['msg']}"
            for err in e.errors()
        )
        print(f"xtoken control serve: {errors}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"xtoken control serve: {e}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (a response written as headers
    # + body would otherwise wait ~40 ms for a delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host.strip("[]"), settings.port))
    except OSError as e:
        sock.close()
        print(
            f"xtoken control serve: cannot bind {settings.host}:{settings.port}: {e.strerror}; "
            "pick another --port",
            file=sys.stderr,
        )
        return 2
    sock.listen(128)
    port = sock.getsockname()[1]
    endpoint = f"http://{settings.host}:{port}"
    return _serve(settings, sock, endpoint, args.ready_file)


def _serve(settings, sock: socket.socket, endpoint: str, ready_file: str | None) -> int:
    import uvicorn

    from services.control.app import create_app

    app = create_app(
        settings,
        on_ready=(lambda: _write_ready(Path(ready_file), endpoint)) if ready_file else None,
    )
    # open event streams (a dashboard) never end by themselves: give them 3 s on shutdown
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=3
    )
    server = _server_class(uvicorn)(config)
    logger.info("[control] listening on %s (docs at %s/docs)", endpoint, endpoint)
    try:
        server.run(sockets=[sock])
    finally:
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
    return 0 if server.started else 1


def _server_class(uvicorn):
    """uvicorn's Server that exits 0 after a SIGTERM / SIGINT drain (uvicorn re-raises the
    signal after its shutdown; every xtoken process exits 0 once it drained)."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server


def _write_ready(path: Path, endpoint: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "name": "control", "endpoint": endpoint}))
    os.replace(tmp, path)
