"""The shared-memory pool through a real server process: puts and claims by reference, recycling,
the views contract, cleanup on SIGTERM and after SIGKILL, and bad handles."""

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
from xtoken_core.ipc.shm import sweep_orphans
from xtoken_core.wire import JaggedColumn
from xtoken_core.wire.header import pack_header
from xtoken_core.wire.shm import EXT_SHM_JAGGED, EXT_SHM_TENSOR, fields_layout_bytes

FIELDS = ["ids", "hidden"]


def w1_like(n: int, seed: int, width: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 600, (n,), generator=g).tolist()
    return {
        "ids": JaggedColumn.from_rows(
            [torch.randint(0, 50_000, (L,), generator=g) for L in lengths]
        ),
        "hidden": JaggedColumn.from_rows([torch.randn(L, width, generator=g) for L in lengths]),
    }


def server_segments(pid: int) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"xtk_{pid}_")}


def same_rows(got: dict, want: dict, order: list[int]) -> bool:
    return all(
        torch.equal(a, want[name].row(i))
        for name in FIELDS
        for a, i in zip(got["fields"][name].rows(), order)
    )


def test_put_and_claim_by_reference_return_identical_data_as_views_of_the_pool(server):
    keys = [f"k{i}" for i in range(16)]
    value = w1_like(len(keys), 0)
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        pid = client.hello()["pid"]
        before = client.stats()["shm_pool"]["created"]
        assert client.put("pool-identical", keys, value)["written"] == 32
        assert client._shm.puts == 1
        got = client.claim("pool-identical", "t", FIELDS, len(keys), shm=True)
        order = [keys.index(k) for k in got["keys"]]
        assert sorted(order) == list(range(16)) and same_rows(got, value, order)
        for name in FIELDS:  # views of the server's segment, mapped by this client
            assert client._shm.reader.owns(got["fields"][name].values)
        frames = client.claim("pool-identical", "t2", FIELDS, len(keys))  # frames: same bytes
        assert same_rows(frames, value, [keys.index(k) for k in frames["keys"]])
        assert not client._shm.reader.owns(frames["fields"]["hidden"].values)
        stats = client.stats()["shm_pool"]
        assert stats["created"] - before <= 1 and stats["by_state"].get("stored", 0) >= 1
        names = server_segments(pid)
        assert names and all(n in set(client._shm.reader._maps) | names for n in names)
        client.clear("pool-identical")


def test_recycling_after_clear_reuses_segments_without_growth(server):
    keys = [f"k{i}" for i in range(8)]
    value = w1_like(len(keys), 1)
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        pid = client.hello()["pid"]
        client.put("pool-recycle-0", keys, value)
        client.clear("pool-recycle-0")
        first = client.stats()["shm_pool"]
        segments = server_segments(pid)
        for r in range(1, 25):
            part = f"pool-recycle-{r}"
            client.put(part, keys, value)
            got = client.claim(part, "t", FIELDS, len(keys), shm=True)
            assert torch.equal(got["fields"]["hidden"].values, value["hidden"].values)
            client.ack(part, "t", got["lease_id"])
            client.clear(part)
        last = client.stats()["shm_pool"]
    assert last["created"] == first["created"] and last["reused"] - first["reused"] == 24
    assert last["segments"] == first["segments"] and server_segments(pid) == segments
    assert len(client._shm.reader._maps) <= first["segments"]


def test_views_show_the_sample_until_it_is_cleared_and_copies_stay_private(server):
    keys = ["a", "b", "c"]
    old, new = w1_like(3, 2), w1_like(3, 2)
    new["hidden"].values.add_(1000.0)  # same sizes: the freed segment is lent again
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        client.put("pool-views", keys, old)
        view = client.get("pool-views", keys, FIELDS, shm=True)
        copy = client.get("pool-views", keys, FIELDS, shm=True, copy=True)
        assert not client._shm.reader.owns(copy["fields"]["hidden"].values)
        assert torch.equal(view["fields"]["hidden"].values, old["hidden"].values)
        client.clear("pool-views")
        client.put("pool-views-2", keys, new)
        # contract: after the clear the view shows whatever the region holds now, never garbage
        assert torch.equal(view["fields"]["hidden"].values, new["hidden"].values)
        assert torch.equal(copy["fields"]["hidden"].values, old["hidden"].values)
        client.clear("pool-views-2")


def test_a_producer_builds_tensors_in_a_reserved_region_without_a_copy(server):
    lengths = [300, 0, 120]
    total = sum(lengths)
    offsets = torch.tensor([0, 300, 300, 420])
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        need = fields_layout_bytes(
            {"hidden": JaggedColumn(torch.empty(total, 32), offsets), "w": torch.empty(3, 4)}
        )
        with client.reserve(need) as region:
            hidden = region.empty((total, 32), torch.float32)
            torch.arange(total * 32, dtype=torch.float32, out=hidden.view(-1))
            w = region.empty((3, 4), torch.bfloat16)
            w.fill_(0.5)
            assert region.locate(hidden) is not None and region.locate(w) is not None
            reply = client.put(
                "pool-in-place",
                ["a", "b", "c"],
                {"hidden": JaggedColumn(hidden, offsets), "w": w},
                reservation=region,
            )
        assert reply["written"] == 6
        got = client.get("pool-in-place", ["a", "b", "c"], shm=True)
        assert torch.equal(
            got["fields"]["hidden"].values, torch.arange(total * 32.0).view(total, 32)
        )
        assert got["fields"]["hidden"].lengths().tolist() == lengths
        assert torch.equal(got["fields"]["w"], torch.full((3, 4), 0.5, dtype=torch.bfloat16))
        with pytest.raises(QueueError, match="already used by another put"):
            client.put("pool-in-place", ["d"], {"w": w[:1]}, reservation=region)
        client.clear("pool-in-place")


def test_without_shared_memory_everything_travels_as_frames(server):
    keys = ["a", "b"]
    value = w1_like(2, 3)
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("pool-off", keys, value)
        assert client._shm.puts == 0
        got = client.claim("pool-off", "t", FIELDS, 2, shm=True, copy=True)  # shm ignored
        assert same_rows(got, value, [keys.index(k) for k in got["keys"]])
        assert not client._shm.reader._maps
        with pytest.raises(QueueError) as e:
            client.reserve(1024)
        assert e.value.code == "shm_unavailable"
    with QueueClient(
        server.address, timeout_s=20, shm_min_bytes=0
    ) as client:  # frames-stored fields via shm=True
        got = client.get("pool-off", keys, shm=True)
        assert same_rows(got, value, [0, 1]) and not client._shm.reader.owns(
            got["fields"]["hidden"].values
        )
        client.clear("pool-off")


def _put_frames(token, refs: dict, request_id: int = 9) -> list[bytes]:
    body = {"partition": "pool-bad", "keys": ["a"], "fields": refs}
    if token is not None:
        body["reservation"] = token
    return [pack_header("put", request_id), msgpack.packb(body)]


def _ext(code: int, payload: list) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload))


def test_bad_reservations_and_handles_get_errors_and_the_server_goes_on(server):
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        region = client.reserve(1 << 20)
        name, size, token = region.name, region.size, region.token
    cases = [
        # ref into the pool without a token
        (None, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1, 4], name, size, 0])}, "bad_request"),
        # unknown token
        ("0" * 32, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1, 4], name, size, 0])}, "bad_request"),
        # out of the segment
        (token, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1, 4], name, size, size - 8])}, "bad_body"),
        # wrong segment size for a pool name
        (token, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1, 4], name, size + 64, 0])}, "bad_body"),
        # jagged with garbage inline offsets
        (
            token,
            {"x": _ext(EXT_SHM_JAGGED, ["int64", [], 1, 4, name, size, 0, b"\x01" * 16])},
            "bad_body",
        ),
        # a name that is not an xtoken segment
        (token, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1], "../../x", 64, 0])}, "bad_body"),
        (token, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1], name])}, "bad_body"),  # malformed
        (12, {"x": _ext(EXT_SHM_TENSOR, ["int64", [1, 4], name, size, 0])}, "bad_body"),
    ]
    for tok, refs, code in cases:
        reply = raw_request(server.address, _put_frames(tok, refs))
        assert reply.msg_type == "error" and reply.body["code"] == code, (tok, reply.body)
    with QueueClient(server.address, timeout_s=20, shm_min_bytes=0) as client:
        assert client.hello()["shm_pool"] is True
        value = w1_like(2, 4)
        client.put("pool-after-bad", ["a", "b"], value)
        got = client.claim("pool-after-bad", "t", FIELDS, 2, shm=True)
        assert same_rows(got, value, [["a", "b"].index(k) for k in got["keys"]])
        assert client.list("pool-bad")["keys"] == []
        client.clear("pool-after-bad")


def test_a_reserve_that_does_not_fit_waits_then_is_queue_full(make_server):
    srv = make_server("--capacity", "4MiB", "--shm-pool-free", "0")
    with QueueClient(srv.address, timeout_s=20, shm_min_bytes=0) as client:
        with pytest.raises(QueueError) as e:
            client.reserve(8 << 20)
        assert e.value.code == "queue_full" and not e.value.retryable
        client.put("cap", ["a"], {"x": torch.zeros(1, 7 << 17)}, timeout_s=0)  # 3.5 MiB, frames
        stats = client.stats()
        assert stats["bytes_used"] == 7 << 19 and stats["shm_pool"]["held_bytes"] == 0
        t = time.monotonic()
        with pytest.raises(QueueError) as e:
            client.reserve(1 << 20, timeout_s=0.3)  # within the 1 MiB per-client bound
        assert e.value.code == "queue_full" and e.value.retryable
        assert time.monotonic() - t >= 0.25
        client.clear("cap")
        assert client.stats()["shm_pool"]["segments"] == 0  # --shm-pool-free 0: unlinked


def test_an_unused_reservation_expires_and_its_put_is_refused(make_server):
    srv = make_server("--shm-reserve-timeout-s", "0.2")
    with QueueClient(srv.address, timeout_s=20, shm_min_bytes=0) as client:
        region = client.reserve(1 << 20)
        time.sleep(0.4)
        assert client.stats()["shm_pool"]["expired"] == 1
        with pytest.raises(QueueError, match="unknown or expired"):
            client.put("late", ["a"], {"x": torch.ones(1, 1024)}, reservation=region)


def test_sigterm_unlinks_the_pool_and_a_sigkilled_servers_pool_is_swept(make_server):
    value = w1_like(4, 5)
    pids = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        srv = make_server()
        with QueueClient(srv.address, timeout_s=20, shm_min_bytes=0) as client:
            client.put("p", ["a", "b", "c", "d"], value)  # stored
            client.reserve(1 << 20)  # outstanding
            client.put("q", ["a"], {"x": torch.ones(1, 1 << 18)})
            client.clear("q")  # free
            hello = client.hello()
            pid, probe = hello["pid"], hello["shm_probe"]["name"]
        assert probe in server_segments(pid) and len(server_segments(pid) - {probe}) == 3
        srv.proc.send_signal(sig)
        srv.proc.wait(20)
        pids.append(pid)
    assert not server_segments(pids[0])  # SIGTERM: unlinked on the way out
    assert len(server_segments(pids[1])) == 4  # SIGKILL: pool + probe left until swept
    removed = sweep_orphans(min_age_s=0)
    assert not server_segments(pids[1]) and len([n for n in removed if str(pids[1]) in n]) == 4


SLOW_READER = r"""
import os, signal, sys, time, torch, zmq
from xtoken_core.wire import decode_message, encode_message
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
claim = {"partition": "pool-race", "task": "slow", "required_fields": ["x"], "batch_size": 2,
         "timeout_ms": 30000}
sock.send_multipart(encode_message("claim", claim, request_id=1))  # parked: no data yet
time.sleep(0.3)
print("parked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # stops reading: the reply will back up in the server
reply = decode_message(sock.recv_multipart())
want = torch.arange(2 * (8 << 20), dtype=torch.int32).view(2, -1)
print("same" if torch.equal(reply.body["fields"]["x"], want) else "corrupted", flush=True)
"""


def test_a_segment_is_not_lent_again_while_a_frames_reply_of_it_is_still_on_its_way(
    make_server,
):
    keys = ["a", "b"]
    old = {"x": torch.arange(2 * (8 << 20), dtype=torch.int32).view(2, -1)}  # 64 MiB
    new = {"x": torch.full((2, 8 << 20), -7, dtype=torch.int32)}
    # a server of its own: --shm-reserve-max (64 MiB here) bounds all clients together, and
    # other tests may still hold reservations on the shared server
    server = make_server("--capacity", "256MiB")
    with QueueClient(server.address, timeout_s=30, shm_min_bytes=0) as producer:
        # a reader whose claim waits for the data, and that stops reading before it arrives:
        # most of its frames reply then waits in the server's zmq queue, zero-copy over the
        # pool segment
        slow = subprocess.Popen(
            [sys.executable, "-c", SLOW_READER, server.address],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert slow.stdout.readline().strip() == "parked"
            deadline = time.monotonic() + 10
            while _state(slow.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.01)
            producer.put("pool-race", keys, old)  # wakes the claim: 64 MiB into a stalled socket
            created = producer.stats()["shm_pool"]["created"]
            time.sleep(0.2)
            producer.clear("pool-race")
            producer.put("pool-race-2", keys, new)  # must not overwrite the bytes being sent
            assert producer.stats()["shm_pool"]["created"] == created + 1
            os.kill(slow.pid, signal.SIGCONT)
            assert slow.stdout.readline().strip() == "same"
        finally:
            slow.kill()
            slow.wait(10)
        producer.clear("pool-race-2")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
