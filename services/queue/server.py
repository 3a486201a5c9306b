"""The transfer-queue process shell: a ZMQ ROUTER event loop around SampleStore.

Each start is a new **instance** with a random ``epoch`` (16 hex): every reply and error carries
it, and lease ids are ``"<epoch>:<32 random hex>"``, so a client notices a restart on its next
reply and an ack of a lease of an earlier instance is refused as ``stale_epoch`` (never a silent
success), except in durable mode when that instance logged the ack before it died: the resent
ack (its reply lost to the kill) is answered as acked, with the count it acked. A lease belongs to the client instance that claimed it (auth.py): an ack or nack from
another is ``not_owner``. With a token (``auth_token``), a connection is served only once its
hello presented it; every other request is answered ``unauthorized``. Before that, the token is
checked in the ZMTP handshake (PLAIN + the server's ZAP handler, ``gate.ConnectionGate``): a connection without
it is closed before it can send a single message, and connections past ``--max-connections``
are refused there too.

One thread, one event loop: requests are decoded and answered in arrival order; claims that find
nothing ready and puts (or shared-memory reservations) that do not fit are parked (never polled,
never slept on) and answered when data arrives, bytes are freed or their deadline passes.
``zmq.Poller`` waits until the next deadline, so a blocked client never delays another. Every
request gets exactly one reply or error with its request id; malformed input gets an error reply
and the loop goes on. Same-host producers put through the server's shared-memory pool
(shm_pool.py): ``reserve`` lends a segment, the put references it, the store keeps views of it.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from services.common.lifecycle import progress as lifecycle_progress
from services.queue import errors as codes
from services.queue.auth import MAX_INSTANCE_CHARS, TOKEN_ENV, token_matches
from services.queue.config import ServerConfig, format_size
from services.queue.durable import DurableLog, apply_record, encode_record
from services.queue.errors import StoreError
from services.queue.gate import ConnectionGate
from services.queue.oplog import OpLog
from services.queue.shm_pool import (
    PoolSegment,
    ShmPool,
    TamperedError,
    segment_bytes,
    sweep_dead_pools,
)
from services.queue.shm_transport import ORPHAN_AGE_S
from services.queue.store import SampleStore
from services.queue.transport import COPY_BELOW, recv_frames, send_frames
from xtoken_core.ipc.shm import ShmReader, sweep_orphans
from xtoken_core.wire import (
    HEADER_SIZE,
    PROTOCOL_VERSION,
    WireError,
    decode_message,
    encode_message,
    validate_body,
)
from xtoken_core.wire.header import TYPE_NAMES

if TYPE_CHECKING:
    from services.common.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

# Poll at least this often so that a stop is noticed promptly (pyzmq retries EINTR itself).
_MAX_POLL_MS = 100
# Requests handled per poll wake-up before timers are checked again.
_BATCH_RECV = 256
# Requests parked at least this long have their client probed this often: a probe to a client
# whose connection is gone fails at once (ROUTER_MANDATORY), and its parked requests are dropped.
_PROBE_S = 1.0
# Connections whose hello is remembered (zmq tells a ROUTER of no disconnect): the oldest hello
# is forgotten past this; such a connection is answered unauthorized and its client (with a
# token) says hello again on a new connection.
_MAX_HELLOS = 65536
# Durable mode: leases whose ack was logged, remembered (and kept through compactions) so that
# an ack resent after a restart (its reply lost to the kill) is answered as acked.
_MAX_ACKED_LEASES = 65536
# A spinning server is never woken, so it gets no wake-up preemption: while another runnable
# task shares its core, each request waits out that task's slice (a claim took 4.1 ms p50 instead
# of 0.3 beside a spinner, benchmarks/results/queue.md "Claim round trip"). A sched_yield() that
# returns after more than CONTENDED_YIELD_S means such a task held the core: busy polling stops
# for CONTENDED_PAUSE_S (the loop blocks in poll and is woken by the next request).
CONTENDED_YIELD_S = 0.001
CONTENDED_PAUSE_S = 1.0


class BusyPoll:
    """When the event loop polls without sleeping (``--busy-poll-us``) and when it blocks.

    After a burst of requests the loop spins for ``busy_s`` (the next request of a client in a
    loop usually comes within it, and a spinning process answers it without a wake-up), yielding
    the core at every turn; a yield that took longer than ``CONTENDED_YIELD_S`` pauses spinning
    for ``CONTENDED_PAUSE_S``. No sockets: ``clock`` and ``yield_`` are arguments (tests pass
    fakes), the loop passes ``time.monotonic`` and ``os.sched_yield``.

    Args:
        busy_s: seconds to spin after requests were handled; 0 never spins.
        clock: monotonic seconds.
        yield_: gives the core to other runnable tasks (``sched_yield``).
    """

    def __init__(
        self,
        busy_s: float,
        clock: Callable[[], float] = time.monotonic,
        yield_: Callable[[], Any] = getattr(os, "sched_yield", lambda: None),
    ) -> None:
        self.busy_s = busy_s
        self.spin_until = 0.0
        self.paused_until = 0.0
        self.pauses = 0  # times a slow yield paused spinning
        self._clock = clock
        self._yield = yield_

    def handled(self) -> None:
        """Requests were handled: spin for ``busy_s`` from now, unless paused."""
        now = self._clock()
        self.spin_until = now + self.busy_s if now >= self.paused_until else 0.0

    def spin(self, ready: Callable[[], Any]) -> bool:
        """Call ``ready`` (a zero-timeout poll) until it is true or the spin window ends.

        Returns:
            True once ``ready()`` was true; False when the window ended or a slow yield paused
            spinning (then block in poll).
        """
        clock, yield_ = self._clock, self._yield
        while clock() < self.spin_until:
            if ready():
                return True
            start = clock()
            yield_()  # the zmq IO threads and clients on this core go first
            now = clock()
            if now - start > CONTENDED_YIELD_S:
                self.paused_until = now + CONTENDED_PAUSE_S
                self.spin_until = 0.0
                self.pauses += 1
                return False
        return False


@dataclass
class _Parked:
    kind: str  # "claim", "put" or "reserve"
    ident: bytes
    request_id: int
    body: dict[str, Any]
    deadline: float
    frames: Any = None  # keeps a parked put's received buffers alive
    done: bool = False
    segment: PoolSegment | None = None  # a parked put's staged shared-memory segment
    since: float = field(default_factory=time.monotonic)

    def finish(self) -> None:
        """Answered or dropped: let go of the request's buffers at once (its body's tensors view
        the received frames; a timer entry may outlive the request until its deadline)."""
        self.done = True
        self.frames = None
        self.body = {}


class QueueServer:
    """ROUTER socket + SampleStore + parked requests.

    Args:
        config: the server settings.
        context: a zmq Context (a new one by default).
    """

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.epoch = secrets.token_hex(8)  # this instance: samples and leases live and die with it
        self.pool = ShmPool(
            config.shm_pool_free_bytes,
            config.shm_reserve_s,
            idle_s=config.pool_idle_s,
            instance=self.epoch,
            verify=config.shm_verify,
        )
        self.store = SampleStore(
            config.capacity_bytes,
            held=lambda: self.pool.held_bytes,
            trim=self.pool.trim,
            on_release=lambda ptr: self.pool.release(ptr, self._send_seq),
            tombstone_max_keys=config.tombstone_max_keys,
            check=self.pool.check if config.shm_verify else None,
        )
        # Zero-copy replies still owned by zmq: a released pool segment is not written again
        # before those sent before its release are gone (shm_pool.py).
        self._send_seq = 0
        self._trackers: collections.deque[tuple[int, zmq.MessageTracker]] = collections.deque()
        self._refs: list[tuple[str, int, int]] = []
        # A context of its own: the ZAP endpoint (ConnectionGate) is one per context.
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock: zmq.Socket | None = None
        self._gate: ConnectionGate | None = None
        self._stop = threading.Event()
        self._parked_claims: dict[str, collections.deque[_Parked]] = collections.defaultdict(
            collections.deque
        )
        self._parked_puts: collections.deque[_Parked] = collections.deque()
        self._timers: list[tuple[float, int, _Parked]] = []
        self._seq = itertools.count()
        self.endpoint = ""
        self.requests = 0
        self._next_probe = 0.0
        self.dropped_parked = 0  # parked requests of clients found gone
        # Connections that said hello (and presented the token, if there is one): routing id
        # -> the owner their leases are bound to ("i:" + the client's instance id).
        self._owners: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        # and how their hellos named them, for messages ("client 'NAME' (instance 1a2b...)")
        self._names: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.refused = 0  # requests answered unauthorized
        self.oplog = OpLog(config.log_every_s)
        self.busy_poll = BusyPoll(config.busy_poll_us / 1e6)
        # Durable mode: the log, replies waiting for their record to be written, what the last
        # recovery read.
        self.log: DurableLog | None = None
        self._deferred: collections.deque[tuple[int, bool, bytes, int, dict]] = collections.deque()
        self._compacting = -1  # log.compactions when a compaction was asked for
        self.recovery: dict[str, Any] | None = None
        self._log_seq = 0  # the log record of the change being answered
        # lease id ("<epoch>:<hex>") -> samples acked, of the leases whose ack was logged
        self._acked: collections.OrderedDict[str, int] = collections.OrderedDict()
        if config.data_dir:
            self.log = DurableLog(
                config.data_dir,
                fsync=config.fsync,
                fsync_interval_s=config.fsync_interval_s,
                salvage=config.salvage,
            )
        self._handlers = {
            "hello": self._on_hello,
            "put": self._on_put,
            "get": self._on_get,
            "clear": self._on_clear,
            "list": self._on_list,
            "claim": self._on_claim,
            "ack": self._on_ack,
            "nack": self._on_nack,
            "status": self._on_status,
            "stats": self._on_stats,
            "reserve": self._on_reserve,
        }

    # ---------------------------------------------------------------- lifecycle

    def recover(self) -> dict[str, Any] | None:
        """Durable mode: lock ``data_dir``, rebuild the store from its log and start the log
        writer process (``bind`` calls it first). Returns what was recovered, None in memory
        mode.

        Raises:
            ValueError: another server (or its log writer) holds the directory's lock.
        """
        if self.log is None or self.recovery is not None:
            return self.recovery
        t0 = time.perf_counter()
        replay = self.log.replay(self._apply_record)
        self.log.start()
        stats = self.store.stats()
        self.recovery = {
            "records": replay.records,
            "log_bytes": replay.nbytes,
            "truncated_bytes": replay.truncated,
            "salvaged_bytes": replay.salvaged,
            "samples": stats["samples"],
            "bytes": stats["bytes_used"],
            "seconds": time.perf_counter() - t0,
        }
        logger.info(
            "[queue] recovered %d samples (%d bytes) from %d records of %s in %.3fs%s",
            stats["samples"],
            stats["bytes_used"],
            replay.records,
            self.log.data_dir,
            self.recovery["seconds"],
            f" ({replay.truncated} torn bytes cut off)" if replay.truncated else "",
        )
        return self.recovery

    def _apply_record(self, body: dict[str, Any]) -> None:
        """Replay one log record: into the store, and the leases whose ack it logged."""
        op = body.get("op")
        if op == "ack" and isinstance(body.get("lease"), str):
            self._remember_ack(body["lease"], len(body["keys"]))
        elif op == "acked_leases":
            for lease, count in zip(body["leases"], body["counts"]):
                self._remember_ack(lease, count)
        apply_record(self.store, body)

    def _remember_ack(self, lease: str, count: int) -> None:
        self._acked[lease] = self._acked.get(lease, 0) + int(count)
        self._acked.move_to_end(lease)
        if len(self._acked) > _MAX_ACKED_LEASES:
            self._acked.popitem(last=False)

    def bind(self) -> str:
        """Create and bind the ROUTER socket; returns the bound endpoint."""
        self.recover()
        sock = self._ctx.socket(zmq.ROUTER)
        # A send to a client whose connection is gone raises EHOSTUNREACH (caught in _send):
        # how the server learns that a parked request's client died and a lease went nowhere.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.config.heartbeat_s > 0:
            ivl_ms = max(1, int(self.config.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        # zmq drops peers above MAXMSGSIZE without a reply; keep it above the wire limit so that
        # an oversize message is decoded far enough to get a "too_large" error reply.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes + (1 << 20))
        if self._gate is not None:  # an earlier bind that failed
            self._gate.close()
        self._gate = ConnectionGate(
            self._ctx, sock, self.config.auth_token, self.config.max_connections, self.oplog
        )
        sock.bind(self.config.bind)
        self._sock = sock
        # pool segments of servers that died (their lock files are free: SIGKILL, whatever
        # their pid), then producers' segments that never left (by pid and age)
        sweep_dead_pools()
        sweep_orphans(min_age_s=ORPHAN_AGE_S)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info(
            "[queue] listening on %s (capacity %s, protocol v%d, instance %s, %s)",
            self.endpoint,
            format_size(self.config.capacity_bytes),
            PROTOCOL_VERSION,
            self.epoch,
            "token required" if self.config.auth_token is not None else "no authentication",
        )
        return self.endpoint

    def stop(self) -> None:
        """Ask the loop to stop (takes effect within ~0.1 s)."""
        self._stop.set()

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Run the event loop until ``stop()`` (or the given event is set); then answer what is
        left with ``shutting_down`` errors and close the socket.

        Args:
            stop: an event that ends the loop when set (the process lifecycle's), in place of
                the server's own.
        """
        if stop is not None:
            self._stop = stop
        if self._sock is None:
            self.bind()
        try:
            self._loop(self._sock)
        finally:
            self.pool.close()
            if self.log is not None:
                self.log.close()
            if self._gate is not None:
                self._gate.close()
            if self._own_ctx:
                self._ctx.destroy(linger=0)

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        gate = self._gate
        for pollable in gate.pollables():  # handshakes: ZAP requests, connections
            poller.register(pollable, zmq.POLLIN)
        if self.log is not None:  # the writer's reports, and its death
            for pollable in self.log.pollables():
                poller.register(pollable, zmq.POLLIN)
        busy = self.busy_poll
        poll_now = functools.partial(poller.poll, 0)
        stop = self._stop
        while not stop.is_set():
            if busy.spin(poll_now) or poller.poll(self._poll_timeout_ms()):
                for _ in range(_BATCH_RECV):
                    try:
                        frames = recv_frames(sock, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
                    if not poller.poll(0):  # cheaper than the zmq.Again of an empty recv
                        break
                gate.service()
                busy.handled()
            if self.log is not None:
                self._log_progress()
            self._run_timers()
            # at least every _MAX_POLL_MS, idle or not: a loop that stops moving is a hung server
            lifecycle_progress()
        self._shutdown(sock)

    def _shutdown(self, sock: zmq.Socket) -> None:
        message = "the queue server is shutting down; retry against its replacement"
        n = 0
        while True:  # requests already received by the socket
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) >= 2:
                rid, rtype = _peek_header(frames[1])
                self._send_error(frames[0], rid, codes.SHUTTING_DOWN, message, True, rtype)
                n += 1
        for parked in self._all_parked():
            self._send_error(
                parked.ident, parked.request_id, codes.SHUTTING_DOWN, message, True, parked.kind
            )
            n += 1
        if self.log is not None:  # answer what waited for the log once it is all written
            self.log.close()
            while self._deferred and self.log.durable(self._deferred[0][0], self._deferred[0][1]):
                _, _, ident, rid, reply = self._deferred.popleft()
                self._send_reply(ident, rid, reply)
        self._parked_claims.clear()
        self._parked_puts.clear()
        self._timers.clear()
        sock.close(linger=1000)  # flush the error replies
        self._sock = None
        logger.info(
            "[queue] stopped after %d requests (%d answered shutting_down)", self.requests, n
        )

    # ---------------------------------------------------------------- requests

    def _on_frames(self, frames: list[Any]) -> None:
        ident = frames[0]
        self.requests += 1
        if len(frames) < 2:
            self._send_error(
                ident, 0, "bad_frames", "empty message: needs a header and a body", False, None
            )
            return
        rid, rtype = _peek_header(frames[1])
        if self.config.auth_token is not None and rtype != "hello" and ident not in self._owners:
            # before decoding: an unauthenticated peer gets no work done but this reply
            self.refused += 1
            self._send_error(
                ident,
                rid,
                codes.UNAUTHORIZED,
                "this queue requires a token and this connection has not presented it in a "
                f"hello (or presented a wrong one): set {TOKEN_ENV} (or XTOKEN_QUEUE_TOKEN_FILE) "
                "to the token the server reads from --auth-token-file, or QueueClient(token=...)",
                False,
                rtype,
            )
            return
        # Same-host clients may send tensors as references into the server's pool, resolved
        # against its own mapping and checked against the put's reservation in _on_put. Any
        # other segment (a producer's own, another server's, the probe) is refused before a
        # file is opened: adopting it would unlink or store bytes that someone else can change.
        # Bad references are bad_body starting "shm:" (xtoken_core/wire/shm.py).
        reader = ShmReader(segments=self.pool.views, known_only=True, unlink=False)
        self._refs = reader.refs
        try:
            msg = decode_message(frames[1:], limits=self.config.limits, jagged="column", shm=reader)
            validate_body(msg.msg_type, msg.body)
        except WireError as e:
            self._send_error(ident, rid, e.code, e.message, e.retryable, rtype)
            return
        try:
            handler = self._handlers.get(msg.msg_type)
            if handler is None:
                raise StoreError(
                    codes.BAD_REQUEST, f"{msg.msg_type!r} is not a request type the queue accepts"
                )
            reply = handler(ident, msg.request_id, msg.body, frames)
        except StoreError as e:
            self._send_error(ident, rid, e.code, str(e), e.retryable, msg.msg_type)
            return
        except Exception as e:  # a bug: log it, answer, keep serving
            logger.exception("[queue] internal error on %s", msg.msg_type)
            self._send_error(
                ident, rid, codes.INTERNAL, f"{type(e).__name__}: {e}", False, msg.msg_type
            )
            return
        if reply is not None and not self._send_reply(ident, msg.request_id, reply):
            if reply.get("lease_id") is not None:  # the claim's samples went nowhere
                self._wake_claims(msg.body["partition"])

    def _on_hello(self, ident, rid, body, frames):
        if body["protocol_version"] != PROTOCOL_VERSION:
            raise StoreError(
                "bad_version",
                f"client speaks protocol {body['protocol_version']}, "
                f"this server {PROTOCOL_VERSION}; upgrade the older side",
            )
        token = self.config.auth_token
        if token is not None and not token_matches(token, body.get("token")):
            self._owners.pop(ident, None)
            self.refused += 1
            given = "presented no token" if body.get("token") is None else "token does not match"
            raise StoreError(
                codes.UNAUTHORIZED,
                f"hello of {body['client']!r}: this queue requires a token and the client "
                f"{given} the server's (--auth-token-file); set {TOKEN_ENV} or "
                "XTOKEN_QUEUE_TOKEN_FILE for the client, or QueueClient(token=...)",
            )
        instance = body.get("instance")
        if not isinstance(instance, str) or not 0 < len(instance) <= MAX_INSTANCE_CHARS:
            instance = None  # an older client: its leases are bound to this connection
        self._owners[ident] = "i:" + instance if instance else _conn_owner(ident)
        self._owners.move_to_end(ident)
        if len(self._owners) > _MAX_HELLOS:
            self._owners.popitem(last=False)
        self._names[ident] = f"client {body['client']!r}" + (
            f" (instance {instance[:12]}...)" if instance else ""
        )
        self._names.move_to_end(ident)
        if len(self._names) > _MAX_HELLOS:
            self._names.popitem(last=False)
        self.oplog.connect(body["client"])
        return {
            "server": "xtoken-queue",
            "protocol_version": PROTOCOL_VERSION,
            "capacity_bytes": self.store.capacity_bytes,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "shm": False,  # adopts no producer-created segment: puts go through the pool
            # answers reserve; put.reservation; claim/get shm. Not in durable mode: a pool
            # segment is recycled once cleared, while the log writer may still read it.
            "shm_pool": self.log is None,
            "shm_reserve_ms": int(self.config.shm_reserve_s * 1000),
            "shm_reserve_max_bytes": self.config.shm_reserve_max_bytes,  # larger puts: frames
            "shm_probe": self.pool.probe(),  # {name, nonce}: proves a client shares /dev/shm
            "retention": True,  # claim.register; put replies count "consumed" keys
            "epoch": self.epoch,
            "durable": self.log is not None,  # --data-dir: consumption state survives restarts
            "auth": token is not None,  # hellos must present the token
            "lease_owner": "instance" if instance else "connection",
        }

    def _on_put(self, ident, rid, body, frames):
        timeout_s = self._wait_s(body, "put")
        seg = None
        token = body.get("reservation")
        if token is not None:
            seg, done = self.pool.stage(token, rid)
            if done is not None:
                return done  # a retry of a put that was stored: the same reply again
        try:
            self.pool.check_refs(seg, self._refs)
            result = self._store_put(body, seg, rid, frames)
        except BaseException:
            if seg is not None:
                self.pool.unstage(seg)
            raise
        if not result.blocked:
            self._wake_claims(body["partition"])
            return self._after_log(ident, rid, _put_reply(result), put=True)
        if timeout_s <= 0:
            if seg is not None:
                self.pool.unstage(seg)
            raise self._full_error(result.nbytes)
        parked = _Parked("put", ident, rid, body, time.monotonic() + timeout_s, frames)
        parked.segment = seg
        self._park(parked)
        return None

    def _store_put(
        self, body: dict[str, Any], seg: PoolSegment | None, rid: int, frames: Any = None
    ) -> Any:
        """store.put, with a staged pool segment's bytes counted once; a stored put hands the
        segment's bytes from the pool to the store."""
        prepaid = seg.size if seg is not None else 0
        result = self.store.put(body["partition"], body["keys"], body["fields"], prepaid=prepaid)
        if self.log is not None and result.stored:
            # the whole put: a replay stores the same cells (duplicates and consumed keys are
            # refused again), and the record keeps the received buffers until written
            waited = (
                self.config.fsync == "always" or self.log.pending_bytes > self.config.log_lag_bytes
            )
            if frames is not None:  # the request as received: no second encoding
                self._log_seq = self.log.append_frames(frames[1:], urgent=waited)
            else:
                record = {k: body[k] for k in ("partition", "keys", "fields")}
                self._log_seq = self.log.append("put", record, urgent=waited)
        if seg is not None and not result.blocked:
            self.pool.stored(
                seg, self.store.holds_storage(seg.ptr, seg.size), rid, _put_reply(result)
            )
        return result

    def _on_reserve(self, ident, rid, body, frames):
        if self.log is not None:
            raise StoreError(
                codes.SHM_UNAVAILABLE,
                "this queue is durable (--data-dir) and lends no shared memory (hello "
                "shm_pool: false); send the put as frames",
            )
        nbytes = body["nbytes"]
        if nbytes > self.store.capacity_bytes:
            raise StoreError(
                codes.QUEUE_FULL,
                f"reserve of {nbytes} bytes is larger than the whole queue capacity "
                f"({self.store.capacity_bytes} bytes); split the put or raise --capacity",
            )
        timeout_s = self._wait_s(body, "reserve")
        self._check_reserve_quota(ident, nbytes)
        reply = self._try_reserve(nbytes, self._quota_owner(ident))
        if reply is not None:
            return reply
        if timeout_s <= 0:
            raise self._full_error(nbytes)
        self._park(_Parked("reserve", ident, rid, body, time.monotonic() + timeout_s))
        return None

    def _quota_owner(self, ident: bytes) -> bytes:
        """Whom a connection's reservations count against: the identity it authenticated as.

        The queue knows one credential, its token (none without one), so every client shares
        one ``--shm-reserve-max``. A client's instance id is its own choice and proves nothing:
        counting per instance let a process that named a fresh one on each connection hold the
        whole capacity in reservations.
        """
        return b"token" if self.config.auth_token is not None else b"anonymous"

    def _check_reserve_quota(self, ident: bytes, nbytes: int) -> None:
        """Refuse a reserve past ``shm_reserve_max_bytes`` of reserved-not-put bytes, at once.

        Checked before any segment is made: reservations must not hold a large share of the
        capacity (a reserve commits no memory, but its bytes count against the capacity). A
        reserve that would pass the bound with the reservations already held is ``shm_busy``
        (retryable; a ``QueueClient`` then sends that put as frames), so a put is never kept
        waiting by reservations, whoever holds them.
        """
        limit = self.config.shm_reserve_max_bytes
        size = segment_bytes(nbytes)
        who = self._names.get(ident) or f"connection {ident.hex()[:12]}"
        if size > limit:
            raise StoreError(
                codes.BAD_REQUEST,
                f"reserve of {format_size(nbytes)} ({format_size(size)} as a segment) by {who} "
                f"is more than may be held reserved: --shm-reserve-max is "
                f"{format_size(limit)} (queue serve; a quarter of --capacity by default); send "
                "the put as frames, split it, or raise --shm-reserve-max",
            )
        held = self.pool.client_bytes(self._quota_owner(ident))
        if held + size > limit:
            raise StoreError(
                codes.SHM_BUSY,
                f"reserve of {format_size(nbytes)} by {who}: reservations not yet put hold "
                f"{format_size(held)} of --shm-reserve-max = {format_size(limit)} (all clients "
                "of this queue together); send this put as frames (QueueClient does), or put "
                "into those reservations or let them lapse (--shm-reserve-timeout-s) first, "
                "or raise --shm-reserve-max",
                retryable=True,
            )

    def _try_reserve(self, nbytes: int, owner: bytes) -> dict[str, Any] | None:
        try:
            seg = self.pool.reserve(nbytes, self.store.room(), self._segment_ready, owner)
        except OSError as e:
            raise StoreError(
                codes.SHM_UNAVAILABLE,
                f"the server cannot create a shared-memory segment of {nbytes} bytes: {e} "
                "(is /dev/shm full or too small? raise its size, e.g. docker --shm-size); "
                "send the put as frames",
            ) from None
        if seg is None:
            return None
        return {
            "name": seg.name,
            "size": seg.size,
            "offset": 0,
            "nbytes": seg.size,
            "token": seg.token,
            "expires_ms": int(self.config.shm_reserve_s * 1000),
        }

    def _segment_ready(self, seg: PoolSegment) -> bool:
        """Whether every zero-copy reply sent before ``seg`` was released has left zmq."""
        trackers = self._trackers
        while trackers and trackers[0][1].done:
            trackers.popleft()
        return not any(seq <= seg.released_seq and not t.done for seq, t in trackers)

    def _shm_locate(self, tensor: Any) -> tuple[str, int, int] | None:
        seg = self.pool.locate(tensor)
        return None if seg is None else (seg.name, seg.size, seg.ptr)

    def _read(self, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A store read (get, claim). A pool segment whose bytes changed after its put is not
        read: its samples are dropped and the request answered ``corrupt`` (retryable)."""
        try:
            return read(*args, **kwargs)
        except TamperedError as e:
            raise self._drop_tampered(e) from None

    def _drop_tampered(self, error: TamperedError) -> StoreError:
        """Drop the samples stored in a segment another process wrote into; the error to answer."""
        self.pool.condemn(error.ptr)  # unlinked once its samples are gone, never lent again
        dropped = self.store.keys_viewing(error.ptr)
        for partition, keys in dropped.items():
            self.store.clear(partition, keys)
        n = sum(len(keys) for keys in dropped.values())
        where = ", ".join(f"{len(k)} of partition {p!r}" for p, k in dropped.items())
        logger.warning(
            "[queue] dropped %d samples (%s): their bytes in shared-memory segment %s changed "
            "after their put (another process wrote into it); producers must put them again",
            n,
            where or "none left",
            error.name,
        )
        return StoreError(codes.CORRUPT, f"{error} ({n} samples dropped: {where})", retryable=True)

    def _on_get(self, ident, rid, body, frames):
        batch = self._read(
            self.store.get,
            body["partition"],
            body["keys"],
            body.get("fields"),
            wire=True,
            shm=self._shm_locate if body.get("shm") else None,
        )
        return {"keys": batch.keys, "fields": batch.fields}

    def _on_clear(self, ident, rid, body, frames):
        count = self.store.clear(body["partition"], body.get("keys"))
        self._wake_puts()
        if self.log is not None and (count or body.get("keys") is None):
            self._log_seq = self.log.append(
                "clear", {"partition": body["partition"], "keys": body.get("keys")}
            )
        return self._after_log(ident, rid, {"count": count})

    def _on_list(self, ident, rid, body, frames):
        return self.store.list(body.get("partition"))

    def _wait_s(self, body: dict[str, Any], kind: str) -> float:
        """The seconds a request may be parked: its ``timeout_ms`` (at most the server's bound)
        or the server default."""
        cfg = self.config
        claim = kind == "claim"
        timeout_ms = body.get("timeout_ms")
        if timeout_ms is None:
            return cfg.claim_timeout_s if claim else cfg.put_timeout_s
        bound_s = cfg.max_claim_wait_s if claim else cfg.max_put_wait_s
        if timeout_ms > bound_s * 1000:
            flag = "--max-claim-wait-s" if claim else "--max-put-wait-s"
            # the user set the wait as a flag or run setting: name those, not the wire field
            wait = (
                "the client's claim timeout (trainer claim_timeout_s)"
                if claim
                else "the client's put timeout (collator --put-timeout-s)"
            )
            raise StoreError(
                codes.BAD_REQUEST,
                f"a {kind} wait of {timeout_ms / 1000:g}s is above this server's bound of "
                f"{bound_s:g}s (queue serve {flag}); lower {wait} or raise {flag}",
            )
        return timeout_ms / 1000

    def _owner(self, ident: bytes) -> str:
        """Who a request's leases belong to: the instance its connection's hello named."""
        return self._owners.get(ident) or _conn_owner(ident)

    def _on_claim(self, ident, rid, body, frames):
        timeout_s = self._wait_s(body, "claim")
        lease_ms = body.get("lease_ms")
        if lease_ms is not None and lease_ms > self.config.max_lease_s * 1000:
            raise StoreError(
                codes.BAD_REQUEST,
                f"a lease of {lease_ms / 1000:g}s is above this server's bound of "
                f"{self.config.max_lease_s:g}s (queue serve --max-lease-s): lower the claimer's "
                "lease (trainer lease_s, or the lease_s of its claim calls) or raise --max-lease-s",
            )
        batch = self._try_claim(body, ident)
        if batch is not None:
            return batch
        if timeout_s <= 0:
            return {"keys": [], "fields": {}, "lease_id": None}
        self._park(_Parked("claim", ident, rid, body, time.monotonic() + timeout_s))
        return None

    def _on_ack(self, ident, rid, body, frames):
        used = self.store.bytes_used
        text = str(body["lease_id"])
        keys = body.get("keys")
        if text in self._acked and not text.startswith(self.epoch + ":"):
            # an earlier instance logged this ack, then died before (or while) answering it
            count = self._acked[text]
            if keys is not None:
                count = self.store.consumed_count(body["partition"], body["task"], keys)
            return {"count": count}
        lease_id = self._lease_id(body["lease_id"])
        if self.log is not None and keys is None:
            keys = self.store.lease_keys(lease_id)
        count = self.store.ack(body["partition"], body["task"], lease_id, keys, self._owner(ident))
        if self.store.bytes_used < used:
            self._wake_puts()  # retention dropped what every registered task consumed
        if self.log is not None and count:
            self._remember_ack(text, count)
            record = {"partition": body["partition"], "task": body["task"], "keys": keys}
            self._log_seq = self.log.append("ack", {**record, "lease": text})
        return self._after_log(ident, rid, {"count": count})

    def _on_nack(self, ident, rid, body, frames):
        count = self.store.nack(
            body["partition"],
            body["task"],
            self._lease_id(body["lease_id"]),
            body.get("keys"),
            self._owner(ident),
        )
        self._wake_claims(body["partition"])
        return {"count": count}

    def _on_status(self, ident, rid, body, frames):
        return self.store.status(body["partition"], body["task"])

    def _on_stats(self, ident, rid, body, frames):
        stats = self.store.stats()
        stats["parked_claims"] = sum(
            1 for q in self._parked_claims.values() for p in q if not p.done
        )
        stats["parked_puts"] = sum(1 for p in self._parked_puts if not p.done)
        stats["parked_dropped"] = self.dropped_parked  # of clients found gone
        stats["requests"] = self.requests
        stats["unauthorized"] = self.refused
        if self._gate is not None:
            stats["connections"] = self._gate.stats()
        stats["shm_pool"] = self.pool.stats()
        return stats

    # ---------------------------------------------------------------- parking

    def _try_claim(self, body: dict[str, Any], ident: bytes) -> dict[str, Any] | None:
        if (
            self.log is not None
            and body.get("register")
            and not self.store.is_registered(body["partition"], body["task"])
        ):
            self.store.register(body["partition"], body["task"])
            # not waited for: a consumer that registers asks again after a restart
            self.log.append(
                "register", {"partition": body["partition"], "task": body["task"]}, urgent=False
            )
        lease_ms = body.get("lease_ms")
        lease_s = self.config.lease_s if lease_ms is None else lease_ms / 1000
        batch = self._read(
            self.store.claim,
            body["partition"],
            body["task"],
            body["required_fields"],
            body["batch_size"],
            lease_s,
            body.get("fields"),
            wire=True,
            shm=self._shm_locate if body.get("shm") else None,
            register=bool(body.get("register")),
            owner=self._owner(ident),
        )
        if batch is None:
            return None
        lease_id = f"{self.epoch}:{batch.lease_id}"
        return {"keys": batch.keys, "fields": batch.fields, "lease_id": lease_id}

    def _lease_id(self, value: int | str) -> str:
        """The store's lease key of a lease id: ``"<epoch>:<32 hex>"`` of this instance."""
        text = str(value)
        epoch, sep, number = text.rpartition(":")
        if sep and epoch != self.epoch:
            lost = (
                "the lease (a durable server keeps samples and acks, never leases: its unacked "
                "samples are claimable again)"
                if self.log is not None
                else "that lease and its samples (memory only)"
            )
            raise StoreError(
                codes.STALE_EPOCH,
                f"lease {text} was issued by queue instance {epoch}, this is instance "
                f"{self.epoch}: the server restarted and lost {lost}; drop the lease, do not "
                "count its samples as acked, and claim again",
            )
        if not sep:
            raise StoreError(
                codes.UNKNOWN_LEASE, f"lease_id={value!r} is not a lease id this server issued"
            )
        return number

    def _after_log(
        self, ident: bytes, rid: int, reply: dict[str, Any], put: bool = False
    ) -> dict[str, Any] | None:
        """The reply now, or None when it must wait for the log (then it is sent once the
        change it reports is written, or fsynced with ``--fsync always``).

        In memory mode, and for puts while the log lags by less than ``--log-lag`` (the
        producer re-puts what a crash lost, as after a restart in memory mode), at once."""
        log = self.log
        if log is None or self._log_seq <= log.written and log.fsync != "always":
            return reply
        synced = log.fsync == "always"
        if put and not synced and log.pending_bytes <= self.config.log_lag_bytes:
            return reply
        self._deferred.append((self._log_seq, synced, ident, rid, reply))
        return None

    def _log_progress(self) -> None:
        """Send the replies whose records are written; compact a log grown past its bound."""
        log = self.log
        log.poll()
        if log.error is not None:
            raise RuntimeError(f"the queue log in {log.data_dir} failed: {log.error}")
        deferred = self._deferred
        while deferred and log.durable(deferred[0][0], deferred[0][1]):
            _, _, ident, rid, reply = deferred.popleft()
            self._send_reply(ident, rid, reply)
        if (
            self._compacting != log.compactions
            and log.file_bytes > max(self.config.compact_min_bytes, 2 * self.store.bytes_used)
            and log.pending_bytes <= self.config.log_lag_bytes
        ):
            self._compacting = log.compactions
            snapshot = [encode_record(op, body) for op, body in self.store.export_state()]
            if self._acked:
                acked = {"leases": list(self._acked), "counts": list(self._acked.values())}
                snapshot.append(encode_record("acked_leases", acked))
            self._log_seq = log.compact(snapshot)
            logger.info(
                "[queue] log compaction %d: %d bytes of log -> a snapshot of %d bytes stored",
                log.compactions + 1,
                log.file_bytes,
                self.store.bytes_used,
            )

    def _park(self, parked: _Parked) -> None:
        if parked.kind == "claim":
            self._parked_claims[parked.body["partition"]].append(parked)
        else:
            self._parked_puts.append(parked)
        heapq.heappush(self._timers, (parked.deadline, next(self._seq), parked))

    def _wake_claims(self, partition: str) -> None:
        """Retry the parked claims of a partition in arrival order; keep those still empty."""
        queue = self._parked_claims.pop(partition, None)
        if not queue:
            return
        keep: collections.deque[_Parked] = collections.deque()
        for parked in queue:
            if parked.done:
                continue
            try:
                reply = self._try_claim(parked.body, parked.ident)
            except StoreError as e:
                parked.finish()
                self._send_error(
                    parked.ident, parked.request_id, e.code, str(e), e.retryable, "claim"
                )
                continue
            if reply is None:
                keep.append(parked)
            else:
                parked.finish()
                # undeliverable: the lease was given back and the next parked claim takes it
                self._send_reply(parked.ident, parked.request_id, reply)
        if keep:
            self._parked_claims[partition] = keep

    def _wake_puts(self) -> None:
        """Retry parked puts in arrival order (first-come first-served for the freed bytes)."""
        woken: set[str] = set()
        while self._parked_puts:
            parked = self._parked_puts[0]
            if parked.done:
                self._parked_puts.popleft()
                continue
            body = parked.body
            try:
                if parked.kind == "reserve":
                    self._check_reserve_quota(parked.ident, body["nbytes"])
                    reply = self._try_reserve(body["nbytes"], self._quota_owner(parked.ident))
                    if reply is None:
                        break
                else:
                    result = self._store_put(body, parked.segment, parked.request_id, parked.frames)
                    if result.blocked:
                        break
                    reply = self._after_log(
                        parked.ident, parked.request_id, _put_reply(result), put=True
                    )
                    woken.add(body["partition"])
            except StoreError as e:
                self._parked_puts.popleft()
                parked.finish()
                if parked.segment is not None:
                    self.pool.unstage(parked.segment)
                self._send_error(
                    parked.ident, parked.request_id, e.code, str(e), e.retryable, parked.kind
                )
                continue
            self._parked_puts.popleft()
            parked.finish()
            if reply is not None:
                self._send_reply(parked.ident, parked.request_id, reply)
        for partition in woken:
            self._wake_claims(partition)

    def _poll_timeout_ms(self) -> int:
        deadlines = [time.monotonic() + _MAX_POLL_MS / 1000]
        while self._timers and self._timers[0][2].done:
            heapq.heappop(self._timers)
        if self._timers:
            deadlines.append(self._timers[0][0])
        lease = self.store.next_lease_deadline()
        if lease is not None:
            deadlines.append(lease)
        reservation = self.pool.next_deadline()
        if reservation is not None:
            deadlines.append(reservation)
        return max(0, int((min(deadlines) - time.monotonic()) * 1000 + 0.999))

    def _run_timers(self) -> None:
        now = time.monotonic()
        if self.oplog.due(now):
            self.oplog.stats(self._on_stats(None, 0, {}, []), now)
        self._probe_parked(now)
        for partition in self.store.expire_leases(now):
            self._wake_claims(partition)
        held = self.pool.held_bytes
        self.pool.expire(now)
        if self.pool.held_bytes < held:
            self._wake_puts()  # retired segments were unlinked: room for parked puts
        expired_puts = False
        while self._timers and (self._timers[0][2].done or self._timers[0][0] <= now):
            _, _, parked = heapq.heappop(self._timers)
            if parked.done:
                continue
            parked.finish()
            expired_puts = expired_puts or parked.kind != "claim"
            if parked.kind == "claim":
                self._send_reply(
                    parked.ident, parked.request_id, {"keys": [], "fields": {}, "lease_id": None}
                )
            else:
                if parked.segment is not None:
                    self.pool.unstage(parked.segment)
                err = self._full_error(0)
                self._send_error(
                    parked.ident, parked.request_id, err.code, str(err), True, parked.kind
                )
        if expired_puts:
            # refused puts leave the queue now, not at the next clear
            self._parked_puts = collections.deque(p for p in self._parked_puts if not p.done)

    def _all_parked(self) -> list[_Parked]:
        out = [p for q in self._parked_claims.values() for p in q if not p.done]
        return out + [p for p in self._parked_puts if not p.done]

    def _full_error(self, nbytes: int) -> StoreError:
        used, cap = self.store.bytes_used, self.store.capacity_bytes
        need = f"{format_size(nbytes)} more" if nbytes else "more bytes"
        return StoreError(
            codes.QUEUE_FULL,
            f"queue is full ({format_size(used)} of {format_size(cap)} used) and the put needs "
            f"{need}; consumers must ack or clear samples, or raise the server's --capacity or "
            "the client's put timeout (collator --put-timeout-s)",
            retryable=True,
        )

    # ---------------------------------------------------------------- sending

    def _send_reply(self, ident: bytes, request_id: int, body: dict[str, Any]) -> bool:
        """Send a reply; False when it could not be sent (then a claim's lease is given back
        at once, instead of holding its samples for a lease period)."""
        body["epoch"] = self.epoch
        try:
            frames = encode_message("reply", body, request_id=request_id, limits=self.config.limits)
        except (WireError, TypeError) as e:
            logger.exception("[queue] cannot encode a reply")
            code = e.code if isinstance(e, WireError) else codes.INTERNAL
            self._send_error(ident, request_id, code, f"reply cannot be encoded: {e}", False, None)
            return True
        if self._send([ident, *frames]):
            return True
        lease_id = body.get("lease_id")
        if lease_id is not None:
            self.store.release_lease(self._lease_id(lease_id))
            logger.info(
                "[queue] claim reply of %d samples undeliverable: lease %s given back",
                len(body.get("keys", ())),
                lease_id,
            )
        return False

    def _send_error(
        self,
        ident: bytes,
        request_id: int,
        code: str,
        message: str,
        retryable: bool,
        request_type: str | None,
    ) -> None:
        self.oplog.error(code, message, request_type)
        body = {
            "code": code,
            "message": message,
            "retryable": bool(retryable),
            "request_type": request_type,
            "epoch": self.epoch,
        }
        self._send([ident, *encode_message("error", body, request_id=request_id)])

    def _send(self, frames: list[Any]) -> bool:
        """Send one message to ``frames[0]``; False when it was dropped (client gone or its
        send queue full). A gone client's parked requests are dropped too."""
        if self._sock is None:
            return False
        # Zero-copy frames may view pool segments: track them while the pool has any (shm_pool.py).
        track = bool(self.pool.segments) and any(len(f) >= COPY_BELOW for f in frames[3:])
        try:
            tracker = send_frames(self._sock, frames, zmq.NOBLOCK, track=track)
        except zmq.Again:
            logger.warning("[queue] send queue of a client is full: reply dropped")
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._client_gone(frames[0])
            return False
        if tracker is not None:
            self._send_seq += 1
            self._trackers.append((self._send_seq, tracker))
        return True

    def _client_gone(self, ident: bytes) -> None:
        """Drop the parked requests of a client whose connection is gone (nobody to answer)."""
        self._owners.pop(ident, None)
        self._names.pop(ident, None)
        dropped = 0
        for parked in self._all_parked():
            if parked.ident == ident:
                parked.finish()
                if parked.segment is not None:
                    self.pool.unstage(parked.segment)
                dropped += 1
        if dropped:
            self.dropped_parked += dropped
            logger.info(
                "[queue] client %s is gone: %d parked request(s) dropped", ident.hex(), dropped
            )

    def _probe_parked(self, now: float) -> None:
        """Send a probe (a reply with request id 0, which clients drop as stale) to each client
        with a request parked for ``_PROBE_S``: one whose connection is gone fails at once."""
        if now < self._next_probe:
            return
        self._next_probe = now + _PROBE_S
        idents = {p.ident for p in self._all_parked() if now - p.since >= _PROBE_S}
        if not idents:
            return
        probe = encode_message("reply", {"probe": True, "epoch": self.epoch}, request_id=0)
        for ident in idents:
            self._send([ident, *probe])


def _peek_header(frame: Any) -> tuple[int, str | None]:
    """Request id and type from a header frame, as far as it can be read (0, None otherwise)."""
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    if len(buf) != HEADER_SIZE:
        return 0, None
    (code,) = struct.unpack_from("<H", buf, 6)
    (rid,) = struct.unpack_from("<Q", buf, 8)
    return rid, TYPE_NAMES.get(code)


def _conn_owner(ident: bytes) -> str:
    """The owner of leases claimed on a connection whose hello named no instance."""
    return "c:" + ident.hex()


def _put_reply(result: Any) -> dict[str, Any]:
    return {
        "written": result.stored,
        "duplicates": result.duplicates,
        "new_samples": result.new_samples,
        "nbytes": result.nbytes,
        "consumed": result.consumed,
    }


def serve(config: ServerConfig, lifecycle: Lifecycle) -> int:
    """The queue process's main: bind, announce ``endpoint`` as ready, serve until stopped.

    Args:
        config: the server settings.
        lifecycle: the process lifecycle (``run_process``): its ``stop`` ends the loop.

    Returns:
        0 after a clean shutdown.
    """
    server = QueueServer(config)
    lifecycle.ready(endpoint=server.bind())
    server.serve_forever(stop=lifecycle.stop)
    return 0
