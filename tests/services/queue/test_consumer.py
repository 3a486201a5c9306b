"""BatchConsumer: prefetching padded batches from a real server, acks, clean stop."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.queue.client import QueueClient
from services.queue.consumer import BatchConsumer, pad_jagged
from xtoken_core.wire import JaggedColumn


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8), width=st.integers(1, 3))
def test_pad_jagged_matches_per_row_padding(lengths, width):
    rows = [torch.randn(n, width) for n in lengths]
    padded, got_lengths = pad_jagged(JaggedColumn.from_rows(rows), pad_value=-7.0)
    assert got_lengths.tolist() == lengths
    assert padded.shape == (len(lengths), max(lengths), width)
    for i, row in enumerate(rows):
        assert torch.equal(padded[i, : len(row)], row)
        assert bool((padded[i, len(row) :] == -7.0).all())


def put_ids(client, partition, n):
    keys = [f"s{i:03d}" for i in range(n)]
    rows = [torch.arange(1 + i % 4, dtype=torch.int64) + 100 * i for i in range(n)]
    client.put(
        partition, keys, {"input_ids": JaggedColumn.from_rows(rows), "label": torch.arange(n)}
    )
    return keys, rows


def test_consumer_yields_padded_batches_in_order_and_acks(server):
    with QueueClient(server.address) as client:
        keys, rows = put_ids(client, "consume", 10)
        seen = []
        with BatchConsumer(
            client,
            "consume",
            "train",
            ["input_ids", "label"],
            batch_size=4,
            pad_values={"input_ids": -1},
            claim_timeout_s=0.2,
            idle_timeout_s=0.6,
        ) as consumer:
            for batch, lease in consumer:
                ids, lengths = batch["input_ids"], batch["input_ids_lengths"]
                assert ids.shape[0] == len(lease.keys) == batch["label"].shape[0]
                for j, key in enumerate(lease.keys):
                    i = keys.index(key)
                    assert batch["label"][j].item() == i
                    assert torch.equal(ids[j, : lengths[j]], rows[i])
                    assert bool((ids[j, lengths[j] :] == -1).all())
                seen.extend(lease.keys)
                assert consumer.ack() == len(lease.keys)
        assert seen == keys
        status = client.status("consume", "train")
        assert status["consumed"] == 10 and status["leased"] == 0


def test_stop_gives_back_batches_claimed_ahead(server):
    with QueueClient(server.address) as client:
        put_ids(client, "stop", 12)
        consumer = iter(
            BatchConsumer(
                client,
                "stop",
                "train",
                ["input_ids"],
                batch_size=2,
                prefetch=2,
                claim_timeout_s=0.2,
            )
        )
        batch, lease = next(consumer)
        consumer.ack(lease)
        consumer.stop()
        status = client.status("stop", "train")
        assert status["consumed"] == 2
        assert status["leased"] == 0  # prefetched leases were given back
        assert status["pending"] == 10
        assert client.claim("stop", "train", ["input_ids"], 1)["keys"] == ["s002"]


def test_a_shm_consumer_yields_private_batches_that_outlive_the_samples(server):
    n, width = 6, 4096  # 6 x L x 4096 float32: a put of several MiB, through the pool
    lengths = [5, 0, 17, 3, 9, 1]
    rows = [torch.randn(L, width) for L in lengths]
    keys = [f"s{i}" for i in range(n)]
    with QueueClient(server.address, shm_min_bytes=0) as client:
        fields = {"h": JaggedColumn.from_rows(rows), "w": torch.randn(n, 1 << 16)}
        client.put("consume-shm", keys, fields)
        assert client._shm.puts == 1
        with BatchConsumer(
            client,
            "consume-shm",
            "train",
            ["h", "w"],
            batch_size=n,
            idle_timeout_s=0.4,
            claim_timeout_s=0.2,
            shm=True,
        ) as consumer:
            batch, lease = next(consumer)
            consumer.ack(lease)
        client.clear("consume-shm")
        reuse = {"h": JaggedColumn.from_rows([r + 1 for r in rows]), "w": fields["w"] + 1}
        client.put("consume-shm-2", keys, reuse)  # lent the same segment again
        order = [keys.index(k) for k in lease.keys]
        for j, i in enumerate(order):
            assert torch.equal(batch["h"][j, : lengths[i]], rows[i])
            assert torch.equal(batch["w"][j], fields["w"][i])
        client.clear("consume-shm-2")
