"""Metric series of a run, read incrementally from trainer rank 0's JSON-lines file."""

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
        self._pos = 0
        self._inode: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        """Read what was appended since the last call.

        Returns:
            The new records (``{"kind": "step"|"eval", ...}``), oldest first.
        """
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
        complete = data[: data.rfind(b"\n") + 1]  # a torn last line waits for the next call
        self._pos += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
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
        if len(self.steps) > self.max_points:
            self.steps = self.steps[::2]
        return out

    def latest(self) -> dict[str, Any] | None:
        """The last step record, or None before the first step."""
        return self.steps[-1] if self.steps else None
