"""`stats` per-partition bytes: the storage a partition really holds, each buffer counted once."""

from __future__ import annotations

import torch

from services.queue.client import QueueClient
from services.queue.store import SampleStore
from xtoken_core.wire.tensors import JaggedColumn


def test_fields_viewing_one_buffer_count_it_once_per_partition():
    # fields of one received message (or one shm segment) view one buffer
    buf = torch.zeros(4096, dtype=torch.uint8)
    ids = JaggedColumn(buf[:1600].view(torch.int64), torch.tensor([0, 100, 200]))
    hidden = buf[2048:4096].view(torch.float32).reshape(2, 256)
    store = SampleStore(1 << 20)
    store.put("p", ["a", "b"], {"ids": ids, "h": hidden})
    store.put("q", ["a"], {"x": torch.zeros(1, 10)})
    stats = store.stats()
    parts = stats["partitions"]
    assert parts["p"]["bytes"] == 4096 + 3 * 8  # the buffer once + the offsets tensor
    assert parts["q"]["bytes"] == 40
    assert parts["p"]["bytes"] + parts["q"]["bytes"] == stats["bytes_used"]
    # the rows themselves: 2 x 100 tokens of int64 + 8 bytes of offsets each, 2 x 1 KiB
    assert parts["p"]["sample_bytes"] == 2 * (800 + 8) + 2 * 1024


def test_partial_clear_keeps_the_partition_bytes_honest():
    store = SampleStore(1 << 20)
    store.put("p", ["a", "b", "c", "d"], {"x": torch.zeros(4, 256)})
    store.clear("p", ["a"])
    stats = store.stats()
    assert stats["partitions"]["p"]["bytes"] == stats["bytes_used"]
    assert stats["partitions"]["p"]["sample_bytes"] == 3 * 1024


def test_server_partition_bytes_never_exceed_what_the_server_holds(make_server):
    srv = make_server("--capacity", "4MiB")
    fields = {
        f"f{i}": JaggedColumn.from_rows(
            [torch.zeros(1000 + j, dtype=torch.int32) for j in range(8)]
        )
        for i in range(6)
    }
    fields["n"] = torch.arange(8)
    for shm, part in (("never", "frames"), ("always", "shm")):
        with QueueClient(srv.address, shm=shm) as client:
            for b in range(3):
                client.put(part, [f"{b}-{j}" for j in range(8)], fields)
            stats = client.stats()
    parts = stats["partitions"]
    assert parts["frames"]["samples"] == parts["shm"]["samples"] == 24
    assert sum(p["bytes"] for p in parts.values()) <= stats["bytes_used"] <= 4 << 20
    want = 3 * (6 * (8 * 4000 + 28 * 4 + 8 * 8) + 8 * 8)
    for p in parts.values():
        assert want <= p["sample_bytes"] <= p["bytes"] <= 2 * want
