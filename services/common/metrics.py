"""JSON-lines metrics of a process: one record per line, flushed at once, in the run directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class JsonlWriter:
    """Append JSON records to ``path`` (created with its parents), one per line.

    Args:
        path: the JSONL file.
        **static: fields written into every record (e.g. ``process="trainer0"``).
    """

    def __init__(self, path: str | os.PathLike, **static: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.static = static

    def write(self, event: str, **fields: Any) -> None:
        """Write one record ``{"event", "time", **static, **fields}``."""
        record = {"event": event, "time": round(time.time(), 3), **self.static, **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def device_memory_mb(device: Any) -> float:
    """Peak memory of this process on ``device`` in MiB: allocated by PyTorch on a CUDA device
    (``torch.cuda.max_memory_allocated``), else the process's peak RSS.

    Args:
        device: a ``torch.device`` or a device string (``cuda:0``, ``cpu``).
    """
    if str(device).startswith("cuda"):
        import torch

        return round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 1)
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except ImportError:  # pragma: no cover - not on Linux
        return 0.0


def device_reserved_mb(device: Any) -> float | None:
    """Peak memory PyTorch's allocator reserved for this process on a CUDA ``device`` in MiB
    (``torch.cuda.max_memory_reserved``: its cached blocks and CUDA graphs' pools besides what is
    allocated; what decides how many processes share a GPU), None off CUDA.

    Args:
        device: a ``torch.device`` or a device string (``cuda:0``, ``cpu``).
    """
    if not str(device).startswith("cuda"):
        return None
    import torch

    return round(torch.cuda.max_memory_reserved(torch.device(device)) / 2**20, 1)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file (a torn last line is skipped)."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
