"""Shared memory is committed as it is written: sparse segments, regions that allocate the pages
they write before writing them, a typed error instead of a SIGBUS when /dev/shm is full."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from xtoken_core.ipc.shm import SHM_DIR, ShmFullError, ShmRegion, ShmSegment, back_ranges

MiB = 1 << 20


def committed(name: str) -> int:
    """Bytes of memory behind a segment file (its allocated blocks)."""
    return os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512


@pytest.fixture
def sparse():
    seg = ShmSegment.create(512 * MiB, commit=False)
    yield seg
    seg.unlink()


def enospc(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_sparse_segment_commits_nothing(sparse):
    assert os.stat(os.path.join(SHM_DIR, sparse.name)).st_size == 512 * MiB
    assert committed(sparse.name) < MiB


def test_a_committed_segment_is_allocated_up_front():
    with ShmSegment.create(4 * MiB) as seg:
        assert committed(seg.name) >= 4 * MiB


def test_a_region_commits_exactly_what_it_writes(sparse):
    base_S = sparse.base()
    region = ShmRegion(sparse.name, sparse.size, base_S, 0, sparse.size, "tok")
    handle = region.write(torch.ones(8 * MiB // 4, dtype=torch.float32))
    assert 8 * MiB <= committed(sparse.name) < 8 * MiB + MiB
    assert base_S[handle.offset : handle.offset + 4].view(torch.float32).item() == 1.0
    ids = region.empty((MiB // 8,), torch.int64)  # built in place: committed before handed out
    assert 9 * MiB <= committed(sparse.name) < 9 * MiB + MiB
    ids.fill_(3)
    region.commit(2 * MiB)  # the next 2 MiB ahead of writing them (a put's layout), one call
    assert 11 * MiB <= committed(sparse.name) < 11 * MiB + MiB
    region.write(torch.zeros(MiB // 4))  # within what is committed: no more
    region.write(torch.zeros(MiB // 4 - 64))
    assert committed(sparse.name) < 11 * MiB + MiB
    del ids, base_S, region


def test_a_full_shm_raises_a_typed_retryable_error_before_any_byte_is_written(sparse, monkeypatch):
    base_S = sparse.base()
    region = ShmRegion(sparse.name, sparse.size, base_S, 0, sparse.size, "tok")
    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(ShmFullError) as e:
        region.write(torch.ones(MiB))
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert e.value.retryable
    message = str(e.value)
    assert "/dev/shm" in message and "--shm-size" in message and sparse.name in message
    with pytest.raises(ShmFullError):
        region.empty((16,), torch.int64)
    assert committed(sparse.name) < MiB  # nothing touched
    monkeypatch.undo()
    assert region.write(torch.ones(4)).offset == 0  # the failed writes used no room
    del base_S, region


def test_a_filesystem_without_fallocate_writes_as_before(sparse, monkeypatch):
    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    base_S = sparse.base()
    region = ShmRegion(sparse.name, sparse.size, base_S, 0, sparse.size, "tok")
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    h = region.write(torch.arange(10))
    assert base_S[h.offset : h.offset + h.nbytes].view(torch.int64).tolist() == list(range(10))
    del base_S, region


def test_back_ranges_allocates_only_holes_and_refuses_when_full(sparse, monkeypatch):
    base_S = sparse.base()
    base_S[: 4 * MiB].fill_(1)  # written by a producer: backed
    assert back_ranges(sparse.name, [(0, 4 * MiB)]) == 0
    assert committed(sparse.name) < 5 * MiB
    assert back_ranges(sparse.name, [(4 * MiB, 6 * MiB), (0, MiB), (6 * MiB, 6 * MiB)]) >= 2 * MiB
    assert 6 * MiB <= committed(sparse.name) < 7 * MiB
    calls = []
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: calls.append(a) or enospc())
    assert back_ranges(sparse.name, [(0, 4 * MiB)]) == 0 and not calls  # nothing to allocate
    with pytest.raises(ShmFullError, match="/dev/shm"):
        back_ranges(sparse.name, [(100 * MiB, 101 * MiB)])
    del base_S


def test_a_region_of_a_segment_its_owner_unlinked_is_written_as_before():
    seg = ShmSegment.create(MiB, commit=False)
    base_S = seg.base()
    region = ShmRegion(seg.name, seg.size, base_S, 0, seg.size, "tok")
    seg.unlink()  # a server that died and was swept: the mapping stays valid
    h = region.write(torch.arange(10))
    assert base_S[h.offset : h.offset + h.nbytes].view(torch.int64).tolist() == list(range(10))
    assert back_ranges(seg.name, [(0, 80)]) is None
    del base_S, region
