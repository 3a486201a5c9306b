"""A reserve commits no memory; a put commits what it writes; a full /dev/shm is a clear error or
a fallback to frames, never a SIGBUS; quota errors name the client and the flag (real server)."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.ipc.shm import SHM_DIR, ShmFullError

MiB = 1 << 20


def committed(name: str) -> int:
    """Bytes of memory behind a segment file (its allocated blocks)."""
    return os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512


def enospc(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def big(make_server):
    return make_server("--capacity", "1GiB", "--shm-reserve-max", "512MiB")


def test_a_capacity_sized_reserve_commits_nothing_and_a_put_commits_what_it_writes(big):
    with QueueClient(big.address, timeout_s=30, shm_min_bytes=0) as client:
        region = client.reserve(512 * MiB)
        assert region.size == 512 * MiB
        assert committed(region.name) < MiB
        x = torch.arange(8 * MiB // 4, dtype=torch.float32).view(1, -1)  # 8 MiB
        assert client.put("commit", ["a"], {"x": x}, reservation=region)["written"] == 1
        assert 8 * MiB <= committed(region.name) < 9 * MiB
        assert torch.equal(client.get("commit", ["a"], ["x"], shm=True)["fields"]["x"], x)
        client.clear("commit")


def test_a_full_shm_falls_back_to_frames_with_one_warning_and_loses_nothing(
    server, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="services.queue.shm_transport")
    values = [torch.full((1, MiB), float(i)) for i in range(3)]  # 4 MiB each
    with QueueClient(server.address, timeout_s=30, shm_min_bytes=0) as client:
        reserved = client.stats()["shm_pool"]["by_state"].get("reserved", 0)
        monkeypatch.setattr(os, "posix_fallocate", enospc)
        for i, x in enumerate(values):
            assert client.put("commit-full", [f"k{i}"], {"x": x})["written"] == 1
        monkeypatch.undo()
        assert client._shm.puts == 0 and not client._shm.enabled
        warnings = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "frames" in warnings[0] and "--shm-size" in warnings[0]
        got = client.get("commit-full", ["k0", "k1", "k2"], ["x"])["fields"]["x"]
        assert torch.equal(got, torch.cat(values))
        # the reservation went back with the frames put, not after --shm-reserve-timeout-s
        assert client.stats()["shm_pool"]["by_state"].get("reserved", 0) == reserved
        client.clear("commit-full")
    with QueueClient(server.address, timeout_s=30, shm_min_bytes=0) as client:
        assert client.put("commit-full", ["a"], {"x": values[0]})["written"] == 1
        assert client._shm.puts == 1  # the server is fine: the next client uses the pool
        client.clear("commit-full")


def test_with_shm_always_a_full_shm_is_a_retryable_error_naming_the_fix(server, monkeypatch):
    with QueueClient(server.address, timeout_s=30, shm="always") as client:
        monkeypatch.setattr(os, "posix_fallocate", enospc)
        with pytest.raises(QueueError) as e:
            client.put("commit-always", ["a"], {"x": torch.ones(1, MiB)})
        monkeypatch.undo()
        assert e.value.code == "shm_unavailable" and e.value.retryable
        assert "/dev/shm" in e.value.message and "--shm-size" in e.value.message
        assert client.list("commit-always")["keys"] == []
        assert client.put("commit-always", ["a"], {"x": torch.ones(1, MiB)})["written"] == 1
        client.clear("commit-always")


def test_building_in_a_reservation_when_shm_is_full_raises_and_the_put_still_goes(
    server, monkeypatch
):
    with QueueClient(server.address, timeout_s=30, shm_min_bytes=0) as client:
        reserved = client.stats()["shm_pool"]["by_state"].get("reserved", 0)
        region = client.reserve(4 * MiB)
        monkeypatch.setattr(os, "posix_fallocate", enospc)
        with pytest.raises(ShmFullError) as e:
            region.empty((MiB,), torch.float32)
        assert e.value.retryable and "/dev/shm" in str(e.value)
        x = torch.ones(1, MiB)
        reply = client.put("commit-region", ["a"], {"x": x}, reservation=region)
        monkeypatch.undo()
        assert reply["written"] == 1
        assert torch.equal(client.get("commit-region", ["a"], ["x"])["fields"]["x"], x)
        assert client.stats()["shm_pool"]["by_state"].get("reserved", 0) == reserved
        client.clear("commit-region")


def test_reserve_quota_errors_name_the_client_and_the_flag(make_server):
    srv = make_server("--capacity", "32MiB")  # --shm-reserve-max: a quarter, 8 MiB
    with QueueClient(srv.address, timeout_s=10, shm_min_bytes=0, name="collator-7") as client:
        t = time.monotonic()
        with pytest.raises(QueueError) as e:
            client.reserve(9 << 20, timeout_s=30)
        too_big = e.value.message
        client.reserve(6 << 20, timeout_s=30)
        with pytest.raises(QueueError) as e:
            client.reserve(3 << 20, timeout_s=30)
        held = e.value.message
        assert time.monotonic() - t < 5
    for message in (too_big, held):
        assert "collator-7" in message and client.instance[:8] in message, message
        assert "--shm-reserve-max" in message and "MiB" in message, message
        assert "b'" not in message and "\\x" not in message, message


def test_a_warm_put_commits_nothing_again(make_server, monkeypatch):
    srv = make_server()
    calls: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: calls.append(a[2]) or real(*a))
    x = torch.ones(1, MiB)
    with QueueClient(srv.address, timeout_s=30, shm_min_bytes=0) as client:
        client.put("warm-0", ["a"], {"x": x})
        client.clear("warm-0")
        assert len(calls) == 1 and calls[0] >= 4 * MiB  # the whole put, in one call
        for r in range(1, 6):  # a segment lent again has its pages: nothing to commit
            client.put(f"warm-{r}", ["a"], {"x": x})
            assert torch.equal(client.get(f"warm-{r}", ["a"], ["x"])["fields"]["x"], x)
            client.clear(f"warm-{r}")
        pool = client.stats()["shm_pool"]
        assert client._shm.puts == 6 and pool["reused"] >= 1, pool
        # (a segment whose get reply was still on its way out is not lent: a new one is made)
        assert len(calls) == pool["created"], (calls, pool)
