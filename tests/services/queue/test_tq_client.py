"""The TransferQueue-style client: put by partition, read by metadata, write back, clear."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from services.queue.tq_client import BatchMeta, TransferQueueClient
from tests.services.queue.tensordicts import LENGTHS, assert_rows_equal, sample


def test_a_put_tensordict_is_read_back_by_metadata_in_batches(server):
    with TransferQueueClient("tq-test", server.address, timeout_s=20, shm="never") as client:
        client.initialize_storage_manager("SimpleStorage", {"any": "config"})
        want = sample(11)
        put = client.put(data=want, partition_id="tq-read")
        assert put.size == len(LENGTHS) and put.partition_ids == ["tq-read"] * len(LENGTHS)
        seen = []
        while True:
            meta = client.get_meta(
                data_fields=list(want.keys()), batch_size=3, partition_id="tq-read", task_name="a"
            )
            if meta.size == 0:
                break
            assert meta.field_names == list(want.keys())
            got = client.get_data(meta)
            assert_rows_equal(got, want, [put.global_indexes.index(k) for k in meta.keys])
            seen += meta.global_indexes
        assert sorted(seen) == sorted(put.global_indexes)
        assert client.check_consumption_status("a", "tq-read")
        assert not client.check_consumption_status("b", "tq-read")
        client.clear_partition("tq-read")
        assert "tq-read" not in client.get_partition_list()


def test_tasks_consume_independently_and_a_write_back_adds_fields(server):
    with TransferQueueClient("tq-test", server.address, timeout_s=20, shm="never") as client:
        client.put(data=sample(12), partition_id="tq-write")
        meta = client.get_meta(["input_ids"], 2, "tq-write", task_name="rollout")
        other = client.get_meta(["input_ids"], 2, "tq-write", task_name="reward")
        assert meta.keys == other.keys  # put order, for every task
        logp = torch.nested.nested_tensor([torch.randn(3), torch.randn(1)], layout=torch.jagged)
        wrote = client.put(data=TensorDict({"logp": logp}, batch_size=[2]), metadata=meta)
        assert wrote.field_names == ["input_ids", "logp"] and wrote.keys == meta.keys
        got = client.get_data(wrote)
        for a, b in zip(got.get("logp").unbind(0), logp.unbind(0), strict=True):
            assert torch.equal(a, b)
        # only the written samples carry the new field: a consumer of it sees those two
        after = client.get_meta(["logp"], 8, "tq-write", task_name="train")
        assert after.keys == meta.keys
        held = client.client.list("tq-write")["keys"]
        client.clear_samples(after)
        assert client.client.list("tq-write")["keys"] == [k for k in held if k not in meta.keys]
        client.clear_partition("tq-write")


def test_an_empty_partition_gives_an_empty_batch_and_an_empty_tensordict(server):
    with TransferQueueClient("tq-test", server.address, get_timeout_s=0.05) as client:
        meta = client.get_meta(["x"], 4, "tq-empty", task_name="a")
        assert meta.size == 0 and len(meta) == 0
        assert client.get_data(meta).batch_size == (0,)


def test_what_the_queue_does_not_offer_is_refused_in_one_line():
    client = TransferQueueClient("tq-test", "tcp://127.0.0.1:9")
    with pytest.raises(ValueError, match="force_fetch"):
        client.get_meta(["x"], 1, "p", mode="force_fetch")
    with pytest.raises(ValueError, match="sampling_config"):
        client.get_meta(["x"], 1, "p", sampling_config={"n_samples_per_prompt": 4})
    with pytest.raises(ValueError, match="partition_id"):
        client.put(data=TensorDict({}, batch_size=[0]))
    with pytest.raises(TypeError, match="address"):
        TransferQueueClient("tq-test", object())
    client.close()
    assert BatchMeta("p", ["a"]).size == 1
