"""Metric series of a run, read incrementally from trainer rank 0's JSON-lines file, and the
latest memory figure of each trainer rank and teacher from theirs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# fields of a step record kept in the series (the rest stays in the file)
STEP_FIELDS = (
    "step",
    "epoch",
    "time",
    "loss",
    "kl_loss",
    "ce_loss",
    "tokens",
    "tokens_per_s",
    "step_s",
    "times",
    "memory_mb",
    "lr",
    "grad_norm",
    "skipped",
)


class JsonlTail:
    """The records appended to a JSON-lines file since the last :meth:`poll` (a torn last line
    waits for the next one; a new file under the same name is read from its start).

    Args:
        path: the file (it may not exist yet).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._pos = 0
        self._inode: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        """The complete records appended since the last call, oldest first."""
        try:
            st = self.path.stat()
            if st.st_ino != self._inode:  # a new file (a fresh run directory): start over
                self._inode, self._pos = st.st_ino, 0
            if st.st_size <= self._pos:
                return []
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._pos += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


class LatestMemory:
    """The latest ``memory_mb`` one process wrote to its metrics file (trainer steps, teacher
    requests).

    Args:
        path: the process's metrics file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._tail = JsonlTail(path)
        self.mb: float | None = None

    def poll(self) -> float | None:
        """Read what was appended; returns the latest value (None before the first)."""
        for record in self._tail.poll():
            if isinstance(record.get("memory_mb"), int | float):
                self.mb = float(record["memory_mb"])
        return self.mb


class Series:
    """Step and eval records of one run, appended as the trainer writes them.

    Args:
        path: ``RUN_DIR/metrics/trainer.rank0.jsonl``.
        max_points: steps kept in memory (older ones are thinned: every second one dropped).
    """

    def __init__(self, path: str | os.PathLike, max_points: int = 20000) -> None:
        self.path = Path(path)
        self.max_points = max_points
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.tokens_total = 0.0
        self.steps_total = 0
        self._tail = JsonlTail(path)

    def poll(self) -> list[dict[str, Any]]:
        """Read what was appended since the last call.

        Returns:
            The new records (``{"kind": "step"|"eval"|"compile", ...}``), oldest first.
        """
        out = []
        for record in self._tail.poll():
            event = record.get("event")
            if event == "step":
                point = {k: record[k] for k in STEP_FIELDS if k in record}
                self.steps.append(point)
                self.tokens_total += float(record.get("tokens") or 0.0)
                self.steps_total += 1
                out.append({"kind": "step", **point})
            elif event == "eval":
                point = {k: v for k, v in record.items() if k not in ("event", "rank")}
                self.evals.append(point)
                out.append({"kind": "eval", **point})
            elif event == "compile":  # the student's start-up compile (state start / done)
                point = {k: v for k, v in record.items() if k not in ("event", "rank")}
                out.append({"kind": "compile", **point})
        if len(self.steps) > self.max_points:
            self.steps = self.steps[::2]
        return out

    def latest(self) -> dict[str, Any] | None:
        """The last step record, or None before the first step."""
        return self.steps[-1] if self.steps else None
