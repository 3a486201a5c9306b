"""The queue client: QueueClient (a ZMQ DEALER; one per thread).

Every method sends one request and returns the reply body (a dict); an ``error`` reply raises
QueueError with its code and ``retryable``. A request that gets no reply within ``timeout_s``
(plus the server-side wait the request itself asks for) is retried ``retries`` times on a fresh
socket, then raises QueueError("timeout"). Retries are safe for puts (idempotent by key); a
retried claim may leave a lease unanswered, which the server redelivers when it expires.
Jagged fields of replies are ``JaggedColumn`` (values + offsets views of the received frames).
Every reply names the server instance (``epoch``, random per start); a client remembers the first
and, when a reply comes from another, counts the restart (``epoch_changes``), logs it and calls
``on_epoch(old, new)``: its leases are gone, and so is everything else it built on the old
instance unless the server is durable (``--data-dir``; its hello says so, ``server_durable``, and
the log line says what was kept). An ack or nack of an old instance's lease raises
``StaleEpochError``.
A dead server is noticed within ~2 s (its connection closes, or ZMTP heartbeats go unanswered
for 1.5 s): the request in flight is sent again at once on a fresh socket, and reaches the
server's replacement as soon as one listens (``disconnects`` counts them). Every request is safe
to send twice: puts and clears are idempotent, a claim's unanswered lease lapses, an ack of a
lease the server applied (or an old instance issued) is an error, never a double ack. A client
given a ``stop`` (an event, or a callable returning True to stop) raises ``QueueError("stopped")``
within ~50 ms of it being set, whatever the server does (SIGTERM of a collator or consumer whose
queue is gone). A client given ``stopping`` (the same kinds) tries nothing twice once it is set:
a request whose connection drops (while it waits, or before it is sent), or that gets no reply in
time, raises ``QueueError("stopped")`` at once, not sent (again); a reply on its way is still
waited for (a stopping worker gives its leases back to a live queue, and spends no retries on one
that went away).
Every new connection starts with a ``hello`` sent ahead of its first request (no round trip
waited for): it presents the token of a server that needs one (``token=``, else
``XTOKEN_QUEUE_TOKEN`` / ``XTOKEN_QUEUE_TOKEN_FILE``, auth.py) and the client's ``instance`` (by
default one random id per process), which owns the leases it claims: any client of the same
instance may ack or nack them, a client of another gets ``not_owner``. A client with a token
also presents it in the ZMTP handshake (PLAIN), which a server with a token checks before the
connection may carry anything; a handshake the server refuses raises ``unauthorized`` (no or a
wrong token) or the retryable ``too_many_connections`` (``--max-connections``) at once, and a
server without a token (NULL) is talked to without one.
Same-host QueueClients put through the server's shared-memory pool and may ask claims and gets
to answer with views of it (``shm=True``; the lifetime contract is in shm_transport.py).
A put also takes a ``TensorDict [N]`` (jagged nested, dense and non-tensor leaves), and a claim
or get returns one with ``as_tensordict=True``: its jagged leaves view the received frames
(xtoken_core/data_plane/tensordict_io.py; the wire is the same).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from services.queue import errors as codes
from services.queue.auth import TOKEN_ENV, ZAP_BUSY, check_token, load_token, process_instance
from services.queue.errors import QueueError, StaleEpochError
from services.queue.shm_transport import DEFAULT_SHM_MIN_BYTES, ShmPuts
from services.queue.transport import recv_frames, send_frames
from xtoken_core.data_plane.tensordict_io import (
    fields_to_tensordict,
    is_tensordict,
    tensordict_to_fields,
)
from xtoken_core.ipc.shm import ShmReader, ShmRegion
from xtoken_core.wire import (
    BAD_BODY,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    WireError,
    WireLimits,
    decode_message,
    encode_message,
)

logger = logging.getLogger(__name__)

DEFAULT_PUT_TIMEOUT_S = 30.0
DEFAULT_CLAIM_TIMEOUT_S = 1.0
DEFAULT_LEASE_S = 60.0
# ZMTP heartbeats of a client connection: a server that answers none for HEARTBEAT_TIMEOUT_S
# (hung, or its host gone without a FIN) is dropped, like one whose process died (the kernel
# closes its connections at once): either way the request in flight is sent again at once.
HEARTBEAT_IVL_S = 0.5
HEARTBEAT_TIMEOUT_S = 1.5
# Requests sent again at once after a dropped connection, per request (on top of ``retries``).
MAX_RESENDS = 10
# With a stop event, waits are sliced so that a stop is seen within this many ms.
_STOP_POLL_MS = 50
# What a connection's monitor reports: a drop, or a handshake the server refused.
_MONITORED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(0, int(round(seconds * 1000)))


def _is_set(flag: Any) -> bool:
    """Whether a ``stop`` or ``stopping`` (an event, a callable, or None: never) is set."""
    if flag is None:
        return False
    return bool(flag.is_set() if hasattr(flag, "is_set") else flag())


@dataclass
class _Tries:
    """The tries of one request so far: timeouts, resends after a drop, a repeated hello."""

    attempt: int = 0
    resends: int = 0
    rehello: bool = False
    unshaken: int = 0  # connections the server closed in their handshake


class _Requests:
    """Builds request bodies and reads replies: the socket-free half of the client."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        retries: int,
        limits: WireLimits | None,
        name: str,
        on_epoch: Callable[[str | None, str], None] | None = None,
        token: str | None = None,
        instance: str | None = None,
        stop: Any = None,
        stopping: Any = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (seconds to wait for a reply)")
        if retries < 0:
            raise ValueError(f"retries={retries}: must be >= 0")
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.limits = limits or DEFAULT_LIMITS
        self.name = name or f"client-{os.getpid()}"
        self._ids = itertools.count(1)
        self.epoch: str | None = None  # the server instance of the last reply
        self.epoch_changes = 0  # restarts of the server seen by this client
        self.on_epoch = on_epoch
        self.token = check_token(token, "token") if token is not None else load_token()
        self.instance = instance or process_instance()
        self.stop = stop
        self.stopping = stopping
        self.disconnects = 0  # connections found dead while a request waited
        # The token goes into the ZMTP handshake (PLAIN) until a server answers that it takes
        # none (NULL); then it travels in the hello only.
        self._plain = self.token is not None
        self._refusal: tuple[int, int] | None = None  # (event, value) of a refused handshake
        self._handshaken = False  # whether this socket's connection completed a handshake
        self.server_durable: bool | None = None  # the last hello reply's "durable"
        self._hello_epoch: str | None = None  # the instance that hello reply came from

    def _check_stop(self, msg_type: str) -> None:
        if _is_set(self.stop):
            raise QueueError(
                codes.STOPPED,
                f"{msg_type} to {self.address} abandoned: this client was told to stop",
                request_type=msg_type,
            )

    def _new_socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A connected DEALER with heartbeats, and the monitor that reports its drops."""
        sock = self._ctx.socket(zmq.DEALER)
        self._socket_options(sock)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        if self._plain:  # the token in the handshake: a server with one checks it there
            sock.setsockopt(zmq.PLAIN_USERNAME, self.name.encode()[:255])
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.token.encode())
        # the connection's fate: EVENT_DISCONNECTED when the server died or went silent, a
        # handshake failure when it refused the connection
        monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(self.address)
        return sock, monitor

    def _drain_monitor(self, monitor: zmq.Socket) -> bool:
        """Whether the connection dropped since the last look (drains the monitor); a refused
        handshake is kept in ``_refusal``."""
        from zmq.utils.monitor import parse_monitor_message

        dropped = False
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
                continue
            if kind != zmq.EVENT_DISCONNECTED:
                self._refusal = (int(kind), int(event["value"]))
            dropped = True
        return dropped

    def _refused(self, msg_type: str, tries: _Tries) -> bool:
        """After a drop: act on a connection the server closed in its handshake. Returns True
        to send the request again at once, after switching between a handshake with the token
        and one without (a server that takes none, or one restarted with one).

        A server whose mechanism differs (PLAIN with a token, NULL without) closes the
        connection as soon as it reads the client's greeting, sometimes before its own greeting
        left: then no reason reaches the client, only the close. A client with a token switches
        handshakes on such a close; one without takes the third in a row for a refusal.

        Raises:
            QueueError: ``unauthorized`` (this client has no token, or a wrong one) or the
                retryable ``too_many_connections``.
        """
        refusal, self._refusal = self._refusal, None
        if self._handshaken:
            return False  # an ordinary drop of a connection that was up
        event, value = refusal or (0, 0)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if str(value) == ZAP_BUSY:
                raise QueueError(
                    codes.TOO_MANY_CONNECTIONS,
                    f"the queue at {self.address} refused this connection: it holds its "
                    "--max-connections already; close idle clients, retry later, or raise the "
                    "server's --max-connections",
                    retryable=True,
                    request_type=msg_type,
                )
            raise QueueError(
                codes.UNAUTHORIZED,
                f"the queue at {self.address} refused this client's token in the handshake (it "
                f"does not match the server's --auth-token-file): fix {TOKEN_ENV} (or "
                "XTOKEN_QUEUE_TOKEN_FILE), or QueueClient(token=...)",
                request_type=msg_type,
            )
        if event and value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return False  # a garbled handshake: treated as a dropped connection
        tries.unshaken += 1
        if self.token is not None:
            if tries.unshaken > 4:
                return False  # not a mechanism: resent like any drop
            self._plain = not self._plain  # the server has the other mechanism: switch to it
            logger.debug(
                "[queue] %s closed the handshake: trying %s the token",
                self.address,
                "with" if self._plain else "without",
            )
            return True
        if refusal is None and tries.unshaken < 3:
            return False  # resent (a server restarting mid-handshake closes it too)
        raise QueueError(
            codes.UNAUTHORIZED,
            f"the queue at {self.address} requires a token and refused this connection in "
            f"its handshake: set {TOKEN_ENV} (or XTOKEN_QUEUE_TOKEN_FILE) to the token the "
            "server reads from --auth-token-file, or pass QueueClient(token=...)",
            request_type=msg_type,
        )

    def _refused_unread(self, error: QueueError, tries: _Tries) -> bool:
        """Whether an error reply refused the request before reading it (a server that forgot
        this connection's hello): then it is sent again once, on a new connection."""
        if error.code != codes.UNAUTHORIZED or self.token is None or tries.rehello:
            return False
        tries.rehello = True
        return True

    def _stopping_error(self, msg_type: str, what: str) -> QueueError:
        return QueueError(
            codes.STOPPED,
            f"{msg_type} to {self.address} {what}: this client is stopping",
            request_type=msg_type,
        )

    def _next_try(self, msg_type: str, budget_s: float, tries: _Tries, dropped: bool) -> None:
        """Count a request's failed try: a dropped connection's is sent again at once (up to
        MAX_RESENDS), a timeout's is retried up to ``retries`` times, then raises ``timeout``;
        a stopping client's raises ``stopped`` at once (the queue may be gone with the run)."""
        if _is_set(self.stopping):
            why = "its connection dropped" if dropped else f"no reply within {budget_s:.1f}s"
            raise self._stopping_error(msg_type, f"not sent again ({why})")
        if dropped and tries.resends < MAX_RESENDS:
            tries.resends += 1
            if not self._handshaken:  # closed in its handshake (a refusal is seen on a retry)
                logger.debug("[queue] connection to %s closed in its handshake", self.address)
                return
            self.disconnects += 1
            logger.warning(
                "[queue] connection to %s dropped while waiting for %s (server dead, hung "
                "or restarting): sending it again",
                self.address,
                msg_type,
            )
            return
        tries.attempt += 1
        if tries.attempt > self.retries:
            raise self._timeout_error(msg_type, budget_s)
        logger.warning(
            "no reply to %s from %s in %.1fs (attempt %d of %d): reconnecting",
            msg_type,
            self.address,
            budget_s,
            tries.attempt,
            self.retries + 1,
        )

    def body_hello(self) -> dict[str, Any]:
        body = {"protocol_version": PROTOCOL_VERSION, "client": self.name}
        body["instance"] = self.instance
        if self.token is not None:
            body["token"] = self.token
        return body

    def _hello_frames(self) -> list[Any]:
        """A hello for a new connection, sent ahead of its first request; its reply is dropped
        (another request id) and an ``unauthorized`` one is repeated for that request."""
        return encode_message("hello", self.body_hello(), request_id=next(self._ids))

    def _see_epoch(self, epoch: Any) -> None:
        """Note the server instance of a reply; a new one is a restart (everything built on
        the old instance is gone)."""
        if not isinstance(epoch, str) or epoch == self.epoch:
            return
        old, self.epoch = self.epoch, epoch
        if old is None:
            return
        self.epoch_changes += 1
        logger.warning(
            "[queue] %s restarted (instance %s -> %s): %s",
            self.address,
            old,
            epoch,
            self._restart_loses(epoch),
        )
        if self.on_epoch is not None:
            self.on_epoch(old, epoch)

    def _restart_loses(self, epoch: str) -> str:
        """What a restart into instance ``epoch`` took, as its hello reply told."""
        if self._hello_epoch != epoch:
            return (
                "its leases are gone, and its samples too unless it runs with --data-dir (durable)"
            )
        if self.server_durable:
            return (
                "it is durable (--data-dir): its samples and what was acked are kept, its leases "
                "are gone (their samples are claimable again)"
            )
        return "its samples and leases are gone (memory only)"

    def _socket_options(self, sock: zmq.Socket) -> None:
        # a random routing id: a server binds this connection's hello (token, instance) to it,
        # and nobody can connect later under the same id (auto ids are a counter)
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes + (1 << 20))

    def _decode(
        self,
        frames: list[Any],
        request_id: int,
        msg_type: str,
        shm: ShmReader | None = None,
    ) -> dict[str, Any] | None:
        """Reply body, or None for a stale reply (another request id); raises on error replies.
        With ``shm``, shared-memory references of the reply are opened by that reader."""
        try:
            msg = decode_message(frames, limits=self.limits, jagged="column", shm=shm or False)
        except WireError as e:
            raise QueueError(
                e.code, f"undecodable reply to {msg_type}: {e.message}", request_type=msg_type
            ) from None
        body = msg.body
        if msg.msg_type == "reply" and body.get("server") == "xtoken-queue":
            # a hello's reply (often the one sent ahead of a request, dropped below): what
            # kind of instance answers, before a new epoch is reported
            self.server_durable = bool(body.get("durable"))
            self._hello_epoch = body.get("epoch")
        if msg.request_id != request_id:
            logger.debug("dropping stale reply %d (waiting for %d)", msg.request_id, request_id)
            return None
        self._see_epoch(body.get("epoch"))
        if msg.msg_type == "error":
            body = msg.body
            error = StaleEpochError if body.get("code") == codes.STALE_EPOCH else QueueError
            raise error(
                str(body.get("code")),
                str(body.get("message")),
                retryable=bool(body.get("retryable")),
                request_type=msg_type,
            )
        return msg.body

    def _timeout_error(self, msg_type: str, waited_s: float) -> QueueError:
        return QueueError(
            codes.TIMEOUT,
            f"no reply to {msg_type} from {self.address} within {waited_s:.1f}s after "
            f"{self.retries + 1} attempt(s); is the server up? raise timeout_s "
            f"(now {self.timeout_s}) or retries (now {self.retries})",
            retryable=True,
            request_type=msg_type,
        )

    @staticmethod
    def body_put(partition, keys, fields, timeout_s):
        return {
            "partition": partition,
            "keys": list(keys),
            "fields": dict(fields),
            "timeout_ms": _ms(timeout_s),
        }

    @staticmethod
    def body_claim(
        partition, task, required_fields, batch_size, fields, timeout_s, lease_s, register=False
    ):
        body = {
            "partition": partition,
            "task": task,
            "required_fields": list(required_fields),
            "fields": None if fields is None else list(fields),
            "batch_size": batch_size,
            "timeout_ms": _ms(timeout_s),
            "lease_ms": max(1, _ms(lease_s)),
        }
        if register:  # absent otherwise: the message stays what older servers know
            body["register"] = True
        return body

    @staticmethod
    def body_lease(partition, task, lease_id, keys):
        return {
            "partition": partition,
            "task": task,
            "lease_id": lease_id,
            "keys": None if keys is None else list(keys),
        }


class QueueClient(_Requests):
    """Synchronous client over one DEALER socket (not thread-safe: one per thread).

    Args:
        address: server endpoint, e.g. ``tcp://127.0.0.1:5555``.
        timeout_s: seconds to wait for a reply, on top of the wait a request asks for.
        retries: extra attempts after a timeout, each on a fresh socket.
        limits: wire limits (must match the server's for large messages).
        name: client name sent in ``hello``.
        context: zmq Context (the process-wide one by default).
        shm: ``"auto"`` puts of >= ``shm_min_bytes`` to a same-host server through its
            shared-memory pool, ``"never"``, or ``"always"`` (services/queue/shm_transport.py).
        shm_min_bytes: the ``auto`` threshold (tensor bytes of one put).
        on_epoch: called with ``(old, new)`` instance ids when a reply shows the server
            restarted (after the first reply; also counted in ``epoch_changes``).
        stop: an event (anything with ``is_set()``: threading, multiprocessing) or a
            callable returning True to stop; once set, a request waiting for its reply raises
            ``QueueError("stopped")`` (not retryable) within ~50 ms.
        stopping: the same kinds as ``stop``; once set, a request is tried no more: a dropped
            connection (found while it waits, or before it is sent) or a missing reply raises
            ``QueueError("stopped")`` instead of a send, a resend or a retry, while a reply on
            its way is still waited for.
        token: the server's shared secret, presented in every hello (None: the
            ``XTOKEN_QUEUE_TOKEN`` environment variable, else the file ``XTOKEN_QUEUE_TOKEN_FILE``
            names, else none).
        instance: the owner of the leases this client claims (None: this process's random
            id, so that every client of the process may ack them; a forked child gets its own).

    Raises:
        ValueError: a non-positive timeout, negative retries, an unknown ``shm`` mode.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        limits: WireLimits | None = None,
        name: str = "",
        context: zmq.Context | None = None,
        shm: str = "auto",
        shm_min_bytes: int = DEFAULT_SHM_MIN_BYTES,
        on_epoch: Callable[[str | None, str], None] | None = None,
        stop: Any = None,
        token: str | None = None,
        instance: str | None = None,
        stopping: Any = None,
    ) -> None:
        super().__init__(
            address, timeout_s, retries, limits, name, on_epoch, token, instance, stop, stopping
        )
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._shm = ShmPuts(address, shm, shm_min_bytes)

    def _socket(self, msg_type: str = "hello") -> zmq.Socket:
        if self._sock is None:
            self._handshaken = False
            sock, self._monitor = self._new_socket()
            self._sock = sock
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            if msg_type != "hello":
                send_frames(sock, self._hello_frames())
        return self._sock

    def close(self) -> None:
        """Close the socket (a later request opens a new one)."""
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    def _dropped(self) -> bool:
        """Whether the connection dropped since the last look (drains the monitor)."""
        return self._drain_monitor(self._monitor)

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        msg_type: str,
        body: dict[str, Any],
        *,
        wait_s: float = 0.0,
        shm: ShmReader | None = None,
    ) -> dict[str, Any]:
        """Send one request and return the reply body.

        Args:
            msg_type: request type.
            body: request body.
            wait_s: server-side wait the request asks for (added to ``timeout_s``).
            shm: open shared-memory references of the reply with this reader.

        Returns:
            The reply body.

        Raises:
            QueueError: an error reply, or ``timeout`` after all retries.
            TypeError: a body value that cannot travel on the wire.
        """
        request_id = next(self._ids)
        frames = encode_message(msg_type, body, request_id=request_id, limits=self.limits)
        budget_s = self.timeout_s + wait_s
        tries = _Tries()
        slice_ms = _STOP_POLL_MS if self.stop is not None else None
        while True:
            self._check_stop(msg_type)
            sock = self._socket(msg_type)
            if self._dropped() and msg_type != "hello":
                if not self._handshaken:
                    # refused in its handshake before this try was sent (a local server answers
                    # fast): the refusal is this try's, and a socket the server closed with a
                    # protocol error is not reconnected, so nothing sent on it would be answered
                    self.close()
                    if not self._refused(msg_type, tries):
                        self._next_try(msg_type, budget_s, tries, dropped=True)
                    continue
                if _is_set(self.stopping):  # the queue went away (with the run): nothing is sent
                    self.close()
                    raise self._stopping_error(msg_type, "not sent (its connection dropped)")
                # dropped while idle: the socket reconnects on its own, maybe to a restarted
                # server that never saw this connection's hello (token, lease owner): say it again
                send_frames(sock, self._hello_frames())
            self._refusal = None  # only a refusal of this try's handshake counts
            send_frames(sock, frames)
            deadline = time.monotonic() + budget_s
            dropped = forgotten = False
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                ready = self._poller.poll(left_ms if slice_ms is None else min(left_ms, slice_ms))
                self._check_stop(msg_type)
                if not ready:
                    continue
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    # header and body as bytes (copied), tensor frames zero-copy
                    try:
                        reply = self._decode(recv_frames(sock, copied=2), request_id, msg_type, shm)
                    except QueueError as e:
                        if not self._refused_unread(e, tries):
                            raise
                        forgotten = True
                        break
                    if reply is not None:
                        return reply
                elif self._dropped():
                    dropped = True
                    break
            self.close()
            if dropped and self._refused(msg_type, tries):
                continue  # the same request again, the other handshake
            if not forgotten:  # else a new connection, its hello first
                self._next_try(msg_type, budget_s, tries, dropped)

    def hello(self) -> dict[str, Any]:
        """Handshake: check the protocol version; returns server info."""
        return self.request("hello", self.body_hello())

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Mapping[str, Any],
        *,
        timeout_s: float | None = DEFAULT_PUT_TIMEOUT_S,
        reservation: ShmRegion | None = None,
    ) -> dict[str, Any]:
        """Store fields of N samples (idempotent per key).

        Args:
            partition: partition name.
            keys: N unique keys.
            fields: name -> tensor [N, ...], torch.jagged nested tensor or JaggedColumn of N rows;
                or a ``TensorDict`` with ``batch_size=[N]`` (dense leaves, torch.jagged nested
                leaves, ``NonTensorStack`` / ``NonTensorData`` of msgpack values), sent as the
                same fields (tensordict_io.py).
            timeout_s: how long the server may wait for capacity (None: server default).
            reservation: a region from ``reserve``: tensors built in it are sent by reference
                (no copy), the others are copied into it. One put per reservation.

        Returns:
            ``{"written", "duplicates", "new_samples", "nbytes", "consumed"}``; ``consumed``
            counts keys the server refused because they were consumed and dropped (retention).

        Raises:
            QueueError: ``queue_full`` (retryable) after ``timeout_s``, ``bad_body``,
                ``bad_request`` for a reservation that expired or was used already, ...
            ValueError: a TensorDict whose batch is not ``[len(keys)]``, or a non-tensor leaf
                msgpack cannot carry (``NonTensorLeafError``, one line naming the key).
        """
        if is_tensordict(fields):
            fields = tensordict_to_fields(fields, keys)
        body = self.body_put(partition, keys, fields, timeout_s)
        if reservation is not None:
            return self._shm.put(self, body, timeout_s or 0.0, reservation)
        if self._shm.wants(fields):
            reply = self._shm.put(self, body, timeout_s or 0.0)
            if reply is not None:
                return reply
        return self.request("put", body, wait_s=timeout_s or 0.0)

    def reserve(self, nbytes: int, *, timeout_s: float | None = DEFAULT_PUT_TIMEOUT_S) -> ShmRegion:
        """Reserve ``nbytes`` of the server's shared-memory pool, to build a put in place.

        ``with client.reserve(n) as r: ids = r.empty((R,), torch.int64); ...;
        client.put(p, keys, {"ids": JaggedColumn(ids, offsets)}, reservation=r)``. Size it
        with ``xtoken_core.wire.shm.fields_layout_bytes`` (each buffer is 64-byte aligned). An
        unused reservation is reclaimed after the server's ``shm_reserve_ms`` (hello).

        Args:
            nbytes: bytes needed (> 0).
            timeout_s: how long the server may wait for capacity (None: server default).

        Returns:
            The region (``empty``, ``write``; its ``token`` names it in the put).

        Raises:
            QueueError: ``queue_full`` after ``timeout_s``; ``shm_unavailable`` when this client
                cannot share memory with the server (not the same host, or shm="never").
        """
        if not self._shm.pool(self):
            raise QueueError(
                codes.SHM_UNAVAILABLE,
                f"reserve needs a same-host server with a shared-memory pool and shm='auto' or "
                f"'always' (address {self.address}, shm={self._shm.mode!r}); put frames instead",
            )
        return self._shm.reserve(self, nbytes, timeout_s)

    def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        shm: bool = False,
        copy: bool = False,
        as_tensordict: bool = False,
    ) -> dict[str, Any]:
        """Read fields of samples by key; returns ``{"keys", "fields"}``.

        Args:
            partition: partition name.
            keys: keys to read.
            fields: field names (None: all).
            shm: fields stored in the server's shared-memory pool come back as views of it,
                valid until the samples are cleared (shm_transport.py); ignored unless this
                client shares memory with the server.
            copy: with ``shm``, return private copies instead of views.
            as_tensordict: ``fields`` is a ``TensorDict [len(keys)]``: jagged fields as
                torch.jagged nested tensors viewing the received buffers (no copy), non-tensor
                fields restored.
        """
        body = {
            "partition": partition,
            "keys": list(keys),
            "fields": None if fields is None else list(fields),
        }
        return self._shm_request("get", body, 0.0, shm, copy, as_tensordict)

    def _shm_request(
        self,
        msg_type: str,
        body: dict[str, Any],
        wait_s: float,
        shm: bool,
        copy: bool,
        as_tensordict: bool = False,
    ) -> dict[str, Any]:
        reply = self._fields_request(msg_type, body, wait_s, shm, copy)
        if as_tensordict:
            reply["fields"] = fields_to_tensordict(reply.get("fields") or {}, reply["keys"])
        return reply

    def _fields_request(
        self, msg_type: str, body: dict[str, Any], wait_s: float, shm: bool, copy: bool
    ) -> dict[str, Any]:
        if not (shm and self._shm.pool(self)):
            return self.request(msg_type, body, wait_s=wait_s)
        try:
            reply = self.request(
                msg_type, {**body, "shm": True}, wait_s=wait_s, shm=self._shm.reader
            )
        except QueueError as e:
            if e.code != BAD_BODY or "shm:" not in e.message:
                raise
            # The reply referenced shared memory this process cannot map (another /dev/shm).
            self._shm.give_up(f"a {msg_type} reply could not be mapped: {e.message}")
            raise QueueError(
                codes.SHM_UNAVAILABLE,
                f"{e.message}; shared memory is now off for this client: retry and the fields "
                "come as frames (a claim's samples are redelivered when its lease expires)",
                retryable=True,
                request_type=msg_type,
            ) from None
        if copy and reply.get("fields"):
            reply["fields"] = self._shm.private(reply["fields"])
        return reply

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> dict[str, Any]:
        """Remove samples (all when ``keys`` is None); returns ``{"count"}``."""
        return self.request(
            "clear", {"partition": partition, "keys": None if keys is None else list(keys)}
        )

    def list(self, partition: str | None = None) -> dict[str, Any]:
        """List partitions, or the keys and field names of one partition."""
        return self.request("list", {"partition": partition})

    def claim(
        self,
        partition: str,
        task: str,
        required_fields: Sequence[str],
        batch_size: int,
        *,
        fields: Sequence[str] | None = None,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
        lease_s: float = DEFAULT_LEASE_S,
        shm: bool = False,
        copy: bool = False,
        register: bool = False,
        as_tensordict: bool = False,
    ) -> dict[str, Any]:
        """Lease up to ``batch_size`` ready samples, waiting up to ``timeout_s`` for data.

        Args:
            partition, task, required_fields, batch_size, fields: see PROTOCOL.md ``claim``.
            timeout_s: how long the server holds the claim open for data.
            lease_s: lease length before redelivery.
            register: register ``task`` for the partition (retention, PROTOCOL.md): once
                every registered task acked a sample, the server drops it and refuses a re-put
                of its key as ``consumed``. Leave False for a partition read more than once
                (a trainer's epochs).
            shm: fields stored in the server's shared-memory pool come back as views of it
                (no bytes through the socket), valid until the samples are cleared
                (shm_transport.py); ignored unless this client shares memory with the server.
            copy: with ``shm``, return private copies instead of views.
            as_tensordict: ``fields`` is a ``TensorDict [len(keys)]`` (``[0]`` on timeout):
                jagged fields as torch.jagged nested tensors viewing the received buffers (no
                copy), non-tensor fields restored.

        Returns:
            ``{"keys", "fields", "lease_id"}``; ``keys`` is empty (lease_id None) on timeout.
        """
        body = self.body_claim(
            partition, task, required_fields, batch_size, fields, timeout_s, lease_s, register
        )
        return self._shm_request("claim", body, timeout_s, shm, copy, as_tensordict)

    def ack(
        self, partition: str, task: str, lease_id: int | str, keys: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Mark leased samples consumed; returns ``{"count"}``.

        Raises:
            StaleEpochError: the lease is of an earlier instance of the server (it restarted):
                its samples were not acked.
            QueueError: ``unknown_lease`` (expired: redelivered), ``bad_request``, ...
        """
        return self.request("ack", self.body_lease(partition, task, lease_id, keys))

    def nack(
        self, partition: str, task: str, lease_id: int | str, keys: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Give leased samples back for redelivery; returns ``{"count"}``."""
        return self.request("nack", self.body_lease(partition, task, lease_id, keys))

    def status(self, partition: str, task: str) -> dict[str, Any]:
        """Consumption status of a task: samples, consumed, leased, pending, leases."""
        return self.request("status", {"partition": partition, "task": task})

    def stats(self) -> dict[str, Any]:
        """Server stats: bytes, samples per partition, tasks, rates."""
        return self.request("stats", {})


def connect(
    address: str,
    *,
    timeout_s: float,
    name: str,
    setting: str = "queue_timeout_s",
    stopping: Any = None,
) -> QueueClient:
    """A QueueClient after a successful handshake (worker processes: teacher, trainer).

    Args:
        address: the queue's endpoint.
        timeout_s: seconds to wait for the hello's reply, and for every later reply.
        name: client name sent in ``hello``.
        setting: the key of ``timeout_s`` in the process's config (``feed.queue_timeout_s``),
            named with its flag in the message of a queue that does not answer.
        stopping: the process's stop event: once set, the client tries nothing twice
            (:class:`QueueClient`).

    Raises:
        ValueError: no reply within ``timeout_s`` (names the address and the setting; a bad
            address is a configuration error of the worker).
        QueueError: any other error reply (e.g. a protocol version mismatch).
    """
    try:
        with QueueClient(address, timeout_s=timeout_s, retries=0, name=name) as probe:
            probe.hello()
    except QueueError as e:
        if e.code != codes.TIMEOUT:
            raise
        raise ValueError(
            f"queue {address} is unreachable: no reply within {timeout_s:g}s ({setting}, "
            f"--{setting.replace('_', '-')}); start it with `xtoken queue serve --bind "
            f"{address}` or fix the address (queue, --queue)"
        ) from None
    return QueueClient(address, timeout_s=timeout_s, name=name, stopping=stopping)
