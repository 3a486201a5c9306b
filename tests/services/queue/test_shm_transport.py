"""Same-host puts through shared memory: identical data, adoption, no leaks, bad handles, capacity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgpack
import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from services.queue.shm_transport import ShmPuts, is_same_host, shares_server_shm
from tests.services.queue.conftest import ROOT
from tests.services.queue.test_server import raw_request
from xtoken_core.ipc import SHM_DIR
from xtoken_core.ipc.shm import ShmSegment, sweep_orphans
from xtoken_core.wire import JaggedColumn, encode_message
from xtoken_core.wire.shm import EXT_SHM_TENSOR


def w1_fields(n: int, seed: int = 0, width: int = 64):
    """W1-like samples: int64 ids [L] and float32 hidden [L, width] per sample, jagged."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 400, (n,), generator=g).tolist()
    ids = JaggedColumn.from_rows([torch.randint(0, 50_000, (L,), generator=g) for L in lengths])
    hidden = JaggedColumn.from_rows([torch.randn(L, width, generator=g) for L in lengths])
    return {"ids": ids, "hidden": hidden, "score": torch.randn(n, generator=g)}


def my_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"xtk_{os.getpid()}_")}


def test_same_host_addresses():
    assert is_same_host("tcp://127.0.0.1:5555") and is_same_host("ipc:///tmp/q.sock")
    assert is_same_host("tcp://localhost:1") and is_same_host("tcp://[::1]:1")
    assert not is_same_host("tcp://10.1.2.3:5555") and not is_same_host("tcp://queue:5555")
    remote = ShmPuts("tcp://queue:5555", "auto", 1)
    assert remote._probe_first and not ShmPuts("tcp://127.0.0.1:5555", "auto", 1)._probe_first
    assert not ShmPuts("tcp://queue:5555", "never", 1).enabled
    assert ShmPuts("tcp://127.0.0.1:5555", "auto", 1).enabled
    assert ShmPuts("ipc:///tmp/q.sock", "auto", 1).enabled  # the pool beats a unix socket too
    assert ShmPuts("tcp://queue:5555", "always", 1).enabled
    with pytest.raises(ValueError, match="shm="):
        ShmPuts("tcp://127.0.0.1:1", "sometimes", 1)


def test_the_shm_probe_matches_only_its_own_nonce_in_a_visible_segment():
    nonce = "0123456789abcdef0123456789abcdef"
    with ShmSegment.create(len(nonce)) as seg:
        seg.view(0, torch.uint8, (len(nonce),)).copy_(torch.tensor(list(nonce.encode())))
        assert shares_server_shm({"name": seg.name, "nonce": nonce})
        assert not shares_server_shm({"name": seg.name, "nonce": nonce[::-1]})
        assert not shares_server_shm({"name": seg.name, "nonce": "short"})
    assert not shares_server_shm({"name": seg.name, "nonce": nonce})  # unlinked: not visible
    for bad in (None, [], {"nonce": nonce}, {"name": "../../etc/passwd", "nonce": nonce}):
        assert not shares_server_shm(bad)


def _any_local_address(address: str) -> str:
    """The same server through tcp://0.0.0.0:PORT: local, but not provably so from the string
    (like tcp://queue:5555 from a container that shares the server's /dev/shm)."""
    return "tcp://0.0.0.0:" + address.rsplit(":", 1)[1]


def test_a_client_at_a_non_loopback_address_uses_the_pool_once_the_probe_proves_shared_shm(server):
    address = _any_local_address(server.address)
    assert not is_same_host(address)
    ids = JaggedColumn.from_rows([torch.arange(1 << 17), torch.arange(5)])
    with QueueClient(address, timeout_s=20) as client:
        client.put("shm-probe", ["a", "b"], {"ids": ids})
        assert client._shm.puts == 1 and client._shm.enabled
        got = client.get("shm-probe", ["a", "b"], shm=True)
        assert client._shm.reader.owns(got["fields"]["ids"].values)  # a view of the pool
    assert [torch.equal(a, b) for a, b in zip(got["fields"]["ids"].rows(), ids.rows())] == [
        True,
        True,
    ]


def test_without_the_probe_segment_a_non_loopback_client_sends_frames(make_server):
    srv = make_server("--capacity", "64MiB")
    with QueueClient(srv.address, timeout_s=20) as first:
        probe = first.hello()["shm_probe"]
    os.unlink(os.path.join(SHM_DIR, probe["name"]))  # as if the server's /dev/shm were private
    big = {"x": torch.ones(2, 1 << 18)}
    with QueueClient(_any_local_address(srv.address), timeout_s=20) as client:
        assert client.put("no-probe", ["a", "b"], big)["written"] == 2
        assert client._shm.puts == 0 and not client._shm.enabled
        got = client.get("no-probe", ["a", "b"], shm=True)
    assert torch.equal(got["fields"]["x"], big["x"])
    assert "Traceback" not in srv.log()


def test_put_via_shm_and_claim_via_frames_return_identical_data(server):
    keys = [f"k{i}" for i in range(12)]
    fields = w1_fields(len(keys))
    with QueueClient(server.address, timeout_s=20, shm="always") as producer:
        reply = producer.put("shm-identical", keys, fields)
        assert producer._shm.puts == 1
    assert reply["written"] == 3 * len(keys)
    assert not my_segments()  # adopted by the server, nothing left behind
    with QueueClient(server.address, timeout_s=20, shm="never") as consumer:
        got = consumer.claim("shm-identical", "t", ["ids", "hidden", "score"], len(keys))
    order = [keys.index(k) for k in got["keys"]]
    assert sorted(order) == list(range(len(keys)))
    for name in ("ids", "hidden"):
        want = [fields[name].row(i) for i in order]
        assert [torch.equal(a, b) for a, b in zip(got["fields"][name].rows(), want)] == [True] * 12
    assert torch.equal(got["fields"]["score"], fields["score"][order])


def test_auto_mode_uses_shm_only_above_the_threshold(server):
    small = JaggedColumn.from_rows([torch.ones(16)])
    big = JaggedColumn.from_rows([torch.ones(1 << 15)])
    with QueueClient(server.address, timeout_s=20, shm="auto", shm_min_bytes=1 << 16) as client:
        client.put("shm-auto", ["small"], {"x": small})
        assert client._shm.puts == 0
        client.put("shm-auto", ["big"], {"x": big})
        assert client._shm.puts == 1
        got = client.get("shm-auto", ["big", "small"])
    assert got["fields"]["x"].lengths().tolist() == [1 << 15, 16]
    assert not my_segments()


def test_auto_mode_falls_back_to_frames_and_always_mode_raises(server):
    fields = {"x": torch.ones(2, 1 << 18)}
    with QueueClient(server.address, timeout_s=20, shm="auto") as client:
        client._shm.server = {"shm": False}  # as if the server had not advertised shm
        assert client.put("shm-fallback", ["a", "b"], fields)["written"] == 2
        assert not client._shm.enabled and client._shm.puts == 0
    with QueueClient(server.address, timeout_s=20, shm="always") as client:
        client._shm.server = {"shm": False}
        with pytest.raises(QueueError, match="shm='always'"):
            client.put("shm-fallback", ["c"], {"x": torch.ones(1, 4)})


CHILD = r"""
import sys, time, zmq, torch
from xtoken_core.wire import decode_message, encode_message
from xtoken_core.wire.shm import fields_to_shm
segment, fields = fields_to_shm({"x": torch.arange(300_000, dtype=torch.int64).view(3, -1)})
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send_multipart(encode_message(
    "put", {"partition": "shm-killed", "keys": ["a", "b", "c"], "fields": fields}, request_id=2))
reply = decode_message(sock.recv_multipart())
print(segment.name, reply.body["code"], flush=True)
time.sleep(60)  # killed here: it never unlinks its segment
"""


def test_a_producer_segment_is_refused_and_its_orphan_is_swept_after_the_producer_dies(server):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, server.address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    name, code = proc.stdout.readline().split()
    assert name.startswith(f"xtk_{proc.pid}_") and code == "bad_body"
    assert os.path.exists(os.path.join(SHM_DIR, name))  # not adopted by the server
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    with QueueClient(server.address, timeout_s=20) as client:
        assert "shm-killed" not in client.list()["partitions"]
    assert name in sweep_orphans(min_age_s=0)


@pytest.mark.parametrize(
    "payload",
    [
        ["int64", [4], "xtk_1_0123456789abcdef", 64, 0],  # no such segment
        ["int64", [4], "../../etc/passwd", 64, 0],  # not an xtoken name
        ["int64", [4], "xtk_1_0123456789abcdef"],  # malformed
    ],
)
def test_a_garbage_shm_handle_gets_bad_body_and_the_server_goes_on(server, payload):
    frames = encode_message("put", {"partition": "shm-bad", "keys": ["a"], "fields": {}})
    body = msgpack.packb(
        {
            "partition": "shm-bad",
            "keys": ["a"],
            "fields": {"x": msgpack.ExtType(EXT_SHM_TENSOR, msgpack.packb(payload))},
        }
    )
    reply = raw_request(server.address, [frames[0], body])
    assert reply.msg_type == "error" and reply.body["code"] == "bad_body"
    assert reply.body["message"].startswith("shm:")
    with QueueClient(server.address, timeout_s=10) as client:
        assert client.hello()["shm_pool"] is True


def test_capacity_counts_the_pool_segment_and_a_refused_put_leaks_nothing(make_server):
    srv = make_server("--capacity", "3MiB")
    with QueueClient(srv.address, timeout_s=20, shm="always") as client:
        half = {"x": torch.zeros(1, 1 << 17)}  # 512 KiB: within the per-client reserve bound
        client.put("cap", ["a"], half, timeout_s=0)
        used = client.stats()["bytes_used"]
        assert 1 << 19 <= used <= (1 << 19) + 128  # the segment, aligned, counted once
        with pytest.raises(QueueError) as e:
            for key in "bcdefg":  # the 7th 512 KiB put does not fit in 3 MiB
                client.put("cap", [key], half, timeout_s=0)
        assert e.value.code == "queue_full" and key == "g"
        assert not my_segments()
        client.clear("cap")
        stats = client.stats()
        assert stats["bytes_used"] == 0
        assert stats["shm_pool"]["held_bytes"] == 3 << 20  # the free segments still count
    with QueueClient(srv.address, timeout_s=20, shm="never") as client:
        # frames that need the room: the free segments are dropped to make it
        client.put("cap", ["c"], {"x": torch.zeros(1, 3 << 18)}, timeout_s=0)
        assert client.stats()["shm_pool"]["segments"] == 0
