"""Runs side by side: each run's curves on three x axes (steps, tokens seen, wall time), thinned
to a bound, and the keys in which their configs differ.

Pure functions over step and eval records (:class:`services.common.series.Series`) and recorded
configs; the supervisor gathers them (:meth:`services.control.supervisor.Supervisor.compare`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# per-step fields of a compared run, beside its three x axes
STEP_SERIES = ("loss", "kl_loss", "ce_loss", "tokens_per_s", "memory_mb")
# config keys left out of the diff: unique to each run by construction
IGNORED_KEYS = frozenset({"run_dir"})
MAX_RUNS = 16
DEFAULT_POINTS = 1000
MAX_POINTS = 10000


def trajectory(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of a run's trajectory: a step at or before the last one is a replay after a
    restart from a checkpoint, and replaces what came after that checkpoint.

    Args:
        steps: step records in the order they were written.

    Returns:
        Steps in increasing step order.
    """
    out: list[dict[str, Any]] = []
    for point in steps:
        step = point.get("step")
        if not isinstance(step, int):
            continue
        while out and out[-1]["step"] >= step:
            out.pop()
        out.append(point)
    return out


def thin(n: int, max_points: int) -> list[int]:
    """Indices of at most ``max_points`` of ``n`` points, evenly spread, the first and the last
    always among them.

    Args:
        n: the number of points.
        max_points: the bound (>= 2).
    """
    if n <= max_points:
        return list(range(n))
    last = n - 1
    return sorted({round(i * last / (max_points - 1)) for i in range(max_points)})


def run_series(
    steps: list[dict[str, Any]], evals: list[dict[str, Any]], max_points: int = DEFAULT_POINTS
) -> dict[str, Any]:
    """A run's curves as columns: each step's x on three axes and its figures; each eval's x and
    bits per byte.

    Args:
        steps: the run's step records (``step``, ``time``, ``tokens_seen``, loss parts, ...).
        evals: its eval records (``step``, ``time``, ``tag``, ``bits_per_byte``).
        max_points: the most steps returned (thinned evenly; evals are few and all kept).

    Returns:
        ``{"steps": {"step", "tokens_seen", "elapsed_s", *STEP_SERIES: [...]}, "evals":
        {"step", "tokens_seen", "elapsed_s", "bits_per_byte", "tag": [...]}, "origin": unix
        time of elapsed_s 0 (the run's first record) or None}``; a figure a record lacks is
        None.
    """
    path = trajectory(steps)
    evals = [
        e
        for e in evals
        if isinstance(e.get("step"), int) and _num(e.get("bits_per_byte")) is not None
    ]
    times = [t for t in (_num(r.get("time")) for r in [*path, *evals]) if t is not None]
    origin = min(times) if times else None

    def elapsed(record: dict[str, Any]) -> float | None:
        t = _num(record.get("time"))
        return None if t is None or origin is None else round(t - origin, 3)

    kept = [path[i] for i in thin(len(path), max_points)]
    step_cols: dict[str, list[Any]] = {
        "step": [p["step"] for p in kept],
        "tokens_seen": [_num(p.get("tokens_seen")) for p in kept],
        "elapsed_s": [elapsed(p) for p in kept],
    }
    for name in STEP_SERIES:
        step_cols[name] = [_num(p.get(name)) for p in kept]

    path_steps = [p["step"] for p in path]
    path_seen = [_num(p.get("tokens_seen")) or 0.0 for p in path]
    eval_cols: dict[str, list[Any]] = {
        "step": [],
        "tokens_seen": [],
        "elapsed_s": [],
        "bits_per_byte": [],
        "tag": [],
    }
    for e in sorted(evals, key=lambda e: (e["step"], _num(e.get("time")) or 0.0)):
        eval_cols["step"].append(e["step"])
        at = bisect.bisect_right(path_steps, e["step"])  # the steps up to the eval's
        eval_cols["tokens_seen"].append(path_seen[at - 1] if at else 0.0)
        eval_cols["elapsed_s"].append(elapsed(e))
        eval_cols["bits_per_byte"].append(_num(e.get("bits_per_byte")))
        eval_cols["tag"].append(str(e.get("tag") or ""))
    return {"steps": step_cols, "evals": eval_cols, "origin": origin}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"dotted.key": value}``; lists and scalars are leaves, an empty
    mapping is a leaf ``{}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_diff(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The config keys whose values are not the same in every run (a key some runs lack counts
    as different), :data:`IGNORED_KEYS` left out.

    Args:
        configs: run id -> its recorded config, in the order the runs are shown.

    Returns:
        ``[{"key": "trainer.optim.lr", "values": {run id: value}}]`` sorted by key; a run that
        lacks the key is absent from ``values``.
    """
    flat = {run_id: flatten(config or {}) for run_id, config in configs.items()}
    keys = sorted(set().union(*flat.values())) if flat else []
    out = []
    for key in keys:
        if key in IGNORED_KEYS:
            continue
        values = {run_id: f[key] for run_id, f in flat.items() if key in f}
        shown = {json.dumps(v, sort_keys=True) for v in values.values()}
        if len(values) < len(flat) or len(shown) > 1:
            out.append({"key": key, "values": values})
    return out


class KeptCurves:
    """:func:`run_series` of runs read from their metrics files, each kept until its file changes
    (size or modification time): a dashboard that compares a live run with finished ones asks
    every few seconds, and reading a file of 20,000 steps takes ~0.7 s. Thread-safe.

    Args:
        kept: the most kept (the oldest goes first); each is at most ``max_points`` x 13 numbers.
    """

    def __init__(self, kept: int = 32) -> None:
        self.kept = kept
        self._curves: dict[tuple, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def get(
        self, path: str | os.PathLike, max_points: int, read: Callable[[], Any]
    ) -> dict[str, Any]:
        """The curves of the run whose metrics file is ``path``.

        Args:
            path: rank 0's metrics file.
            max_points: as :func:`run_series`.
            read: reads the file's series (``steps``, ``evals``) when it is not kept.
        """
        try:
            st = Path(path).stat()
        except (FileNotFoundError, NotADirectoryError):
            return run_series([], [], max_points)
        key = (str(path), st.st_size, st.st_mtime_ns, max_points)
        with self._lock:
            found = self._curves.get(key)
        if found is None:
            series = read()
            found = run_series(series.steps, series.evals, max_points)
            with self._lock:
                self._curves[key] = found
                while len(self._curves) > self.kept:
                    self._curves.pop(next(iter(self._curves)))
        return found


def _num(value: Any) -> float | None:
    """A finite number as float, else None (JSON has no NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)
