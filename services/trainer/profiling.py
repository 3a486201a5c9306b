"""A torch.profiler trace of a few training steps of one rank, written where the run's files are.

The trace starts before a step's data wait and stops after its record is written, so the host's
work between steps (acks, records, the next claim) and the GPU's idle time show in it. Each rank
writes its own files; the GPU rows are this process's kernels only (a colocated teacher's run in
its own process).
"""

from __future__ import annotations

import gzip
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfiler"]

logger = logging.getLogger(__name__)


class StepProfiler:
    """Traces steps ``start .. start + steps - 1`` (``steps`` 0: does nothing).

    Args:
        start: the first traced step (steps count from 1).
        steps: how many steps to trace.
        out_dir: the folder of the files (``RUN_DIR/profile``).
        rank: this trainer rank (the files' names).
        device: the trainer's device (CUDA: kernels traced too).
    """

    def __init__(self, start: int, steps: int, out_dir: Path, rank: int, device: Any) -> None:
        self.start, self.end = start, start + steps - 1
        self.out_dir, self.rank = Path(out_dir), rank
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = steps > 0
        self._profile: torch.profiler.profile | None = None

    def step_begins(self, step: int) -> None:
        """Before ``step``'s data wait: the trace starts at ``start``."""
        if not self.enabled or self._profile is not None or not self.start <= step <= self.end:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # with Python stacks: a trace names the line of the project's code under each wait
        # (benchmarks/e2e/trace_gaps.py)
        self._profile = torch.profiler.profile(activities=activities, with_stack=True)
        self._profile.__enter__()

    def step_ended(self, step: int) -> None:
        """After ``step``'s record: the trace ends after the last traced step."""
        if self._profile is not None and step >= self.end:
            self.close()

    def close(self) -> None:
        """Stop a trace still running (a run that ended early) and write its files."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        self.enabled = False
        profile.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"trainer.rank{self.rank}"
        plain = self.out_dir / f"{stem}.trace.json"
        profile.export_chrome_trace(str(plain))
        with plain.open("rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = profile.key_averages().table(sort_by=sort, row_limit=40)
        (self.out_dir / f"{stem}.ops.txt").write_text(table + "\n")
        logger.info(
            "[trainer] rank %d: profile of steps %d-%d in %s",
            self.rank,
            self.start,
            self.end,
            self.out_dir,
        )
