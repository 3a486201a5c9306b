"""BatchConsumer(as_tensordict=True): a TensorDict put comes back as padded TensorDict batches,
the same tensors as the dict mode, non-tensor fields as they were put (real server)."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from services.queue.client import QueueClient
from services.queue.consumer import BatchConsumer

FIELDS = ["input_ids", "alignment_student_chunk_id", "hidden", "label", "text", "source"]
LENGTHS = [5, 0, 3, 9, 1]
PAD_ID = 7


def _nested(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _td():
    g = torch.Generator().manual_seed(0)
    td = TensorDict(
        {
            "input_ids": _nested([torch.randint(100, 1000, (k,), generator=g) for k in LENGTHS]),
            "alignment_student_chunk_id": _nested([torch.arange(k) // 2 for k in LENGTHS]),
            "hidden": _nested([torch.randn(k, 4, generator=g) for k in LENGTHS]),
            "label": torch.arange(len(LENGTHS)),
            "text": NonTensorStack.from_list([f"text {i}" for i in range(len(LENGTHS))]),
        },
        batch_size=[len(LENGTHS)],
    )
    td["source"] = "corpus-a"  # NonTensorData: one value for the batch
    return td


def _consume(address, partition, task, *, as_tensordict, shm=False):
    """Every batch of ``partition`` for ``task``, acked, with its lease's keys."""
    out = []
    with BatchConsumer(
        QueueClient(address, timeout_s=20),
        partition,
        task,
        ["input_ids"],
        batch_size=2,
        fields=FIELDS,
        claim_timeout_s=0.2,
        idle_timeout_s=0.6,
        shm=shm,
        student_pad_id=PAD_ID,
        as_tensordict=as_tensordict,
    ) as consumer:
        for batch, lease in consumer:
            out.append((batch, list(lease.keys)))
            assert consumer.ack(lease) == len(lease.keys)
    return out


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
def test_a_tensordict_put_comes_back_as_padded_tensordict_batches(server, shm):
    partition = f"td-consume-{shm}"
    keys = [f"k{i}" for i in range(len(LENGTHS))]
    td = _td()
    with QueueClient(server.address, timeout_s=20) as client:
        assert client.put(partition, keys, td)["new_samples"] == len(keys)
    batches = _consume(server.address, partition, "td", as_tensordict=True, shm=shm)
    seen = []
    for batch, lease_keys in batches:
        assert isinstance(batch, TensorDict) and batch.batch_size == (len(lease_keys),)
        ids, lengths = batch["input_ids"], batch["input_ids_lengths"]
        assert not ids.is_nested and ids.shape[1] == max(int(n) for n in lengths)
        for j, key in enumerate(lease_keys):
            i = keys.index(key)
            n = LENGTHS[i]
            assert int(lengths[j]) == n
            assert torch.equal(ids[j, :n], td["input_ids"][i])
            assert bool((ids[j, n:] == PAD_ID).all())
            chunks = batch["alignment_student_chunk_id"][j]
            assert torch.equal(chunks[:n], td["alignment_student_chunk_id"][i])
            assert bool((chunks[n:] == -1).all())  # the schema's pad, as in the dict mode
            assert torch.equal(batch["hidden"][j, :n], td["hidden"][i])
            assert int(batch["label"][j]) == i
        text = batch.get("text")
        assert isinstance(text, NonTensorStack)
        assert text.tolist() == [f"text {keys.index(k)}" for k in lease_keys]
        assert isinstance(batch.get("source"), NonTensorData) and batch["source"] == "corpus-a"
        seen.extend(lease_keys)
    assert sorted(seen) == keys


def test_the_tensordict_mode_holds_the_dict_modes_tensors(server):
    partition = "td-consume-same"
    keys = [f"k{i}" for i in range(len(LENGTHS))]
    with QueueClient(server.address, timeout_s=20) as client:
        client.put(partition, keys, _td())
    as_td = _consume(server.address, partition, "td", as_tensordict=True)
    as_dict = _consume(server.address, partition, "dict", as_tensordict=False)
    assert [k for _, k in as_td] == [k for _, k in as_dict]  # same claim order
    for (td_batch, _), (dict_batch, _) in zip(as_td, as_dict):
        for name in ("input_ids", "alignment_student_chunk_id", "hidden", "label"):
            assert torch.equal(td_batch[name], dict_batch[name]), name
        for name in ("input_ids", "alignment_student_chunk_id", "hidden"):
            assert torch.equal(td_batch[f"{name}_lengths"], dict_batch[f"{name}_lengths"])
