"""QueueClient speaks TensorDict: put one, claim or get one back as views, pad it for a trainer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import services.queue.client as client_mod
from services.queue.client import AsyncQueueClient, QueueClient
from xtoken_core.data_plane.tensordict_io import materialize

# every field of _td (a claim returns its required fields unless told which)
ALL = ["input_ids", "alignment_student_chunk_id", "hidden", "input_lengths", "text", "source"]


def _nested(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _td(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    td = TensorDict(
        {
            "input_ids": _nested([torch.randint(1, 1000, (k,), generator=g) for k in lengths]),
            "alignment_student_chunk_id": _nested([torch.arange(k) // 2 for k in lengths]),
            "hidden": _nested([torch.randn(k, 4, generator=g) for k in lengths]),
            "input_lengths": torch.tensor(lengths),
            "text": NonTensorStack.from_list([f"text {i}" for i in range(n)]),
        },
        batch_size=[n],
    )
    td["source"] = "corpus-a"  # NonTensorData: one value for the batch
    return td


def _rows(td, name):
    return list(td.get(name).unbind(0))


def _assert_rows_equal(got, want, order):
    """``got`` holds ``want``'s rows in ``order`` (a claim returns keys in its own order)."""
    assert got.batch_size == torch.Size([len(order)])
    assert sorted(got.keys()) == sorted(want.keys())
    for name in ("input_ids", "alignment_student_chunk_id", "hidden"):
        g, w = got.get(name), want.get(name)
        assert g.is_nested and g.layout == torch.jagged
        assert g.offsets().diff().tolist() == [int(w.offsets().diff()[i]) for i in order]
        for a, i in zip(_rows(got, name), order):
            assert torch.equal(a, _rows(want, name)[i]), name
    assert got.get("input_lengths").tolist() == [int(want["input_lengths"][i]) for i in order]
    assert got.get("text").tolist() == [want.get("text").tolist()[i] for i in order]
    assert isinstance(got.get("source"), NonTensorData) and got["source"] == "corpus-a"


@pytest.mark.parametrize("lengths", [[5, 0, 3, 300], [7], [0, 0]], ids=str)
def test_put_tensordict_then_claim_tensordict_field_by_field(server, lengths):
    part = f"td-roundtrip-{len(lengths)}-{sum(lengths)}"
    keys = [f"k{i}" for i in range(len(lengths))]
    td = _td(lengths)
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        reply = client.put(part, keys, td)
        assert reply["new_samples"] == len(keys)
        got = client.claim(
            part, "t", ["input_ids", "text"], len(keys), fields=ALL, as_tensordict=True
        )
        assert isinstance(got["fields"], TensorDict) and got["lease_id"]
        _assert_rows_equal(got["fields"], td, [keys.index(k) for k in got["keys"]])
        client.ack(part, "t", got["lease_id"])
        back = client.get(part, keys[::-1], as_tensordict=True)
        _assert_rows_equal(back["fields"], td, list(range(len(keys)))[::-1])


def test_claimed_tensordict_views_the_received_frames(server, monkeypatch):
    received = []

    def spy(*args, **kw):
        frames = recv(*args, **kw)
        received.append(frames)
        return frames

    recv = client_mod.recv_frames
    monkeypatch.setattr(client_mod, "recv_frames", spy)
    td = _td([4000, 3000])
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("td-frames", ["a", "b"], td)
        got = client.claim("td-frames", "t", ["hidden"], 2, fields=ALL, as_tensordict=True)[
            "fields"
        ]
    spans = [
        (np.frombuffer(f.buffer, np.uint8).ctypes.data, len(f.buffer))
        for f in received[-1][2:]
        if hasattr(f, "buffer")
    ]
    for name in ("hidden", "input_ids"):
        ptr = got.get(name).values().data_ptr()
        assert any(start <= ptr < start + size for start, size in spans), name


def test_claimed_tensordict_views_the_shared_memory_pool(server):
    td = _td([4000, 3000, 10])
    with QueueClient(server.address, timeout_s=20, shm="always") as client:
        client.put("td-shm", ["a", "b", "c"], td)
        assert client._shm.puts == 1
        got = client.claim("td-shm", "t", ["hidden"], 3, fields=ALL, shm=True, as_tensordict=True)
        assert client._shm.reader.owns(got["fields"].get("hidden").values())
        order = [["a", "b", "c"].index(k) for k in got["keys"]]
        _assert_rows_equal(got["fields"], td, order)
        client.clear("td-shm")


def test_put_tensordict_sends_one_values_and_one_offsets_frame_per_jagged_field(
    server, monkeypatch
):
    sent = []

    def spy(sock, frames, *args, **kw):
        sent.append(list(frames))
        return send(sock, frames, *args, **kw)

    send = client_mod.send_frames
    monkeypatch.setattr(client_mod, "send_frames", spy)
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        for n in (200, 250):  # offsets >= 1 KiB (frames); input_lengths [N] int64: a frame too
            keys = [f"n{n}-{i}" for i in range(n)]
            client.put("td-frame-count", keys, _td([20 + i % 7 for i in range(n)], seed=n))
            # header + body + 4 jagged fields x (values + offsets) + input_lengths; "source"
            # (n rows of 11 bytes) travels as frames too
            assert len(sent[-1]) == 2 + 2 * 5 + 1, n


def test_claim_timeout_gives_an_empty_tensordict(server):
    with QueueClient(server.address, timeout_s=20) as client:
        got = client.claim("td-nothing", "t", ["x"], 4, timeout_s=0.05, as_tensordict=True)
    assert got["keys"] == [] and got["fields"].batch_size == torch.Size([0])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_bad_tensordicts_raise_before_anything_is_sent(server):
    strided = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)])
    with QueueClient(server.address, timeout_s=20) as client:
        with pytest.raises(TypeError, match="'s'"):
            client.put("td-bad", ["a", "b"], TensorDict({"s": strided}, batch_size=[2]))
        with pytest.raises(ValueError, match="3 keys"):
            client.put("td-bad", ["a", "b", "c"], _td([1, 2]))
        assert "td-bad" not in client.list()["partitions"]


def test_plain_fields_still_work_beside_tensordicts(server):
    with QueueClient(server.address, timeout_s=20) as client:
        client.put("td-plain", ["a"], {"x": torch.ones(1, 3)})
        got = client.get("td-plain", ["a"])
    assert torch.equal(got["fields"]["x"], torch.ones(1, 3))


def test_materialize_pads_a_claimed_tensordict_like_the_trainer(server):
    keys = ["a", "b", "c"]
    with QueueClient(server.address, timeout_s=20) as client:
        client.put("td-pad", keys, _td([3, 0, 5]))
        got = client.get("td-pad", keys, as_tensordict=True)["fields"]
    batch = materialize(got, "padded", student_pad_id=0)
    assert batch["input_ids"].shape == (3, 5)
    assert batch["alignment_student_chunk_id"].tolist() == [
        [0, 0, 1, -1, -1],
        [-1] * 5,
        [0, 0, 1, 1, 2],
    ]
    assert batch["hidden"].shape == (3, 5, 4) and batch["text"].tolist()[1] == "text 1"


def test_async_client_puts_and_claims_tensordicts(server):
    td = _td([2, 9])

    async def main():
        async with AsyncQueueClient(server.address, timeout_s=20) as client:
            await client.put("td-async", ["a", "b"], td)
            got = await client.claim(
                "td-async", "t", ["input_ids"], 2, fields=ALL, as_tensordict=True
            )
            back = await client.get("td-async", ["b"], as_tensordict=True)
            return got, back

    got, back = asyncio.run(main())
    _assert_rows_equal(got["fields"], td, [["a", "b"].index(k) for k in got["keys"]])
    _assert_rows_equal(back["fields"], td, [1])
