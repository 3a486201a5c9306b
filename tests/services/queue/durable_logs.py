"""Test helper: a durable log opened on a directory as the server opens it."""

from __future__ import annotations

from services.queue.durable import DurableLog


def open_log(path, **kw):
    """Replay ``path`` (collecting the replayed bodies) and start the log's writer.

    Returns:
        ``(log, bodies)``.
    """
    bodies = []
    log = DurableLog(str(path), **kw)
    log.replay(bodies.append)
    log.start()
    return log, bodies
