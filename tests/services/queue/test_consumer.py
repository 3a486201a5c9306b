"""BatchConsumer: prefetching padded batches from a real server, acks, clean stop."""

from __future__ import annotations

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.consumer import BatchConsumer
from xtoken_core.data import sample as schema
from xtoken_core.data.sample import pad_samples
from xtoken_core.wire import JaggedColumn


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


def schema_sample(t: int, u: int, c: int, seed: int) -> dict[str, torch.Tensor]:
    """A jagged sample of the collator's schema; its last tokens belong to no chunk (-1)."""
    g = torch.Generator().manual_seed(seed)
    student_chunk = torch.randint(0, max(c, 1), (t,), generator=g).sort().values
    teacher_chunk = torch.randint(0, max(c, 1), (u,), generator=g).sort().values
    student_chunk[-1:] = -1
    teacher_chunk[-2:] = -1
    return {
        "input_ids": torch.randint(1, 1000, (t,), generator=g),
        "input_lengths": torch.tensor(t),
        "token_mask": torch.ones(t, dtype=torch.bool),
        "sample_mask": torch.tensor(1.0),
        "teacher_input_ids": torch.randint(1, 1000, (u,), generator=g),
        "teacher_input_lengths": torch.tensor(u),
        "teacher_token_mask": torch.ones(u, dtype=torch.bool),
        "alignment_pair_valid": torch.rand(c, generator=g) > 0.2,
        "alignment_pair_is_correct": torch.rand(c, generator=g) > 0.5,
        "alignment_student_exact_partition_mask": torch.rand(t, generator=g) > 0.5,
        "alignment_teacher_exact_partition_mask": torch.rand(u, generator=g) > 0.5,
        "alignment_student_chunk_id": student_chunk,
        "alignment_teacher_chunk_id": teacher_chunk,
        "alignment_num_chunks": torch.tensor(c),
    }


def put_schema_samples(client, partition, samples):
    """Put samples the way a collator does: per-token and per-chunk fields jagged."""
    keys = [f"k{i}" for i in range(len(samples))]
    fields = {}
    for spec in schema.SAMPLE_FIELDS:
        rows = [s[spec.name] for s in samples]
        jagged = spec.axis != schema.SAMPLE
        fields[spec.name] = JaggedColumn.from_rows(rows) if jagged else torch.stack(rows)
    client.put(partition, keys, fields)
    return keys


@pytest.mark.parametrize("pad_ids", [None, (7, 9)], ids=["default-ids", "given-ids"])
def test_default_pad_values_are_the_schemas_chunk_ids_pad_with_minus_one(server, pad_ids):
    """Chunk ids padded with 0 put padding positions into chunk 0 and change the loss (the P-KL
    loss of the README example: 14.7278 vs 14.7209 with -1); the schema says -1."""
    shapes = [(9, 7, 4), (3, 8, 2), (6, 2, 3)]
    samples = [schema_sample(t, u, c, i) for i, (t, u, c) in enumerate(shapes)]
    partition = f"consume-schema-{pad_ids}"
    ids = {} if pad_ids is None else {"student_pad_id": pad_ids[0], "teacher_pad_id": pad_ids[1]}
    with QueueClient(server.address) as client:
        keys = put_schema_samples(client, partition, samples)
        with BatchConsumer(
            client,
            partition,
            "train",
            list(schema.FIELD_NAMES),
            batch_size=len(samples),
            claim_timeout_s=0.2,
            idle_timeout_s=0.6,
            **ids,
        ) as consumer:
            batch, lease = next(consumer)
            consumer.ack(lease)
    student_pad, teacher_pad = pad_ids or (0, 0)
    want = pad_samples(
        [samples[keys.index(k)] for k in lease.keys],
        student_pad_id=student_pad,
        teacher_pad_id=teacher_pad,
    )
    for name in schema.FIELD_NAMES:
        assert batch[name].dtype == want[name].dtype, name
        assert torch.equal(batch[name], want[name]), name
    assert (batch["alignment_student_chunk_id"] == -1).any()
    assert torch.equal(batch["input_ids_lengths"], batch["input_lengths"])
