"""`xtoken control serve`: the control plane's REST API (uvicorn), settings from flags and env."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import socket
import sys
from argparse import SUPPRESS
from pathlib import Path

logger = logging.getLogger(__name__)


# argparse dests of the settings' flags: prefixed so that they never meet the global flags
_DEST = "control_setting:"
# settings read from the environment or --config FILE only
_NO_FLAG = frozenset({"token"})
_REFUSED_TOKEN = "control_refused:token"
TOKEN_ON_ARGV = (
    "--token is not accepted: a command line is visible to every local user (ps); set "
    "XTOKEN_CONTROL_TOKEN in the environment, or put the token in a file and pass "
    "--token-file FILE (XTOKEN_CONTROL_TOKEN_FILE)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve`` and its flags, generated from :class:`~services.control.settings.Settings`
    (each defaults to its ``XTOKEN_CONTROL_*`` variable), and ``--config FILE``."""
    from services.common.flags import INTERNAL

    sub = parser.add_subparsers(dest="control_command", metavar="ACTION")
    serve = sub.add_parser(
        "serve",
        help="serve the REST API (OpenAPI at /docs)",
        description="Serve the control plane. Every setting is read from --config FILE, then "
        "from its environment variable XTOKEN_CONTROL_<NAME> (e.g. XTOKEN_CONTROL_TOKEN), then "
        "from its flag; a flag's value reads as the variable's would.",
    )
    # internal (hidden from --help): the ready handshake, {pid, endpoint} once listening
    serve.add_argument("--ready-file", help=INTERNAL)
    try:
        from services.control.settings import Settings
    except ImportError:  # the control extra is not installed: `serve` says so
        serve.set_defaults(_missing=True)
        return
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="JSON or YAML file of these settings (keys as below, e.g. runs_root); the "
        "environment and flags override it",
    )
    # the token has no flag: every local user can read a process's command line (ps)
    serve.add_argument(
        "--token", dest=_REFUSED_TOKEN, nargs="?", default=argparse.SUPPRESS, help=SUPPRESS
    )
    for name, field in Settings.model_fields.items():
        if name in _NO_FLAG:
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):  # list settings read comma-separated, as from the env
            default = ",".join(map(str, default)) or "none"
        serve.add_argument(
            f"--{name.replace('_', '-')}",
            dest=_DEST + name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{field.description} (XTOKEN_CONTROL_{name.upper()}; default: {default})",
        )


def settings_from_args(args: argparse.Namespace):
    """Settings from ``--config FILE``, overridden by the environment, overridden by the flags
    given.

    Raises:
        ValueError: ``--token`` was given (says to use the environment or a token file).
        pydantic.ValidationError: a bad value (names the setting).
        ConfigError: a config file that cannot be read, or an unknown key in it.
    """
    from services.common.config import ConfigError, load_file
    from services.control.settings import Settings

    if hasattr(args, _REFUSED_TOKEN):
        raise ValueError(TOKEN_ON_ARGV)
    data: dict = load_file(args.config) if getattr(args, "config", None) else {}
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(Settings.model_fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"config file {args.config!r}: unknown key {unknown[0]!r}: the control plane knows "
            f"{', '.join(Settings.model_fields)}{hint}"
        )
    environ = {k.upper() for k in os.environ}
    values = {k: v for k, v in data.items() if f"XTOKEN_CONTROL_{k.upper()}" not in environ}
    values.update({k[len(_DEST) :]: v for k, v in vars(args).items() if k.startswith(_DEST)})
    return Settings(**values)


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
        errors = "; ".join(_setting_error(err) for err in e.errors())
        print(f"xtoken control serve: {errors}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"xtoken control serve: {e}", file=sys.stderr)
        return 2
    # read once: the runs' processes do not inherit the token
    os.environ.pop("XTOKEN_CONTROL_TOKEN", None)
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


def _setting_error(err: dict) -> str:
    """One pydantic error as ``--flag (XTOKEN_CONTROL_NAME): message`` (a check across settings,
    without a field, as its message)."""
    message = str(err["msg"]).removeprefix("Value error, ")
    if not err.get("loc"):
        return message
    name = str(err["loc"][0])
    return f"--{name.replace('_', '-')} (XTOKEN_CONTROL_{name.upper()}): {message}"


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
