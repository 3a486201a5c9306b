"""Pool leftovers and idle memory: a SIGKILLed server's segments are swept by
the next server through its lock file, whatever its pid; an idle server gives free segments back."""

from __future__ import annotations

import os
import signal
import time

import torch

from services.queue.client import QueueClient
from services.queue.shm_pool import LOCK_PREFIX, PoolLock, sweep_dead_pools
from xtoken_core.ipc import SHM_DIR

MiB = 1 << 20


def _segments(pid: int) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"xtk_{pid}_")}


def _committed_kib(pid: int) -> int:
    """Memory behind a server's segments in /dev/shm (committed by the producers that wrote
    them: the server itself maps them without touching their pages)."""
    total = 0
    for name in _segments(pid):
        try:
            total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
        except FileNotFoundError:
            pass
    return total // 1024


def _put_and_clear(address: str, partition: str, n: int, nbytes: int) -> dict:
    with QueueClient(address, timeout_s=20, shm_min_bytes=0) as client:
        for i in range(n):
            rows = torch.full((1, nbytes // 8), i, dtype=torch.int64)
            client.put(partition, [f"k{i}"], {"ids": rows})
        assert client._shm.puts == n  # through the pool
        client.clear(partition)
        return client.stats()["shm_pool"]


def test_sigkilled_servers_segments_are_swept_by_the_next_server(make_server):
    dead = make_server("--capacity", "256MiB")
    pool = _put_and_clear(dead.address, "left", 3, 4 * MiB)
    assert pool["by_state"].get("free", 0) >= 1
    left = _segments(dead.proc.pid)
    assert left, "the pool made no segment"
    locks = [  # the dead server's lock file lists its segments (other servers may run)
        n
        for n in os.listdir(SHM_DIR)
        if n.startswith(LOCK_PREFIX) and left & set(open(os.path.join(SHM_DIR, n)).read().split())
    ]
    assert len(locks) == 1
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    assert _segments(dead.proc.pid) == left  # nobody cleans a SIGKILLed process up
    started = time.monotonic()
    make_server("--capacity", "64MiB")  # ready once bound, after its sweep
    while _segments(dead.proc.pid) and time.monotonic() - started < 2:
        time.sleep(0.05)
    assert not _segments(dead.proc.pid), "the dead server's segments outlived the next start"
    assert not set(os.listdir(SHM_DIR)) & set(locks)


def test_sweep_takes_only_locks_nobody_holds(tmp_path):
    live = PoolLock("live", str(tmp_path))
    live.add("xtk_1_0123456789abcdef")
    (tmp_path / "xtk_1_0123456789abcdef").write_bytes(b"x")
    dead = PoolLock("dead", str(tmp_path))
    dead.add("xtk_2_0123456789abcdef")
    dead.add("../escape")  # never followed: only segment names are unlinked
    (tmp_path / "xtk_2_0123456789abcdef").write_bytes(b"x")
    (tmp_path / "escape").write_bytes(b"x")
    dead.abandon()  # as a SIGKILL does: the lock is released, the file stays
    removed = sweep_dead_pools(str(tmp_path))
    assert removed == ["xtk_2_0123456789abcdef"]
    names = set(os.listdir(tmp_path))
    assert "xtk_1_0123456789abcdef" in names and "escape" in names
    assert f"{LOCK_PREFIX}live.lock" in names and f"{LOCK_PREFIX}dead.lock" not in names
    live.close()
    assert f"{LOCK_PREFIX}live.lock" not in set(os.listdir(tmp_path))


def test_idle_server_returns_free_segments(make_server):
    srv = make_server("--capacity", "512MiB", "--pool-idle-s", "1")
    pid = srv.proc.pid
    pool = _put_and_clear(srv.address, "idle", 6, 32 * MiB)
    shm0 = _committed_kib(pid)
    assert pool["bytes_by_state"].get("free", 0) >= 6 * 32 * MiB
    assert shm0 > 150 * 1024, shm0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        shm = _committed_kib(pid)
        if shm < 16 * 1024:
            break
        time.sleep(0.1)
    with QueueClient(srv.address, timeout_s=5) as client:
        pool = client.stats()["shm_pool"]
    assert pool["bytes_by_state"].get("free", 0) == 0, pool
    assert shm < 16 * 1024, (shm0, shm)
    assert len(_segments(pid)) <= 1  # the hello's probe
