"""The queue-depth history of one run: a bounded ring of the queue's stats as the control plane
sampled them, kept in the run directory (``metrics/queue_depth.json``).

The queue monitor asks each active run's queue for its stats every ``queue_stats_s`` (2 s); each
answer is offered to the run's :class:`QueueHistory`. At most :data:`MAX_POINTS` samples are
kept: when the ring is full every second one is dropped and from then on only every second
answer is kept (then every fourth, ...), so the history always spans the whole run, at full
resolution for its first ``MAX_POINTS * queue_stats_s`` seconds (68 min at 2 s) and coarser
after. A sample is :data:`FIELDS` (six numbers): at most 2048 x 6 numbers per run, in memory and
on disk (~100 KB of JSON).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_POINTS = 2048
FIELDS = ("time", "samples", "bytes_used", "leases", "parked_claims", "parked_puts")
FILE_NAME = "queue_depth.json"
SAVE_EVERY_S = 30.0  # a control plane that dies loses at most this much of a live run's history


def history_path(run_dir: str | os.PathLike) -> Path:
    """Where a run's queue-depth history is kept."""
    return Path(run_dir) / "metrics" / FILE_NAME


class QueueHistory:
    """Queue-depth samples of one run, oldest first, at most ``max_points`` of them.

    Thread-safe: the queue monitor adds, the API reads.

    Args:
        path: the JSON file it is kept in (read now when it exists: a resumed run, or one a
            restarted control plane watches again, goes on with its history); None: memory only.
        max_points: the bound (>= 2).

    Raises:
        ValueError: ``max_points`` below 2.
    """

    def __init__(self, path: str | os.PathLike | None, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points={max_points}: keep at least 2 samples")
        self.path = Path(path) if path is not None else None
        self.max_points = max_points
        self.stride = 1  # keep one answer in `stride`
        self._since = 0  # answers seen since the last one kept
        self._points: list[list[float]] = []
        self._lock = threading.Lock()
        self._saved_at: float | None = None
        self._dirty = False
        if self.path is not None:
            self._load()

    def add(self, stats: dict[str, Any], at: float) -> bool:
        """Offer one answer of the queue's ``stats`` (taken at unix time ``at``).

        Args:
            stats: the stats reply as the API shows it (``samples``, ``bytes_used``, ``leases``,
                ``parked_claims``, ``parked_puts``; a missing one is recorded as 0).
            at: when it was taken.

        Returns:
            Whether it was kept (the stride skips the others).
        """
        with self._lock:
            if self._points and at <= self._points[-1][0]:
                return False  # a clock step back: the series stays ordered
            self._since += 1
            if self._points and self._since < self.stride:
                return False
            self._since = 0
            self._points.append([float(at), *(_number(stats.get(f)) for f in FIELDS[1:])])
            if len(self._points) > self.max_points:
                # every second one goes, the latest stays; answers are kept half as often
                self._points = self._points[::-1][::2][::-1]
                self.stride *= 2
            self._dirty = True
            return True

    def points(self, after: float | None = None) -> list[list[float]]:
        """The samples (rows of :data:`FIELDS`), oldest first; only those taken after ``after``
        when given."""
        with self._lock:
            if after is None:
                return [list(p) for p in self._points]
            return [list(p) for p in self._points if p[0] > after]

    def __len__(self) -> int:
        with self._lock:
            return len(self._points)

    def save_if_due(self, now: float) -> None:
        """Write the file when samples were added and :data:`SAVE_EVERY_S` passed since the last
        write (``now``: unix time)."""
        if self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S:
            self.save(now)

    def save(self, now: float | None = None) -> None:
        """Write the file now (atomically) if anything was added since the last write; a write
        that fails is logged, and tried again next time."""
        if self.path is None:
            return
        with self._lock:
            if not self._dirty:
                return
            body = {"fields": list(FIELDS), "stride": self.stride, "points": self._points}
            text = json.dumps(body, separators=(",", ":"))
            self._dirty = False
        self._saved_at = now
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as e:
            with self._lock:
                self._dirty = True
            logger.warning("[control] queue history %s not saved: %s", self.path, e)

    def _load(self) -> None:
        assert self.path is not None
        try:
            body = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            logger.warning(
                "[control] queue history %s unreadable (%s): starting a new one", self.path, e
            )
            return
        fields = body.get("fields") if isinstance(body, dict) else None
        if fields != list(FIELDS):
            logger.warning(
                "[control] queue history %s has fields %s, not %s: starting a new one",
                self.path,
                fields,
                list(FIELDS),
            )
            return
        points = [p for p in body.get("points") or [] if _is_row(p)]
        self._points = points[-self.max_points :]
        stride = body.get("stride")
        self.stride = stride if isinstance(stride, int) and stride >= 1 else 1


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return value


def _is_row(row: Any) -> bool:
    return (
        isinstance(row, list)
        and len(row) == len(FIELDS)
        and all(isinstance(x, int | float) for x in row)
    )
