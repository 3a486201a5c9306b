"""SampleStore: idempotent puts, field-by-field writes, per-task leases, capacity (no sockets)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.queue.errors import StoreError
from services.queue.store import SampleStore
from xtoken_core.wire.tensors import JaggedColumn


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ids_field(lengths, start=0):
    return JaggedColumn.from_rows(
        [torch.arange(start, start + n, dtype=torch.int64) for n in lengths]
    )


def put_ids(store, partition, keys, lengths=None):
    lengths = lengths or [3] * len(keys)
    return store.put(partition, keys, {"ids": ids_field(lengths)})


def test_put_then_get_returns_rows_in_key_order():
    store = SampleStore(1 << 20)
    store.put("p", ["a", "b", "c"], {"ids": ids_field([2, 3, 1]), "n": torch.tensor([2, 3, 1])})
    batch = store.get("p", ["c", "a"], ["ids", "n"])
    assert batch.keys == ["c", "a"]
    assert batch.fields["n"].tolist() == [1, 2]
    assert batch.fields["ids"].offsets.tolist() == [0, 1, 3]
    assert batch.fields["ids"].values.tolist() == [0, 0, 1]


def test_get_of_one_contiguous_run_is_a_zero_copy_view():
    store = SampleStore(1 << 20)
    hidden = torch.randn(10, 4)
    store.put("p", ["a", "b"], {"h": JaggedColumn(hidden, torch.tensor([0, 4, 10]))})
    out = store.get("p", ["a", "b"], ["h"]).fields["h"]
    assert out.values.data_ptr() == hidden.data_ptr()
    assert torch.equal(out.values, hidden)


def test_nested_tensor_input_is_accepted():
    store = SampleStore(1 << 20)
    nt = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    store.put("p", ["a", "b"], {"ids": nt})
    assert store.get("p", ["b"]).fields["ids"].values.tolist() == [0, 1, 2, 3, 4]


def test_repeated_put_of_same_key_is_stored_once():
    store = SampleStore(1 << 20)
    first = put_ids(store, "p", ["a", "b"])
    used = store.bytes_used
    again = put_ids(store, "p", ["a", "b"])
    assert first.stored == 2 and first.new_samples == 2
    assert again.stored == 0 and again.duplicates == 2 and again.nbytes == 0
    assert store.bytes_used == used
    assert store.list("p")["keys"] == ["a", "b"]


def test_partly_duplicate_put_stores_only_new_keys_without_keeping_the_whole_buffer():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a"], [100])
    big = ids_field([100, 1])
    store.put("p", ["a", "b"], {"ids": big})
    # Only row "b" (1 token) is new: the 101-token buffer must not be kept alive.
    assert store.bytes_used < 100 * 8 + 64 + 8 * 2 + 64
    assert store.get("p", ["b"]).fields["ids"].values.tolist() == [0]


def test_field_by_field_writes_add_fields_to_existing_samples():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a", "b"])
    assert store.claim("p", "train", ["ids", "logits"], 4, 10.0) is None
    store.put("p", ["b"], {"logits": torch.ones(1, 5)})
    batch = store.claim("p", "train", ["ids", "logits"], 4, 10.0)
    assert batch.keys == ["b"]
    assert batch.fields["logits"].shape == (1, 5)


def test_get_missing_key_or_field_names_it():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a"])
    with pytest.raises(StoreError, match="'zz'") as exc:
        store.get("p", ["zz"])
    assert exc.value.code == "not_found"
    with pytest.raises(StoreError, match="logits") as exc:
        store.get("p", ["a"], ["logits"])
    assert exc.value.code == "missing_field"


def test_put_rejects_rows_not_matching_keys_and_schema_changes():
    store = SampleStore(1 << 20)
    with pytest.raises(StoreError, match="3 jagged rows"):
        store.put("p", ["a", "b"], {"ids": ids_field([1, 1, 1])})
    with pytest.raises(StoreError, match="duplicate keys"):
        store.put("p", ["a", "a"], {"n": torch.zeros(2)})
    store.put("p", ["a"], {"n": torch.zeros(1)})
    with pytest.raises(StoreError, match="dtype"):
        store.put("p", ["b"], {"n": torch.zeros(1, dtype=torch.int64)})


def test_claim_returns_insertion_order_and_nothing_after_all_consumed():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["k0", "k1", "k2"])
    first = store.claim("p", "t", ["ids"], 2, 10.0)
    second = store.claim("p", "t", ["ids"], 2, 10.0)
    assert first.keys == ["k0", "k1"] and second.keys == ["k2"]
    assert first.lease_id != second.lease_id
    assert store.ack("p", "t", first.lease_id) == 2
    assert store.ack("p", "t", second.lease_id) == 1
    assert store.claim("p", "t", ["ids"], 2, 10.0) is None
    assert store.status("p", "t") == {
        "samples": 3,
        "consumed": 3,
        "leased": 0,
        "pending": 0,
        "leases": 0,
        "dropped": 0,
        "registered": False,
    }


def test_tasks_consume_independently():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a", "b"])
    t1 = store.claim("p", "teacher", ["ids"], 8, 10.0)
    store.ack("p", "teacher", t1.lease_id)
    t2 = store.claim("p", "trainer", ["ids"], 8, 10.0)
    assert t1.keys == t2.keys == ["a", "b"]
    assert store.claim("p", "teacher", ["ids"], 8, 10.0) is None


def test_expired_lease_makes_samples_claimable_again():
    clock = FakeClock()
    store = SampleStore(1 << 20, clock=clock)
    put_ids(store, "p", ["a", "b"])
    lease = store.claim("p", "t", ["ids"], 8, 5.0)
    assert store.claim("p", "t", ["ids"], 8, 5.0) is None
    assert store.next_lease_deadline() == pytest.approx(105.0)
    clock.now += 5.01
    again = store.claim("p", "t", ["ids"], 8, 5.0)
    assert again.keys == ["a", "b"]
    with pytest.raises(StoreError) as exc:
        store.ack("p", "t", lease.lease_id)
    assert exc.value.code == "unknown_lease"
    assert store.ack("p", "t", again.lease_id) == 2


def test_nack_and_partial_ack_release_only_the_named_keys():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a", "b", "c"])
    lease = store.claim("p", "t", ["ids"], 3, 10.0)
    store.ack("p", "t", lease.lease_id, ["b"])
    store.nack("p", "t", lease.lease_id, ["a"])
    assert store.claim("p", "t", ["ids"], 3, 10.0).keys == ["a"]
    assert store.status("p", "t")["consumed"] == 1
    with pytest.raises(StoreError, match="not in lease"):
        store.ack("p", "t", lease.lease_id, ["a"])


def test_put_beyond_capacity_blocks_until_clear_frees_bytes():
    store = SampleStore(200)
    assert not store.put("p", ["a"], {"x": torch.zeros(1, 20)}).blocked  # 80 bytes
    assert not store.put("p", ["b"], {"x": torch.zeros(1, 20)}).blocked
    blocked = store.put("p", ["c"], {"x": torch.zeros(1, 20)})
    assert blocked.blocked and blocked.nbytes == 80
    assert store.list("p")["keys"] == ["a", "b"]
    assert store.clear("p", ["a"]) == 1
    assert store.bytes_used == 80
    assert not store.put("p", ["c"], {"x": torch.zeros(1, 20)}).blocked


def test_put_larger_than_capacity_is_refused_naming_capacity():
    store = SampleStore(100)
    with pytest.raises(StoreError, match="--capacity") as exc:
        store.put("p", ["a"], {"x": torch.zeros(1, 100)})
    assert exc.value.code == "queue_full" and not exc.value.retryable
    assert str(exc.value) == (
        "a sample of 400 B is larger than the whole queue capacity (100 B): restart the queue "
        "server with a larger --capacity (more than 400 B a sample)"
    )


def test_put_of_many_samples_larger_than_capacity_says_in_human_sizes_how_to_fit():
    store = SampleStore(3 << 20)
    with pytest.raises(StoreError) as exc:
        store.put("p", [f"k{i}" for i in range(4)], {"x": torch.zeros(4, 1 << 18)})  # 4 MiB
    message = str(exc.value)
    assert message.startswith(
        "a put of 4 samples (4.0 MiB, 1.0 MiB a sample on average) is larger than the whole "
        "queue capacity (3.0 MiB): put fewer samples at a time, or restart the queue server "
        "with a larger --capacity (more than 4.0 MiB)"
    )
    assert "bytes" not in message and "b'" not in message


def test_clear_of_part_of_a_block_frees_its_bytes_by_compaction():
    store = SampleStore(1 << 20)
    store.put("p", [f"k{i}" for i in range(10)], {"x": torch.arange(1000.0).reshape(10, 100)})
    assert store.bytes_used == 4000
    store.clear("p", [f"k{i}" for i in range(8)])
    assert store.bytes_used == 800
    assert store.get("p", ["k9"]).fields["x"][0, 0].item() == 900.0
    store.clear("p")
    assert store.bytes_used == 0 and store.list() == {"partitions": {}}


def test_cleared_consumed_key_put_again_is_a_new_sample():
    store = SampleStore(1 << 20)
    put_ids(store, "p", ["a"])
    store.ack("p", "t", store.claim("p", "t", ["ids"], 1, 10.0).lease_id)
    store.clear("p", ["a"])
    put_ids(store, "p", ["a"])
    assert store.claim("p", "t", ["ids"], 1, 10.0).keys == ["a"]


def test_stats_report_partitions_tasks_and_rates():
    clock = FakeClock()
    store = SampleStore(1 << 20, clock=clock, rate_window_s=10.0)
    clock.now += 10.0
    put_ids(store, "p", ["a", "b"])
    store.claim("p", "t", ["ids"], 1, 10.0)
    stats = store.stats()
    assert stats["partitions"]["p"]["samples"] == 2
    assert stats["partitions"]["p"]["bytes"] == stats["bytes_used"] > 0
    assert stats["partitions"]["p"]["tasks"]["t"] == {"consumed": 0, "leased": 1}
    assert stats["rates"]["put_samples_per_s"] == pytest.approx(0.2)
    assert stats["rates"]["claim_samples_per_s"] == pytest.approx(0.1)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    picks=st.lists(st.integers(0, 11), min_size=1, max_size=12),
    split=st.integers(0, 12),
)
def test_get_matches_per_row_reference_for_any_key_order(lengths, picks, split):
    store = SampleStore(1 << 20)
    keys = [f"k{i}" for i in range(len(lengths))]
    rows = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(lengths)]
    split = min(split, len(keys))
    for lo, hi in ((0, split), (split, len(keys))):
        if hi > lo:
            store.put(
                "p",
                keys[lo:hi],
                {
                    "v": JaggedColumn.from_rows(rows[lo:hi]),
                    "d": torch.tensor([float(i) for i in range(lo, hi)]),
                },
            )
    wanted = [keys[i % len(keys)] for i in picks]
    wanted = list(dict.fromkeys(wanted))
    batch = store.get("p", wanted, ["v", "d"])
    col = batch.fields["v"]
    for j, k in enumerate(wanted):
        i = keys.index(k)
        assert torch.equal(col.row(j), rows[i])
        assert batch.fields["d"][j].item() == float(i)


def _decoded(value):
    """A wire-read field as the client sees it (encoded, then decoded as a column/tensor)."""
    from xtoken_core.wire import decode_message, encode_message

    return decode_message(encode_message("reply", {"f": value}), jagged="column").body["f"]


@pytest.mark.parametrize(
    "keys",
    [["a"], ["b", "c"], ["a", "b", "c", "d"], ["d", "a"], ["c", "x", "b"], ["x", "y"]],
    ids=["one-row", "one-run", "whole-block", "two-runs", "three-blocks", "other-put"],
)
def test_wire_reads_carry_the_bytes_of_tensor_reads(keys):
    store = SampleStore(1 << 20)
    hidden = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(24, 2)
    store.put(
        "p",
        ["a", "b", "c", "d"],
        {
            "ids": ids_field([1, 2, 0, 3]),
            "hidden": JaggedColumn(hidden[:6], torch.tensor([0, 1, 3, 3, 6])),
            "n": torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]),
        },
    )
    store.put(
        "p",
        ["x", "y"],
        {
            "ids": ids_field([4, 1], start=50),
            "hidden": JaggedColumn(hidden[6:11], torch.tensor([0, 4, 5])),
            "n": torch.tensor([[9, 9], [0, 0]]),
        },
    )
    tensors = store.get("p", keys).fields
    raw = store.get("p", keys, wire=True).fields
    for name in ("ids", "hidden"):
        got = _decoded(raw[name])
        assert torch.equal(got.values, tensors[name].values), name
        assert torch.equal(got.offsets, tensors[name].offsets), name
    assert torch.equal(_decoded(raw["n"]), tensors["n"])


def test_a_single_run_wire_read_is_a_view_of_the_stored_bytes():
    store = SampleStore(1 << 20)
    values = torch.arange(10, dtype=torch.int64)
    store.put("p", ["a", "b", "c"], {"ids": JaggedColumn(values, torch.tensor([0, 2, 7, 10]))})
    raw = store.get("p", ["b", "c"], wire=True).fields["ids"]
    assert raw.num_rows == 2 and raw.total_rows == 8
    values[2] = 99  # stored zero-copy: the wire read sees the same memory
    assert _decoded(raw).values[0].item() == 99


def test_wire_reads_of_non_contiguous_blocks_fall_back_to_tensors():
    store = SampleStore(1 << 20)
    dense = torch.arange(12).reshape(3, 4).t()[:3]  # [3, 3], not contiguous
    store.put("p", ["a", "b", "c"], {"n": dense})
    got = store.claim("p", "t", ["n"], 2, 60.0, wire=True).fields["n"]
    assert torch.equal(_decoded(got), dense[:2])
