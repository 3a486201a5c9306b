"""The shared-memory pool as a logic object with a real store: lend, store by reference, recycle."""

from __future__ import annotations

import os

import pytest
import torch

from services.queue.errors import StoreError
from services.queue.shm_pool import ShmPool, segment_bytes
from services.queue.store import SampleStore
from xtoken_core.ipc import SHM_DIR
from xtoken_core.ipc.shm import ShmReader, ShmRegion
from xtoken_core.wire import JaggedColumn, decode_message, encode_message
from xtoken_core.wire.shm import fields_into_region, fields_layout_bytes

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def always(_seg) -> bool:
    return True


@pytest.fixture
def pool():
    p = ShmPool(max_free_bytes=64 * MiB, reserve_s=5.0, clock=Clock())
    yield p
    p.close()


def make_store(pool: ShmPool, capacity: int = 256 * MiB) -> SampleStore:
    return SampleStore(
        capacity,
        held=lambda: pool.held_bytes,
        trim=pool.trim,
        on_release=lambda ptr: pool.release(ptr, 0),
    )


def fields(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 200, (n,), generator=g).tolist()
    return {
        "ids": JaggedColumn.from_rows([torch.randint(0, 9, (L,), generator=g) for L in lengths]),
        "hidden": JaggedColumn.from_rows([torch.randn(L, 256, generator=g) for L in lengths]),
    }


def put_through_pool(pool: ShmPool, store: SampleStore, partition: str, keys, value, rid=1):
    """What a producer and the server do for one pooled put; returns the put result."""
    need = fields_layout_bytes(value)
    seg = pool.reserve(need, store.room(), always)
    assert seg is not None
    region = ShmRegion(seg.name, seg.size, seg.base_S, 0, seg.size, seg.token)
    body = {"partition": partition, "keys": keys, "fields": fields_into_region(value, region)}
    reader = ShmReader(segments=pool.views)
    msg = decode_message(encode_message("put", body), jagged="column", shm=reader)
    staged, done = pool.stage(seg.token, rid)
    assert done is None and staged is seg
    pool.check_refs(staged, reader.refs)
    result = store.put(partition, keys, msg.body["fields"], prepaid=seg.size)
    pool.stored(seg, store.holds_storage(seg.ptr, seg.size), rid, {"written": result.stored})
    return result, seg


def test_segment_sizes_round_up_by_at_most_an_eighth():
    for n in (1, 1000, MiB, 41_200_000, 3 * MiB + 1, 1 << 30):
        size = segment_bytes(n)
        assert n <= size <= max(1 << 16, n * 1.125 + 64) and size % 64 == 0


def test_a_pooled_put_is_stored_as_views_of_the_segment_and_counted_once(pool):
    store = make_store(pool)
    value = fields(8, 0)
    result, seg = put_through_pool(pool, store, "p", [f"k{i}" for i in range(8)], value)
    assert result.stored == 16 and seg.state == "stored"
    assert seg.name.startswith(f"xtk_{os.getpid()}_")
    assert store.bytes_used == seg.size and pool.held_bytes == 0  # the store counts it now
    got = store.get("p", [f"k{i}" for i in range(8)])
    assert torch.equal(got.fields["hidden"].values, value["hidden"].values)
    # the ids field shares the segment with hidden: not copied out although it is small
    for name in ("ids", "hidden"):
        assert got.fields[name].values.untyped_storage().data_ptr() == seg.ptr


def test_clear_returns_the_segment_and_later_puts_reuse_it_without_growth(pool):
    store = make_store(pool)
    keys = [f"k{i}" for i in range(8)]
    _, first = put_through_pool(pool, store, "r0", keys, fields(8, 0))
    store.clear("r0")
    assert first.state == "free" and pool.free_bytes == first.size == pool.held_bytes
    for r in range(1, 30):
        _, seg = put_through_pool(pool, store, f"r{r}", keys, fields(8, 0), rid=r + 1)
        assert seg is first
        store.clear(f"r{r}")
    assert pool.created == 1 and pool.reused == 29 and len(pool.segments) == 1


def test_a_partial_clear_keeps_the_segment_until_its_last_sample_goes(pool):
    store = make_store(pool)
    keys = [f"k{i}" for i in range(8)]
    _, seg = put_through_pool(pool, store, "p", keys, fields(8, 1))
    store.clear("p", keys[:2])
    assert seg.state == "stored"
    store.clear("p", keys[2:])
    assert seg.state == "free" and store.bytes_used == 0


def test_a_mostly_cleared_segment_is_copied_down_and_given_back(pool):
    store = make_store(pool)
    keys = [f"k{i}" for i in range(8)]
    value = fields(8, 2)
    _, seg = put_through_pool(pool, store, "p", keys, value)
    store.clear("p", keys[:6])
    assert seg.state == "free"  # the 2 live samples were copied out of it
    got = store.get("p", keys[6:])
    assert got.fields["hidden"].values.untyped_storage().data_ptr() != seg.ptr
    for name in ("ids", "hidden"):
        assert [
            torch.equal(a, value[name].row(i + 6)) for i, a in enumerate(got.fields[name].rows())
        ] == [True, True]


def test_a_put_whose_cells_all_exist_gives_its_segment_back_at_once(pool):
    store = make_store(pool)
    keys = ["a", "b"]
    _, first = put_through_pool(pool, store, "p", keys, fields(2, 0))
    _, second = put_through_pool(pool, store, "p", keys, fields(2, 0), rid=2)
    assert second is not first and second.state == "free" and first.state == "stored"


def test_free_segments_beyond_the_bound_are_unlinked(pool):
    small = ShmPool(max_free_bytes=0, reserve_s=5.0)
    store = make_store(small)
    _, seg = put_through_pool(small, store, "p", ["a"], fields(1, 0))
    path = os.path.join(SHM_DIR, seg.name)
    assert os.path.exists(path)
    store.clear("p")
    assert not os.path.exists(path) and not small.segments and small.held_bytes == 0


def test_reserve_does_not_fit_without_room_but_drops_free_segments_to_make_it(pool):
    store = make_store(pool, capacity=4 * MiB)
    seg = pool.reserve(3 * MiB, store.room(), always)
    assert seg is not None and store.room() == MiB
    assert pool.reserve(2 * MiB, store.room(), always) is None  # back-pressure
    staged, _ = pool.stage(seg.token, 1)
    pool.unstage(staged)  # free, still held: a cache
    assert pool.free_bytes == seg.size and store.room() == 4 * MiB - seg.size
    other = pool.reserve(2 * MiB, store.room(), always)  # too small a request to reuse it
    assert other is not None and seg.name not in pool.segments


def test_a_frame_put_that_needs_room_trims_the_free_pool(pool):
    store = make_store(pool, capacity=4 * MiB)
    seg = pool.reserve(3 * MiB, store.room(), always)
    pool.unstage(pool.stage(seg.token, 1)[0])
    result = store.put("p", ["a"], {"x": torch.zeros(1, MiB // 2)})  # 2 MiB of frames
    assert not result.blocked and not pool.segments and store.bytes_used == 2 * MiB


def test_a_segment_is_not_lent_again_while_replies_sent_before_its_release_are_out(pool):
    store = make_store(pool)
    _, seg = put_through_pool(pool, store, "p", ["a"], fields(1, 0))
    store.clear("p")
    seg.released_seq = 7
    again = pool.reserve(seg.size - 100, store.room(), lambda s: s.released_seq < 7)
    assert again is not seg and seg.state == "free"


def test_bad_tokens_and_refs_are_refused_with_what_to_do(pool):
    store = make_store(pool)
    with pytest.raises(StoreError, match="unknown or expired"):
        pool.stage("f" * 32, 1)
    with pytest.raises(StoreError, match="token of a reserve reply"):
        pool.stage(12, 1)
    _, seg = put_through_pool(pool, store, "p", ["a"], fields(1, 0), rid=5)
    token = next(iter(pool._used_tokens))
    assert pool.stage(token, 5) == (None, {"written": 2})  # a retry: the same reply again
    with pytest.raises(StoreError, match="already used by another put"):
        pool.stage(token, 6)
    other = pool.reserve(MiB, store.room(), always)
    staged, _ = pool.stage(other.token, 7)
    with pytest.raises(StoreError, match="outside its reservation"):
        pool.check_refs(staged, [(seg.name, 0, 64)])
    with pytest.raises(StoreError, match="outside its reservation"):
        pool.check_refs(staged, [(other.name, other.size - 8, other.size + 8)])
    with pytest.raises(StoreError, match="without a reservation"):
        pool.check_refs(None, [(other.name, 0, 64)])
    pool.check_refs(None, [("xtk_1_0123456789abcdef", 0, 64)])  # not ours: adopted elsewhere


def test_an_unused_reservation_expires_and_its_segment_is_unlinked(pool):
    seg = pool.reserve(MiB, 64 * MiB, always)
    assert pool.next_deadline() == pytest.approx(105.0)
    assert pool.expire(104.0) == 0
    path = os.path.join(SHM_DIR, seg.name)
    assert pool.expire(105.0) == 1 and seg.state == "expired"
    assert pool.next_deadline() == pytest.approx(115.0)  # retired for max(reserve_s, 10 s)
    # never lent again (its producer may still write into it), unlinked one period later
    assert pool.reserve(MiB, 64 * MiB, always) is not seg
    assert pool.expire(115.0) == 1 and seg.name not in pool.segments and not os.path.exists(path)
    with pytest.raises(StoreError, match="unknown or expired"):
        pool.stage(seg.token or "0" * 32, 1)


def test_close_unlinks_every_segment(pool):
    store = make_store(pool)
    put_through_pool(pool, store, "p", ["a"], fields(1, 0))
    pool.reserve(MiB, store.room(), always)
    names = list(pool.segments)
    assert len(names) == 2 and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert pool.close() == 2
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
