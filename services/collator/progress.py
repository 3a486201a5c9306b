"""Collator progress: the corpus size (counted in a thread), the fraction read, ETA and the state."""

from __future__ import annotations

import pathlib
import threading
import time

# Bytes read at once when counting lines.
_CHUNK = 1 << 20


def count_units(path: pathlib.Path) -> int:
    """Lines of a text file (the last one counted without its newline), rows of a parquet or
    Arrow file: the units of the line or row numbers in corpus keys."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix == ".arrow":
        import pyarrow as pa

        source = pa.memory_map(str(path))
        try:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).count_rows()
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


class CorpusProgress:
    """How far a pass over a list of corpus files got, from the key of the text read last.

    The sizes are counted in a daemon thread (a newline count, ~1 GB/s), so a large corpus
    starts at once and shows a fraction as soon as its size is known.

    Args:
        files: the corpus files, in reading order.
    """

    def __init__(self, files: list[pathlib.Path]) -> None:
        self.files = files
        self._starts: list[int] | None = None  # units before each file
        self.total: int | None = None
        self.file_index = 0
        self.unit = 0  # the line (row) of the current file read last
        threading.Thread(target=self._count, name="corpus-size", daemon=True).start()

    def _count(self) -> None:
        starts, total = [], 0
        try:
            for path in self.files:
                starts.append(total)
                total += count_units(path)
        except OSError:
            return  # no fraction; the reader reports the file
        self._starts, self.total = starts, total

    def seen(self, file_index: int, key: str) -> None:
        """Note the text read last: its file and its key (``...:<line or row>``)."""
        self.file_index = file_index
        self.unit = int(key.rsplit(":", 1)[1])

    def fraction(self) -> float | None:
        """Fraction of the corpus read (0..1), None while its size is being counted."""
        if self._starts is None or not self.total:
            return None
        return min(1.0, (self._starts[self.file_index] + self.unit) / self.total)


def format_duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Eta:
    """Seconds left from the fraction done, at the rate since ``start`` (the first worker ready:
    tokenizer loading is not collation)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.start_fraction = 0.0

    def begin(self, fraction: float | None, now: float | None = None) -> None:
        """Start measuring (once)."""
        if self.start is None:
            self.start = time.monotonic() if now is None else now
            self.start_fraction = fraction or 0.0

    def left_s(self, fraction: float | None, now: float | None = None) -> float | None:
        """Seconds left, or None while unknown."""
        if self.start is None or fraction is None:
            return None
        now = time.monotonic() if now is None else now
        done = fraction - self.start_fraction
        if done <= 0 or now <= self.start:
            return None
        return (now - self.start) * (1.0 - fraction) / done
