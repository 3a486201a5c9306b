"""The queue trusts no client with shared memory: a put references only its own reservation,
other segments are refused untouched, consumer views are read-only, reservations are bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from tests.services.queue.conftest import ROOT
from tests.services.queue.test_server import raw_request
from xtoken_core.ipc import SHM_DIR
from xtoken_core.ipc.shm import ShmSegment
from xtoken_core.wire.header import pack_header
from xtoken_core.wire.shm import EXT_SHM_TENSOR


def _ref(name: str, size: int, offset: int = 0) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_SHM_TENSOR, msgpack.packb(["int64", [1, 4], name, size, offset]))


def _put(address: str, partition: str, refs: dict, token=None, request_id: int = 7):
    body = {"partition": partition, "keys": ["a"], "fields": refs}
    if token is not None:
        body["reservation"] = token
    return raw_request(address, [pack_header("put", request_id), msgpack.packb(body)])


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_a_put_naming_a_producer_created_segment_is_refused_and_the_segment_left_alone(server):
    with ShmSegment.create(64) as seg:
        seg.view(0, torch.int64, (4,)).copy_(torch.arange(4))
        for token in (None, "0" * 32):
            reply = _put(server.address, "trust-own", {"x": _ref(seg.name, seg.size)}, token)
            assert reply.msg_type == "error", reply.body
            assert "reserve" in reply.body["message"], reply.body
            assert _exists(seg.name)  # never adopted, never unlinked
        assert torch.equal(seg.view(0, torch.int64, (4,)), torch.arange(4))
    with QueueClient(server.address, timeout_s=10) as client:
        assert client.list("trust-own")["keys"] == []
        assert client.hello()["shm"] is False  # producer segments are not adopted


def test_a_put_naming_the_servers_probe_is_refused_and_the_probe_stays(server):
    with QueueClient(server.address, timeout_s=10, shm_min_bytes=0) as client:
        probe = client.hello()["shm_probe"]["name"]
        region = client.reserve(1 << 16)
        size = os.stat(os.path.join(SHM_DIR, probe)).st_size
        for token in (None, region.token):
            reply = _put(server.address, "trust-probe", {"x": _ref(probe, size)}, token)
            assert reply.msg_type == "error", reply.body
            assert _exists(probe)
        # the reservation was not consumed by the refused put: its owner can still use it
        assert (
            client.put("trust-probe", ["a"], {"x": torch.ones(1, 8)}, reservation=region)["written"]
            == 1
        )
        assert client.hello()["shm_probe"]["name"] == probe and _exists(probe)
        client.clear("trust-probe")


def test_a_put_naming_another_servers_pool_segment_is_refused_untouched(server, make_server):
    other = make_server()
    with (
        QueueClient(other.address, timeout_s=10, shm_min_bytes=0) as theirs,
        QueueClient(server.address, timeout_s=10, shm_min_bytes=0) as ours,
    ):
        foreign = theirs.reserve(1 << 16)
        foreign_view = theirs._shm.writer.segment(foreign.name, foreign.size)
        foreign_view[:8].fill_(7)
        mine = ours.reserve(1 << 16)
        for token in (None, mine.token, foreign.token):
            reply = _put(
                server.address, "trust-foreign", {"x": _ref(foreign.name, foreign.size)}, token
            )
            assert reply.msg_type == "error", reply.body
            assert "not lent by this server" in reply.body["message"], reply.body
            assert _exists(foreign.name)
        assert ours.list("trust-foreign")["keys"] == []
        # the other server still owns and uses its segment
        assert theirs.put("p", ["a"], {"x": torch.ones(1, 8)}, reservation=foreign)["written"] == 1
        assert theirs.stats()["shm_pool"]["segments"] >= 1


def test_a_put_naming_another_clients_reservation_is_refused(server):
    with (
        QueueClient(server.address, timeout_s=10, shm_min_bytes=0) as a,
        QueueClient(server.address, timeout_s=10, shm_min_bytes=0) as b,
    ):
        ra, rb = a.reserve(1 << 16), b.reserve(1 << 16)
        reply = _put(server.address, "trust-other", {"x": _ref(ra.name, ra.size)}, rb.token)
        assert reply.msg_type == "error" and reply.body["code"] == "bad_request"
        assert "outside its reservation" in reply.body["message"]
        # a's reservation is intact
        assert a.put("trust-other", ["a"], {"x": torch.ones(1, 8)}, reservation=ra)["written"] == 1
        a.clear("trust-other")


WRITER = r"""
import sys, torch
from services.queue.client import QueueClient
with QueueClient(sys.argv[1], timeout_s=10, shm_min_bytes=0) as client:
    got = client.get("trust-ro", ["a"], ["x"], shm=True)
    x = got["fields"]["x"]
    assert client._shm.reader.owns(x), "expected a view of the pool"
    print("mapped", flush=True)
    x.fill_(0)
    print("wrote", flush=True)
"""


def test_consumer_views_of_the_pool_are_read_only(server):
    with QueueClient(server.address, timeout_s=10, shm_min_bytes=0) as client:
        want = torch.arange(1 << 16, dtype=torch.int64).view(1, -1)
        client.put("trust-ro", ["a"], {"x": want})
        proc = subprocess.run(
            [sys.executable, "-W", "error", "-c", WRITER, server.address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "mapped" in proc.stdout, proc.stderr
        assert "wrote" not in proc.stdout and proc.returncode == -signal.SIGSEGV, proc.stderr
        assert torch.equal(client.get("trust-ro", ["a"], ["x"])["fields"]["x"], want)
        view = client.get("trust-ro", ["a"], ["x"], shm=True)["fields"]["x"]
        assert client._shm.reader.owns(view) and torch.equal(view, want)
        client.clear("trust-ro")


def test_a_reserve_past_the_reservation_bound_is_refused_at_once(make_server):
    srv = make_server("--capacity", "32MiB")  # shm_reserve_max_bytes: a quarter, 8 MiB
    with QueueClient(srv.address, timeout_s=10, shm_min_bytes=0) as client:
        assert client.hello()["shm_reserve_max_bytes"] == 8 << 20
        t = time.monotonic()
        with pytest.raises(QueueError) as e:
            client.reserve(9 << 20, timeout_s=30)
        assert e.value.code == "bad_request" and "--shm-reserve-max" in e.value.message
        first = client.reserve(6 << 20, timeout_s=30)
        with pytest.raises(QueueError) as e:
            client.reserve(3 << 20, timeout_s=30)  # 6 + 3 > 8 held reserved
        assert e.value.code == "shm_busy" and e.value.retryable
        assert "--shm-reserve-max" in e.value.message
        assert time.monotonic() - t < 5  # answered at once, not after the 30 s wait
        # another instance shares the bound (instance ids prove nothing); its put goes as frames
        with QueueClient(srv.address, timeout_s=10, shm_min_bytes=0, instance="other") as other:
            with pytest.raises(QueueError) as e:
                other.reserve(3 << 20, timeout_s=30)
            assert e.value.code == "shm_busy"
            assert other.put("other", ["o"], {"x": torch.ones(1, 3 << 18)})["written"] == 1
            assert other._shm.busy == 1 and other._shm.puts == 0
            other.clear("other")
        client.put("big", ["a"], {"x": torch.ones(1, 1 << 10)}, reservation=first)
        assert client.reserve(3 << 20, timeout_s=30).nbytes >= 3 << 20  # the put freed it
        # a put larger than the bound travels as frames instead of failing
        puts = client._shm.puts
        assert client.put("big2", ["b"], {"x": torch.ones(1, 9 << 18)})["written"] == 1
        assert client._shm.puts == puts
        client.clear("big")
        client.clear("big2")
