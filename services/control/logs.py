"""A process's log file as the API serves it: its last lines, read from the end in bounded memory,
and what was appended since, in bounded chunks.

Blocking file I/O: the routes call these in a worker thread, never on the event loop (a log can
be hundreds of megabytes, on a slow disk).
"""

from __future__ import annotations

import os
from pathlib import Path

TAIL_MAX_BYTES = 4 << 20  # the most a tail holds, whatever ``lines`` asks for
FOLLOW_CHUNK_BYTES = 1 << 20  # the most one read of appended bytes returns
_BLOCK = 64 << 10


def tail(path: str | os.PathLike, lines: int, max_bytes: int = TAIL_MAX_BYTES) -> tuple[bytes, int]:
    """The last ``lines`` lines of a log, read backwards from its end.

    Args:
        path: the log file.
        lines: how many lines (a last line without its newline counts, and gets one).
        max_bytes: the most bytes read; past it the tail starts at the first whole line within
            the budget (or, in one line longer than the budget, at the budget's start).

    Returns:
        ``(text, end)``: the lines, each ending in a newline (empty for a missing or empty
        file), and the file's size when it was read: where following it goes on.
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below; FileNotFoundError first)
    except FileNotFoundError:
        return b"", 0
    with fh:
        end = os.fstat(fh.fileno()).st_size
        pos, blocks, newlines = end, [], 0
        # ``lines`` newlines before the last line's own: the first line wanted starts after one
        while pos > 0 and end - pos < max_bytes and newlines < lines:
            size = min(_BLOCK, pos, max_bytes - (end - pos))
            pos -= size
            fh.seek(pos)
            block = fh.read(size)
            if pos + size == end and block.endswith(b"\n"):
                newlines -= 1  # the last line's own
            newlines += block.count(b"\n")
            blocks.append(block)
    data = b"".join(reversed(blocks))
    del blocks
    if pos > 0:  # the first line may be cut: start after it when a whole one follows
        cut = data.find(b"\n")
        if cut >= 0:
            data = data[cut + 1 :]
    out = data.split(b"\n")
    if out and out[-1] == b"":
        out.pop()
    out = out[-lines:]
    return (b"\n".join(out) + b"\n" if out else b""), end


def read_new(
    path: str | os.PathLike, pos: int, max_bytes: int = FOLLOW_CHUNK_BYTES
) -> tuple[bytes, int]:
    """What was appended to a log from ``pos`` on, at most ``max_bytes`` of it.

    Args:
        path: the log file.
        pos: where the last read ended.
        max_bytes: the most bytes returned (call again for the rest).

    Returns:
        ``(chunk, new_pos)``; a file shorter than ``pos`` (written anew) is read from its start,
        a missing one gives ``(b"", 0)``.
    """
    try:
        fh = open(Path(path), "rb")  # noqa: SIM115 (closed below; FileNotFoundError first)
    except FileNotFoundError:
        return b"", 0
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size < pos:
            pos = 0
        fh.seek(pos)
        chunk = fh.read(min(size - pos, max_bytes))
    return chunk, pos + len(chunk)
