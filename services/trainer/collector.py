"""Python's garbage collector on the trainer's schedule, and the time it takes per step.

A trainer process that compiled its student holds a large heap of long-lived objects (the
models' modules, Dynamo's graphs and guards, Inductor's kernels, the tokenizers): a full
collection walks all of it, ~0.2 s after the imports and tokenizers alone on a 2-core CPU, more
after a compile. Python starts one whenever enough objects have survived since the last, at a
moment of its own on each rank; under DDP the rank it pauses enqueues its step late and every
other rank waits for it in the next gradient all-reduce.

:class:`CollectorSchedule` (``trainer.compute.gc_every``) moves the heap that exists after the
start-up step out of the collector's sight (``gc.freeze``), turns the automatic collector off and
collects every ``gc_every`` steps, on every rank at the same step, after the step is queued (the
host collects while the GPU runs). What becomes garbage in cycles between two collections waits for
the next one; a trainer that finds no data collects every :data:`IDLE_S` seconds while it waits.

:class:`CollectorClock` measures the collections of either kind through ``gc.callbacks``: each
step's record carries ``gc_s`` (seconds the host spent collecting since the step before) and
``gc_full`` (full collections among them).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

#: seconds between two collections while the trainer finds no data (no steps, no schedule)
IDLE_S = 30.0


class CollectorClock:
    """Seconds spent in the garbage collector, and the full collections, since the last read."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._full = 0
        self._t0: float | None = None
        self._installed = False

    def install(self) -> None:
        """Start measuring (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def remove(self) -> None:
        """Stop measuring."""
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self._seconds += time.perf_counter() - self._t0
            self._full += info.get("generation") == 2
            self._t0 = None

    def read(self) -> dict[str, float | int]:
        """``{"gc_s", "gc_full"}`` since the last read, and start again from zero."""
        out = {"gc_s": round(self._seconds, 6), "gc_full": self._full}
        self._seconds, self._full = 0.0, 0
        return out


class CollectorSchedule:
    """Collect every ``every`` steps, the automatic collector off (0: Python's own collector).

    Args:
        every: steps between two collections; 0 leaves the collector as Python runs it.
    """

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"gc_every={every}: must be >= 0 (0: Python's automatic collector)")
        self.every = every
        self._was_enabled = gc.isenabled()
        self._started = False
        self._last = 0.0  # monotonic time of the last collection
        #: ``{"full_collection_s", "frozen"}`` of :meth:`start` (what the start-up heap costs a
        #: full collection), None before
        self.start_report: dict[str, float | int] | None = None

    def start(self) -> None:
        """After the start-up step: collect once, freeze what is alive, collector off."""
        if not self.every or self._started:
            return
        t0 = time.perf_counter()
        gc.collect()
        seconds = time.perf_counter() - t0
        gc.freeze()
        gc.disable()
        self._started = True
        self._last = time.monotonic()
        self.start_report = {
            "full_collection_s": round(seconds, 4),
            "frozen": gc.get_freeze_count(),
        }
        logger.info(
            "[trainer] garbage collector: a full collection took %.2f s; %d objects frozen, "
            "collecting every %d steps (trainer.compute.gc_every)",
            seconds,
            self.start_report["frozen"],
            self.every,
        )

    def after_step(self, step: int) -> None:
        """Collect when ``step`` is a multiple of ``every`` (every rank reaches the same step)."""
        if self._started and step % self.every == 0:
            self._collect()

    def when_idle(self) -> None:
        """A try that found no data: collect if the last collection is ``IDLE_S`` old, so that
        a trainer waiting for data (no steps, so no scheduled collection) stays bounded."""
        if self._started and time.monotonic() - self._last >= IDLE_S:
            self._collect()

    def _collect(self) -> None:
        gc.collect()
        self._last = time.monotonic()

    def close(self) -> None:
        """Give the process back its collector (the frozen objects become collectable again)."""
        if not self._started:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._started = False
