"""What the supervisor knows of one shared queue server: its last answer, its instance, and the
instance each run on it started on (its restarts and outages, as the supervisor sees them).

A queue server names its instance in every reply (``epoch``, new at each start; see
proto/PROTOCOL.md "Server instances"). A run started on one instance whose server now answers as
another lost what it had there unless the server is durable (``--data-dir``, ``durable`` in its
hello). The baseline is kept per run, not per address: a run launched (or relaunched) on the new
instance lost nothing, though the address changed instance while it ran.

Not thread-safe: the queue monitor (queue_monitor.py) calls it under the supervisor's lock.
"""

from __future__ import annotations

from typing import Any


class QueueWatch:
    """One shared queue address, as its hellos show it.

    Args:
        address: the queue's endpoint.
        now: a monotonic time; the outage clock starts here until the first answer.

    Attributes:
        epoch: the instance of the last answer (None before the first).
        durable: the last hello's ``durable`` (None: the server did not say; not durable).
        error: why the last look got no answer (None after an answer).
    """

    def __init__(self, address: str, now: float) -> None:
        self.address = address
        self.epoch: str | None = None
        self.durable: bool | None = None
        self.error: str | None = None
        self._last_ok = now
        self._ok = True
        self._runs: dict[str, str] = {}  # run id -> the instance it started on

    def answered(self, hello: dict[str, Any], now: float) -> None:
        """A hello's reply came back at ``now`` (monotonic)."""
        epoch = hello.get("epoch")
        if isinstance(epoch, str):
            self.epoch = epoch
        durable = hello.get("durable")
        self.durable = durable if isinstance(durable, bool) else None
        self.error = None
        self._last_ok, self._ok = now, True

    def failed(self, error: str, now: float) -> None:
        """A look got no answer (``error`` says why); the outage counts from the last answer."""
        self.error = error
        self._ok = False

    def down_s(self, now: float) -> float:
        """Seconds since the last answer while the latest look got none; 0.0 while it answers."""
        return 0.0 if self._ok else max(0.0, now - self._last_ok)

    def launched(self, run_id: str, epoch: str | None) -> None:
        """A run (re)started its processes on instance ``epoch`` (None: unknown, the next look
        at a server that answers sets it)."""
        if epoch is None:
            self._runs.pop(run_id, None)
        else:
            self._runs[run_id] = epoch

    def baseline(self, run_id: str) -> str | None:
        """The instance the run's processes started on, as far as this watch knows."""
        return self._runs.get(run_id)

    def change(self, run_id: str, restored: str | None) -> tuple[str, str] | None:
        """``(old, new)`` once when the server answers as another instance than the run started
        on, which becomes the run's baseline; None otherwise.

        Args:
            run_id: the run.
            restored: the run's instance from its record (a re-attached run), used when this
                watch knows none for it; None: the current instance is its baseline.
        """
        if self.epoch is None or not self._ok:
            return None
        old = self._runs.get(run_id, restored)
        self._runs[run_id] = self.epoch
        if old is None or old == self.epoch:
            return None
        return old, self.epoch

    def forget(self, run_id: str) -> None:
        """Drop what is known of the run (it ended)."""
        self._runs.pop(run_id, None)
