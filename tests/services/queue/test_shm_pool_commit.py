"""The pool lends sparse segments (a reserve commits no memory) and makes sure every byte a put
references has memory behind it before the server reads it (logic object, no sockets)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from services.queue.errors import StoreError
from services.queue.shm_pool import ShmPool
from xtoken_core.ipc.shm import SHM_DIR

MiB = 1 << 20


def committed(name: str) -> int:
    return os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512


@pytest.fixture
def pool():
    p = ShmPool(max_free_bytes=64 * MiB, reserve_s=5.0)
    yield p
    p.close()


def test_a_reserve_of_512_mib_commits_nothing(pool):
    seg = pool.reserve(512 * MiB, 1 << 40, lambda s: True, b"c")
    assert seg.size == 512 * MiB and committed(seg.name) < MiB
    assert pool.held_bytes == seg.size  # counted against the capacity all the same


def test_refs_to_bytes_never_written_get_memory_or_a_clear_refusal(pool, monkeypatch):
    seg = pool.reserve(64 * MiB, 1 << 40, lambda s: True, b"c")
    seg.base_S[: 2 * MiB].fill_(7)  # what a producer wrote
    staged, _ = pool.stage(seg.token, 1)
    calls = []

    def enospc(*args):
        calls.append(args)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    pool.check_refs(staged, [(seg.name, 0, MiB), (seg.name, MiB, 2 * MiB)])
    assert not calls  # written bytes: nothing to allocate
    with pytest.raises(StoreError) as e:
        pool.check_refs(staged, [(seg.name, 0, MiB), (seg.name, 8 * MiB, 9 * MiB)])
    assert e.value.code == "shm_unavailable" and e.value.retryable
    assert "/dev/shm" in str(e.value) and "--shm-size" in str(e.value)
    monkeypatch.undo()
    pool.check_refs(staged, [(seg.name, 8 * MiB, 9 * MiB)])  # room again: backed by the server
    assert 3 * MiB <= committed(seg.name) < 4 * MiB
    assert int(seg.base_S[8 * MiB : 9 * MiB].sum()) == 0
    del staged
    assert torch.equal(seg.base_S[:4], torch.full((4,), 7, dtype=torch.uint8))


def test_bytes_once_checked_are_not_checked_again(pool, monkeypatch):
    seg = pool.reserve(8 * MiB, 1 << 40, lambda s: True, b"c")
    seg.base_S[: 3 * MiB].fill_(1)
    staged, _ = pool.stage(seg.token, 1)
    pool.check_refs(staged, [(seg.name, 0, MiB), (seg.name, MiB + 64, 3 * MiB)])
    assert seg.backed == 3 * MiB

    def no_lseek(*args):
        raise AssertionError("checked again")

    monkeypatch.setattr(os, "lseek", no_lseek)
    pool.check_refs(staged, [(seg.name, 0, 2 * MiB), (seg.name, 2 * MiB, 3 * MiB)])
