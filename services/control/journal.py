"""Run states and events, recorded in the store and handed to each run's live subscribers.

The subscribers are the event streams of the API (``GET /v1/runs/{id}/events``); a live-only
event (metrics) is handed to them without being recorded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from services.control.event_text import describe
from services.control.states import RUNNING, STARTING, RunNotFound
from services.control.store import Store

logger = logging.getLogger(__name__)


class Journal:
    """The runs' records in the store and their event subscribers.

    Args:
        store: the SQLite store.
        lock: guards the subscribers (the supervisor's lock).
    """

    def __init__(self, store: Store, lock: threading.RLock) -> None:
        self.store = store
        self._lock = lock
        self._subscribers: dict[str, list[Callable[[dict[str, Any]], None]]] = {}

    def record(self, run_id: str) -> dict[str, Any]:
        """The run's record in the store.

        Raises:
            RunNotFound: no such run.
        """
        rec = self.store.get_run(run_id)
        if rec is None:
            raise RunNotFound(run_id)
        return rec

    def set_state(self, run_id: str, state: str, **fields: Any) -> None:
        """Record the run's new state (and fields of its record: ``reason``, ``attempt`` ...),
        log it and tell the subscribers (event ``state``, without the log tail)."""
        if state in (RUNNING, STARTING):
            fields.setdefault("reason", None)  # a recovery's cause is over
        data = {"state": state, **{k: v for k, v in fields.items() if k != "log_tail"}}
        # the event first, then the record, then the subscribers: whoever reads the new state
        # finds its event, and whoever is told of the event finds the new state
        event = self.store.add_event(run_id, "state", data)
        self.store.update_run(run_id, state=state, **fields)
        logger.info(
            "[control] run %s: %s%s",
            run_id,
            state,
            f" ({fields['reason']})" if fields.get("reason") else "",
        )
        self.publish(run_id, {**event, "text": describe("state", data)})

    def event(self, run_id: str, kind: str, data: dict[str, Any]) -> None:
        """Record an event of the run and tell the subscribers (with its sentence, ``text``)."""
        event = self.store.add_event(run_id, kind, data)
        self.publish(run_id, {**event, "text": describe(kind, data)})

    def publish(self, run_id: str, event: dict[str, Any]) -> None:
        """Tell the run's subscribers (a live-only event, such as metrics, is not recorded)."""
        with self._lock:
            subs = list(self._subscribers.get(run_id, []))
        for callback in subs:
            try:
                callback(event)
            except Exception:  # a broken subscriber must not stop the run's thread
                logger.exception("[control] run %s: an event subscriber failed", run_id)

    def subscribe(
        self, run_id: str, callback: Callable[[dict[str, Any]], None]
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every new event of the run; returns the function that
        unsubscribes."""
        with self._lock:
            self._subscribers.setdefault(run_id, []).append(callback)

        def unsubscribe() -> None:
            with self._lock:
                subs = self._subscribers.get(run_id, [])
                if callback in subs:
                    subs.remove(callback)

        return unsubscribe
