"""The queue server's gate: the ZMTP handshake's token check (ZAP) and its connection count."""

from __future__ import annotations

import zmq

from services.queue import errors as codes
from services.queue.auth import TOKEN_ENV, ZAP_BUSY, ZAP_DOMAIN, ZAP_OK, zap_verdict
from services.queue.oplog import OpLog

# A connection that has not completed its ZMTP handshake (greeting, token) within this long is
# closed: how long a peer without the token can keep the one handshake command libzmq reads.
HANDSHAKE_S = 10.0
# The endpoint libzmq sends ZAP requests to (RFC 27), one per context.
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ConnectionGate:
    """The ZMTP handshake's checks of a ROUTER socket: its ZAP handler and connection count.

    With a token the socket is a ZMTP PLAIN server: a connection presents the token as its
    password in the handshake, and libzmq passes it to this handler before the connection may
    carry any message; a connection without it (NULL, or a wrong password) is closed there,
    so its messages never reach the server's memory. Every connection, with a token or not, is
    also counted (socket monitor: accepted, disconnected) and refused past ``max_connections``.
    Called from the server's event loop (``service`` when ``pollables`` are readable).

    Args:
        ctx: the server's zmq context (its ZAP endpoint is bound here).
        sock: the ROUTER, before it binds.
        token: the server's token, or None.
        max_connections: most connections kept open (``--max-connections``).
        oplog: where refusals are logged and counted.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        sock: zmq.Socket,
        token: str | None,
        max_connections: int,
        oplog: OpLog,
    ) -> None:
        self.token = token
        self.max_connections = max_connections
        self._oplog = oplog
        self.open: set[int] = set()  # file descriptors of open connections
        self.refused = 0  # connections refused in the handshake (no or wrong token)
        self.busy = 0  # connections refused past max_connections
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._monitor = sock.get_monitor_socket(events)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        if token is not None:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)

    def pollables(self) -> list[zmq.Socket]:
        """The sockets whose readiness means work for ``service``."""
        return [self._zap, self._monitor]

    def service(self) -> None:
        """Note connections opened and closed, then answer every waiting ZAP request."""
        from zmq.utils.monitor import parse_monitor_message

        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self.open.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.open.discard(fd)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and self.token is not None:
                # mostly a client without the token (ZMTP NULL against this PLAIN server)
                self.refused += 1
                self._refusal("a connection offered no token in its handshake")
        while self._zap.poll(0):
            request = self._zap.recv_multipart()
            version, request_id = request[0], request[1]
            address, mechanism = request[3], request[5]
            status, text = zap_verdict(
                mechanism, request[6:], self.token, len(self.open), self.max_connections
            )
            if status == ZAP_BUSY:
                self.busy += 1
                self._oplog.error(
                    codes.TOO_MANY_CONNECTIONS,
                    f"refused a connection from {address.decode(errors='replace') or 'ipc'}: "
                    f"{self.max_connections} connections are open (--max-connections); close "
                    "idle clients or raise --max-connections",
                    None,
                )
            elif status != ZAP_OK:
                self.refused += 1
                self._refusal(
                    f"a connection from {address.decode(errors='replace') or 'ipc'} presented "
                    f"{text}"
                )
            self._zap.send_multipart(
                [version, request_id, status.encode(), text.encode(), b"", b""]
            )

    def _refusal(self, what: str) -> None:
        self._oplog.error(
            codes.UNAUTHORIZED,
            f"{what} and was closed before sending anything: clients set {TOKEN_ENV} (or "
            "XTOKEN_QUEUE_TOKEN_FILE) to the token of --auth-token-file",
            None,
        )

    def stats(self) -> dict[str, int]:
        """Connections open now, and those refused in the handshake so far."""
        return {"open": len(self.open), "refused": self.refused, "busy": self.busy}

    def close(self) -> None:
        """Close the ZAP and monitor sockets (the ROUTER first: nothing waits on them then)."""
        self._zap.close(linger=0)
        self._monitor.close(linger=0)
