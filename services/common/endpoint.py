"""Checks a ZMQ endpoint given on a command line (``tcp://HOST:PORT`` or ``ipc://PATH``)."""

from __future__ import annotations

import re

_TCP = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):(\*|[0-9]{1,5})")


def check_endpoint(address: str, flag: str) -> str:
    """Return ``address`` if it is a ZMQ endpoint a server binds or a client connects to.

    Args:
        address: the endpoint as given.
        flag: the command-line flag that gave it (named in the message), e.g. ``"--queue"``.

    Returns:
        ``address`` unchanged.

    Raises:
        ValueError: no ``tcp://`` / ``ipc://`` scheme, no host or port, or a port over 65535;
            the message names the flag, the value and a valid example.
    """
    text = str(address)
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    m = _TCP.fullmatch(text)
    if m is not None and (m.group(2) == "*" or int(m.group(2)) <= 65535):
        return text
    hint = f"tcp://{text}" if "://" not in text and ":" in text else "tcp://127.0.0.1:5555"
    raise ValueError(
        f"{flag} {text!r} is not a ZMQ endpoint: write tcp://HOST:PORT or ipc://PATH, e.g. {hint}"
    )
