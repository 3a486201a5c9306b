"""The progress line of ``xtoken run``: rank 0's latest steps as one line redrawn on stderr."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, TextIO

from services.common.series import Series


class ProgressLine:
    """Reads rank 0's metrics as they come and draws one line: compiling, starting, or the step,
    losses, throughput and ETA with a bar when the run has ``max_steps``.

    Args:
        metrics: rank 0's metrics file (``RUN_DIR/metrics/trainer.rank0.jsonl``).
        max_steps: the trainer's ``max_steps`` (0: no bar, no ETA).
        stream: where the line goes (default stderr).
    """

    WIDTH = 150

    def __init__(self, metrics: str | os.PathLike, max_steps: int, stream: TextIO | None = None):
        self.series = Series(metrics)
        self.max_steps = max_steps
        self.stream = stream
        self.compiling = False  # rank 0 compiles the student (its start-up step)
        self.recent: list[dict[str, Any]] = []  # the last step records

    def line(self, elapsed_s: float) -> str:
        """Read what rank 0 appended; the line for a run ``elapsed_s`` seconds in."""
        polled = self.series.poll()
        for r in polled:
            if r["kind"] == "compile":
                self.compiling = r.get("state") == "start"
        new = [r for r in polled if r["kind"] == "step"]
        self.recent = (self.recent + new)[-5:]
        records = self.recent
        if not records and self.compiling:
            return f"[run] compiling the student... {elapsed_s:.0f}s"
        if not records:
            return f"[run] starting... {elapsed_s:.0f}s"
        last = records[-1]
        total = self.max_steps
        rate = [r.get("tokens_per_s") or 0 for r in records]
        step_s = sum(r["step_s"] for r in records) / len(records)
        eta = f" ETA {step_s * (total - last['step']):.0f}s" if total else ""
        bar = ""
        if total:
            done = int(30 * last["step"] / total)
            bar = "[" + "#" * done + "." * (30 - done) + "] "
        return (
            f"{bar}step {last['step']}{'/' + str(total) if total else ''} loss "
            f"{last.get('loss', math.nan):.4f} kd {last.get('kl_loss', 0.0):.4f} ce "
            f"{last.get('ce_loss', 0.0):.4f} {sum(rate) / len(rate):.0f} tok/s{eta}"
        )

    def show(self, elapsed_s: float) -> None:
        """Redraw the line."""
        stream = self.stream or sys.stderr
        stream.write("\r" + self.line(elapsed_s)[: self.WIDTH].ljust(self.WIDTH))
        stream.flush()

    def end(self) -> None:
        """End the line (the next output starts on a fresh one)."""
        (self.stream or sys.stderr).write("\n")
