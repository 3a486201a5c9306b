"""The run states of the control plane, and the errors of calls that do not fit a run's state.

PENDING -> STARTING (prepare, launch) -> RUNNING <-> RECOVERING (cause, attempt)
RUNNING -> SUCCEEDED | FAILED (process, exit code, last log lines)
any active state -> STOPPING (trainers checkpoint) -> STOPPED
STOPPED | FAILED | INTERRUPTED -> resume -> PENDING ...
"""

from __future__ import annotations

PENDING, STARTING, RUNNING, RECOVERING = "PENDING", "STARTING", "RUNNING", "RECOVERING"
STOPPING, STOPPED, SUCCEEDED, FAILED = "STOPPING", "STOPPED", "SUCCEEDED", "FAILED"
INTERRUPTED = "INTERRUPTED"
STATES = (
    PENDING,
    STARTING,
    RUNNING,
    STOPPING,
    STOPPED,
    SUCCEEDED,
    FAILED,
    RECOVERING,
    INTERRUPTED,
)
# a run in one of these has a thread that drives it (or gets one on recovery)
ACTIVE = frozenset({PENDING, STARTING, RUNNING, RECOVERING, STOPPING})
RESUMABLE = frozenset({STOPPED, FAILED, INTERRUPTED})


class RunNotFound(KeyError):
    """No run of that id (HTTP 404)."""


class Conflict(ValueError):
    """The call does not fit the run's state (HTTP 409); the message says which states do."""
