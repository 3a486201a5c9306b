"""The lock on a durable queue's data directory (``DIR/lock``): a server and its log writer."""

from __future__ import annotations

import fcntl
import os
import time

LOCK_NAME = "lock"
# How long a server waits for the lock of its data directory (a predecessor still exiting).
LOCK_WAIT_S = 5.0


class DirLock:
    """An exclusive ``flock`` on ``DIR/lock``. The log writer inherits ``fd`` (one open file
    description), so the lock lasts while the server or its writer lives; the file names their
    pids, for the message of a server refused.

    Args:
        data_dir: the directory (it exists).
        wait_s: how long to wait for a holder to let go.

    Raises:
        ValueError: still held after ``wait_s``: the message names the holders' pids and
            whether they run.
    """

    def __init__(self, data_dir: str, wait_s: float = LOCK_WAIT_S) -> None:
        path = os.path.join(data_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holders = os.pread(fd, 4096, 0).decode(errors="replace").split()
                    os.close(fd)
                    raise ValueError(
                        f"the data directory {data_dir} is in use: {path} is held by "
                        f"{_describe(holders)} (waited {wait_s:g}s); stop that process or use "
                        "another --data-dir"
                    ) from None
                time.sleep(0.05)
        self.fd = fd
        self.name_holders(os.getpid())

    def name_holders(self, server_pid: int, writer_pid: int | None = None) -> None:
        """Write the holders' pids into the lock file."""
        text = f"server {server_pid}\n" + (f"writer {writer_pid}\n" if writer_pid else "")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def release(self) -> None:
        """Close this process's descriptor (the lock goes once the writer, if any, exited too)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _describe(holders: list[str]) -> str:
    """``["server", "12", "writer", "34"]`` (the lock file) as words, each pid running or gone."""
    words = []
    for role, pid in zip(holders[::2], holders[1::2]):
        try:
            os.kill(int(pid), 0)
            state = "running"
        except ProcessLookupError:
            state = "gone"
        except (PermissionError, ValueError):
            state = "unknown"
        who = "a queue server" if role == "server" else "the log writer of a queue server"
        words.append(f"pid {pid} ({who}, {state})")
    return ", ".join(words) or "another process"
