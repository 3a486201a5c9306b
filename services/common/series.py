"""Metric series of a run, read incrementally from trainer rank 0's JSON-lines file, the latest
memory figure of each trainer rank, teacher and rollout worker from theirs, and each rollout
worker's latest batch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# fields of a step record kept in the series (the rest stays in the file), and each teacher's own
# KD term of a run of several teachers (teacher{i}_kl_loss, teacher 0 included)
TEACHER_KD_FIELD = re.compile(r"teacher\d+_kl_loss")
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
    "on_policy",
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


class LatestRecord:
    """The latest record of one event a process wrote to its metrics file (a rollout worker's
    ``rollout`` records: its last batch).

    Args:
        path: the process's metrics file.
        event: the ``event`` of the records kept.
    """

    def __init__(self, path: str | os.PathLike, event: str) -> None:
        self._tail = JsonlTail(path)
        self.event = event
        self.record: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        """Read what was appended; returns the latest record of the event (None before one)."""
        for record in self._tail.poll():
            if record.get("event") == self.event:
                self.record = record
        return self.record


class Series:
    """Step and eval records of one run, appended as the trainer writes them (the fields of
    ``STEP_FIELDS`` and each teacher's ``teacher{i}_kl_loss``). Each kept step
    also has ``tokens_seen``: the tokens of every step up to it on the run's trajectory (a
    replay after a restart from a checkpoint counts once).

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
                point.update((k, v) for k, v in record.items() if TEACHER_KD_FIELD.fullmatch(k))
                point["tokens_seen"] = self._tokens_before(point.get("step")) + _number(
                    record.get("tokens")
                )
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
            self.steps = self.steps[::-1][::2][::-1]  # every second one goes, the latest stays
        return out

    def _tokens_before(self, step: Any) -> float:
        """``tokens_seen`` of the step before ``step`` on the run's trajectory: the last kept
        step below it (a step at or before the last one is a replay after a restart from a
        checkpoint, which counts its tokens once)."""
        for point in reversed(self.steps):
            if not isinstance(step, int | float) or point.get("step", -1) < step:
                return float(point.get("tokens_seen", 0.0))
        return 0.0

    def latest(self) -> dict[str, Any] | None:
        """The last step record, or None before the first step."""
        return self.steps[-1] if self.steps else None


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def last_step(path: str | os.PathLike, window: int = 1 << 16) -> dict[str, Any] | None:
    """The last step record of a JSON-lines metrics file, read from its end.

    Args:
        path: the file (it may not exist).
        window: bytes read from the end per look (the whole file at most).

    Returns:
        The record, or None without a step record.
    """
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            pos = end
            carry = b""
            while pos > 0:
                start = max(0, pos - window)
                fh.seek(start)
                data = fh.read(pos - start) + carry
                lines = data.split(b"\n")
                carry = lines[0] if start > 0 else b""  # maybe cut: read with the block before
                for line in reversed(lines[1:] if start > 0 else lines):
                    if b'"step"' not in line:
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(record, dict) and record.get("event") == "step":
                        return record
                pos = start
    except FileNotFoundError:
        return None
    return None


class LastSteps:
    """:func:`last_step` of several files, each read again only when it changed (size or
    modification time)."""

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[int, int, dict[str, Any] | None]] = {}

    def get(self, path: str | os.PathLike) -> dict[str, Any] | None:
        """The last step record of ``path`` (None: no file, or no step in it)."""
        path = Path(path)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        known = self._seen.get(path)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return known[2]
        found = last_step(path)
        self._seen[path] = (st.st_size, st.st_mtime_ns, found)
        return found
