"""Queue error types: StoreError (the store refuses a request) and QueueError (client side)."""

from __future__ import annotations

# Error codes of `error` replies produced by the queue (wire codes come from xtoken_core.wire).
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
MISSING_FIELD = "missing_field"
UNKNOWN_LEASE = "unknown_lease"
QUEUE_FULL = "queue_full"
TIMEOUT = "timeout"
SHUTTING_DOWN = "shutting_down"
SHM_UNAVAILABLE = "shm_unavailable"
# a reserve that would pass --shm-reserve-max with the reservations not yet put: send frames
SHM_BUSY = "shm_busy"
# a stored put's bytes changed in its shared-memory segment after the put: never served
CORRUPT = "corrupt"
STALE_EPOCH = "stale_epoch"
UNAUTHORIZED = "unauthorized"  # a server with a token: this connection's hello did not present it
NOT_OWNER = "not_owner"  # an ack/nack of a lease another client instance claimed
# client side: the server refused the connection in its handshake, --max-connections being open
TOO_MANY_CONNECTIONS = "too_many_connections"
# client side: the caller's stop event was set while it waited, or a request of a stopping client
# failed (its connection dropped, or no reply came) and was not sent again
STOPPED = "stopped"
INTERNAL = "internal"


class StoreError(ValueError):
    """A request the store refuses; ``code`` is the wire error code, ``retryable`` says if a
    retry of the same request can succeed later."""

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


class QueueError(RuntimeError):
    """An error reply from the queue server, or a client-side timeout.

    Attributes:
        code: the error code (``queue_full``, ``timeout``, ``bad_body``, ...).
        retryable: whether sending the same request again can succeed.
        request_type: the request that failed.
    """

    def __init__(
        self, code: str, message: str, *, retryable: bool = False, request_type: str = ""
    ) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.request_type = request_type


class StaleEpochError(QueueError):
    """An ack or nack of a lease that an earlier instance of the server issued: the server
    restarted (memory only) and lost the lease and its samples. Not retryable: drop the lease,
    do not count its samples as consumed; a producer re-puts what the new instance lacks."""
