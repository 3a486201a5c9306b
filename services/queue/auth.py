"""Who may talk to a queue: the shared token (env or file), its check, client instance ids.

A queue server with a token answers only connections whose ``hello`` presented it (compared in
constant time); clients and server read it from the same places, so callers pass nothing:
``XTOKEN_QUEUE_TOKEN`` (the token) or ``XTOKEN_QUEUE_TOKEN_FILE`` (a file holding it, e.g. a
Docker secret); the server also takes ``--auth-token-file``. Never a command-line value: ``ps``
shows those to every user of the host.

The token is checked twice: in the ZMTP handshake, before a connection may carry a single
message (ZMTP PLAIN: the client presents the token as its password, the server's ZAP handler
checks it, :func:`zap_verdict`), and again in the ``hello``. A connection without it is closed
at its handshake, so the server never receives, let alone buffers, its messages. The same ZAP
handler caps the connections a server keeps open (``--max-connections``), with or without a
token.

Leases are bound to the **instance** of the client that claimed them: a random id per process
(new after a fork), sent in every hello, so that any client of that process (a helper thread's,
one reopened after a dropped connection) may ack or nack them, and no other process may.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from typing import Any

TOKEN_ENV = "XTOKEN_QUEUE_TOKEN"
TOKEN_FILE_ENV = "XTOKEN_QUEUE_TOKEN_FILE"
# Longest instance id a hello may carry (the server keeps one per connection).
MAX_INSTANCE_CHARS = 128
# ZMTP PLAIN carries the password with a one-byte length.
MAX_TOKEN_BYTES = 255
# The ZAP domain of queue servers (ZAP consults its handler for NULL connections only when a
# domain is set: this is what lets the handler cap connections of a server without a token).
ZAP_DOMAIN = "xtoken-queue"
# ZAP status codes (RFC 27) of the server's answers: 200 accepted, 400 refused (no or a wrong
# token), 500 refused past --max-connections. libzmq closes a connection answered 300 ("try
# later") without telling its client anything, and tells a client only the code of any other
# refusal: 500 is the code a client reads as "too many connections".
ZAP_OK, ZAP_DENIED, ZAP_BUSY = "200", "400", "500"

_instance = secrets.token_hex(16)


def _new_instance() -> None:
    global _instance
    _instance = secrets.token_hex(16)


os.register_at_fork(after_in_child=_new_instance)


def process_instance() -> str:
    """This process's client instance id (128 random bits; a forked child gets its own)."""
    return _instance


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped).

    Raises:
        ValueError: the file cannot be read or holds only whitespace (names the file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(
            f"cannot read the queue token file {path!r} ({e.strerror}); fix --auth-token-file "
            f"or {TOKEN_FILE_ENV}"
        ) from None
    if not token:
        raise ValueError(
            f"the queue token file {path!r} is empty; write the shared token into it "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return check_token(token, f"the queue token in {path!r}")


def check_token(token: str, where: str = "the queue token") -> str:
    """``token`` if it can travel in a ZMTP PLAIN handshake (at most 255 bytes of UTF-8).

    Raises:
        ValueError: a longer token, naming where it came from and the fix.
    """
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise ValueError(
            f"{where} is {len(token.encode())} bytes; the queue takes at most {MAX_TOKEN_BYTES} "
            "(it travels as the ZMTP PLAIN password): use a shorter one, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return token


def load_token(path: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The queue token: from ``path`` if given, else ``XTOKEN_QUEUE_TOKEN``, else the file
    that ``XTOKEN_QUEUE_TOKEN_FILE`` names; None when none is set (an empty value counts as
    unset).

    Raises:
        ValueError: a token file that cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    if path:
        return read_token_file(path)
    value = env.get(TOKEN_ENV, "").strip()
    if value:
        return check_token(value, TOKEN_ENV)
    file = env.get(TOKEN_FILE_ENV, "").strip()
    return read_token_file(file) if file else None


def token_matches(expected: str, given: Any) -> bool:
    """Whether ``given`` is the token, compared in constant time."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def zap_verdict(
    mechanism: bytes,
    credentials: list[bytes],
    token: str | None,
    connections: int,
    max_connections: int,
) -> tuple[str, str]:
    """Whether a queue server lets a connection through its ZMTP handshake (its ZAP handler's
    answer).

    Args:
        mechanism: the connection's ZMTP mechanism (``b"NULL"`` or ``b"PLAIN"``).
        credentials: PLAIN's ``[username, password]``; empty for NULL.
        token: the server's token; None serves connections without one (NULL).
        connections: connections open now, this one included.
        max_connections: most connections the server keeps open (``--max-connections``).

    Returns:
        ``(status, text)``: ``ZAP_OK``, ``ZAP_DENIED`` (no token, or a wrong one) or
        ``ZAP_BUSY`` (past the cap; the client may retry later), and why.
    """
    if token is not None:
        password = credentials[1] if mechanism == b"PLAIN" and len(credentials) == 2 else None
        if password is None:
            return ZAP_DENIED, "no token"
        if not hmac.compare_digest(token.encode(), password):
            return ZAP_DENIED, "wrong token"
    if connections > max_connections:
        return ZAP_BUSY, f"{max_connections} connections open"
    return ZAP_OK, "OK"


def is_loopback(endpoint: str) -> bool:
    """Whether a ZMQ bind endpoint is reachable from this host only (``ipc://``, ``inproc://``,
    ``tcp://`` on a loopback address or ``localhost``); ``*``, ``0.0.0.0``, interface and host
    names count as reachable from elsewhere."""
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rpartition(":")[0].split(";")[-1].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
