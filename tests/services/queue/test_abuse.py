"""Queue abuse stays bounded: refused puts free their payload, leases and reservations are capped,
and a bad request never stops the server (real servers on loopback)."""

from __future__ import annotations

import os
import re
import stat

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError

MIB = 1024**2


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def payload(n_bytes: int, seed: int) -> dict:
    return {"x": torch.full((1, n_bytes // 4), seed, dtype=torch.int32)}


def refuse_puts(c: QueueClient, n: int, timeout_s: float) -> None:
    for i in range(n):
        try:
            c.put("full", [f"r{i}"], payload(4 * MIB, i), timeout_s=timeout_s)
        except QueueError as e:
            assert e.code == "queue_full", e
        else:
            raise AssertionError("a put into a full queue was stored")


def test_refused_puts_free_their_payload_at_once(make_server):
    srv = make_server("--capacity", "32MiB", "--busy-poll-us", "0")
    with QueueClient(srv.address, timeout_s=10, shm="never") as c:
        for i in range(8):  # 32 MiB stored: no 4 MiB put fits any more
            c.put("full", [f"k{i}"], payload(4 * MIB, i))
        refuse_puts(c, 5, 0.0)  # warm the allocator
        refuse_puts(c, 5, 0.01)
        base = rss_bytes(srv.proc.pid)
        refuse_puts(c, 50, 0.0)  # refused at once
        refuse_puts(c, 50, 0.01)  # parked, then refused when their wait ran out
        after = rss_bytes(srv.proc.pid)
        print(f"server RSS {base / MIB:.1f} MiB -> {after / MIB:.1f} MiB after 100 refused puts")
        assert after <= base * 1.05, (base, after)
        assert c.stats()["samples"] == 8


def test_a_lease_above_max_lease_is_refused_naming_the_flag(make_server):
    srv = make_server("--max-lease-s", "600")
    with QueueClient(srv.address, timeout_s=5, shm="never") as c:
        c.put("p", ["k0"], payload(1024, 0))
        with pytest.raises(QueueError) as err:
            c.claim("p", "t", ["x"], 1, lease_s=2**40 / 1000)
        assert err.value.code == "bad_request" and "--max-lease-s" in str(err.value)
        got = c.claim("p", "t", ["x"], 1, lease_s=600)  # the server lives; the bound is allowed
        assert got["keys"] == ["k0"]


def test_fresh_instance_ids_do_not_multiply_the_reservation_cap(make_server):
    srv = make_server("--capacity", "64MiB", "--shm-reserve-max", "16MiB")
    # one process posing as four clients: a fresh instance id on each connection
    posers = [QueueClient(srv.address, timeout_s=5, instance=f"fresh-{i}") for i in range(4)]
    honest = QueueClient(srv.address, timeout_s=5, instance="producer")
    try:
        held = [posers[0].reserve(12 * MIB, timeout_s=0)]
        for c in posers[1:]:
            with pytest.raises(QueueError) as err:
                held.append(c.reserve(12 * MIB, timeout_s=0))
            assert err.value.code == "shm_busy" and err.value.retryable
            assert "--shm-reserve-max" in str(err.value)
        # an honest put is not blocked: it goes as frames while the reservations hold the cap
        put = honest.put("p", ["k0"], payload(8 * MIB, 0), timeout_s=0)
        assert put["new_samples"] == 1
        assert honest.get("p", ["k0"])["fields"]["x"].sum().item() == 0
    finally:
        for c in [*posers, honest]:
            c.close()


def test_pool_segments_are_private_to_the_user_under_unguessable_names(make_server):
    srv = make_server("--capacity", "64MiB")
    with QueueClient(srv.address, timeout_s=5) as c:
        regions = [c.reserve(1 * MIB, timeout_s=0) for _ in range(2)]
        names = [r.name for r in regions]
        assert names[0] != names[1]
        for name in names:
            assert re.fullmatch(rf"xtk_{srv.proc.pid}_[0-9a-f]{{16}}", name), name
            mode = os.stat(os.path.join("/dev/shm", name)).st_mode
            assert stat.S_IMODE(mode) == 0o600, oct(mode)
