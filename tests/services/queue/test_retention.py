"""Retention in the store: registered tasks hold samples, consumed ones are dropped and their
keys refused as ``consumed`` on a re-put; key tombstones stay compact and bounded (no sockets)."""

from __future__ import annotations

import torch

from services.queue.store import SampleStore
from services.queue.tombstones import KeyTombstones
from xtoken_core.wire.tensors import JaggedColumn


def ids_field(keys, length=4):
    return JaggedColumn.from_rows(
        [torch.full((length,), int(k.split("-")[1]), dtype=torch.int64) for k in keys]
    )


def put(store, partition, keys, length=4):
    return store.put(partition, keys, {"ids": ids_field(keys, length)})


def consume(store, partition, task, n=100):
    batch = store.claim(partition, task, ["ids"], n, lease_s=10)
    assert batch is not None
    store.ack(partition, task, batch.lease_id)
    return batch


def test_a_partition_without_registered_tasks_keeps_consumed_samples():
    store = SampleStore(1 << 20)
    put(store, "p", ["k-0", "k-1"])
    consume(store, "p", "trainer/e0/s0")
    assert store.list("p")["keys"] == ["k-0", "k-1"]  # the next epoch reads them again
    assert store.claim("p", "trainer/e1/s0", ["ids"], 10, lease_s=10).keys == ["k-0", "k-1"]


def test_a_sample_acked_by_the_only_registered_task_is_dropped_and_its_bytes_freed():
    store = SampleStore(1 << 20)
    put(store, "p", ["k-0", "k-1", "k-2"])
    used = store.bytes_used
    batch = store.claim("p", "c", ["ids"], 2, lease_s=10, register=True)
    store.ack("p", "c", batch.lease_id)
    assert store.list("p")["keys"] == ["k-2"]
    assert 0 < store.bytes_used < used
    consume(store, "p", "c")
    assert store.bytes_used == 0
    status = store.status("p", "c")
    assert status["samples"] == 0 and status["dropped"] == 3 and status["registered"]


def test_a_re_put_of_a_consumed_key_is_refused_as_consumed_and_not_redelivered():
    store = SampleStore(1 << 20)
    store.register("p", "c")
    put(store, "p", ["k-0", "k-1"])
    consume(store, "p", "c")
    again = put(store, "p", ["k-0", "k-1"])
    assert not again.blocked and again.consumed == 2 and again.new_samples == 0
    assert store.claim("p", "c", ["ids"], 10, lease_s=10) is None
    assert store.bytes_used == 0


def test_a_put_mixing_consumed_and_new_keys_stores_only_the_new_rows():
    store = SampleStore(1 << 20)
    store.register("p", "c")
    put(store, "p", ["k-0", "k-1"])
    consume(store, "p", "c")
    result = put(store, "p", ["k-1", "k-2", "k-0", "k-3"])
    assert result.consumed == 2 and result.new_samples == 2
    batch = store.get("p", ["k-2", "k-3"], ["ids"])
    assert batch.fields["ids"].values.tolist() == [2] * 4 + [3] * 4


def test_samples_are_dropped_only_once_every_registered_task_consumed_them():
    store = SampleStore(1 << 20)
    store.register("p", "teacher")
    store.register("p", "trainer")
    put(store, "p", ["k-0", "k-1"])
    consume(store, "p", "teacher")
    assert store.list("p")["keys"] == ["k-0", "k-1"]
    consume(store, "p", "trainer")
    assert store.list("p")["keys"] == [] and store.status("p", "teacher")["dropped"] == 2
    assert put(store, "p", ["k-0"]).consumed == 1


def test_an_unregistered_task_neither_holds_nor_drops_samples():
    store = SampleStore(1 << 20)
    store.register("p", "c")
    put(store, "p", ["k-0"])
    consume(store, "p", "monitor")  # not registered: its ack drops nothing
    assert store.list("p")["keys"] == ["k-0"]
    consume(store, "p", "c")
    assert store.list("p")["keys"] == []


def test_get_of_a_dropped_key_says_it_was_consumed():
    store = SampleStore(1 << 20)
    put(store, "p", ["k-0", "k-1"])
    batch = store.claim("p", "c", ["ids"], 1, lease_s=10, register=True)
    store.ack("p", "c", batch.lease_id)
    try:
        store.get("p", ["k-0"])
    except ValueError as e:
        assert "consumed by every registered task" in str(e)
    else:
        raise AssertionError("get of a dropped key succeeded")


def test_clearing_the_whole_partition_forgets_registrations_and_tombstones():
    store = SampleStore(1 << 20)
    store.register("p", "c")
    put(store, "p", ["k-0"])
    consume(store, "p", "c")
    store.clear("p")
    assert put(store, "p", ["k-0"]).new_samples == 1
    consume(store, "p", "c")
    assert store.list("p")["keys"] == ["k-0"]  # "c" is no longer registered


def test_a_stream_ten_times_the_capacity_flows_through_with_bounded_bytes():
    store = SampleStore(64 * 1024)
    store.register("p", "c")
    sample_bytes = 64 * 8
    total = 10 * store.capacity_bytes // sample_bytes
    seen, peak, i = [], 0, 0
    while len(seen) < total:
        while i < total:
            keys = [f"k-{j}" for j in range(i, min(i + 16, total))]
            if put(store, "p", keys, length=64).blocked:
                break
            i += len(keys)
        peak = max(peak, store.bytes_used)
        seen += consume(store, "p", "c", n=24).keys
    assert seen == [f"k-{j}" for j in range(total)]
    assert peak <= store.capacity_bytes and store.bytes_used == 0
    part = store.stats()["partitions"]["p"]
    assert part["dropped"] == total and part["tombstones"] == total
    assert part["tombstone_bytes"] <= 8 * total


def test_tombstones_find_every_added_key_across_merges_and_no_other():
    stones = KeyTombstones()
    added = [f"file/{i // 1000}.jsonl:{i}" for i in range(20_000)]
    for start in range(0, len(added), 777):
        stones.add(added[start : start + 777])
    assert len(stones) == 20_000 and stones.nbytes == 8 * 20_000
    assert all(stones.contains(added[::97]))
    assert not any(stones.contains([f"other:{i}" for i in range(2000)]))


def test_tombstones_past_their_bound_forget_the_oldest_keys():
    stones = KeyTombstones(max_keys=10_000)
    old = [f"old:{i}" for i in range(8192)]
    new = [f"new:{i}" for i in range(8192)]
    stones.add(old)
    stones.add(new)
    assert len(stones) <= 10_000 and stones.forgotten > 0
    assert all(stones.contains(new[:100]))
