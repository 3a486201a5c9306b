"""QueueClient speaks TensorDict: a TensorDict put by one process comes back equal from another,
claims and gets return views of the received frames, and what msgpack cannot carry is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import services.queue.client as client_mod
from services.queue.client import QueueClient
from tests.services.queue.conftest import ROOT
from tests.services.queue.tensordicts import LENGTHS, assert_rows_equal, keys, sample
from xtoken_core.data_plane.codec import materialize
from xtoken_core.data_plane.tensordict_io import NonTensorLeafError

ALL = ["input_ids", "hidden", "input_lengths", "reward", "meta", "source"]


def _order(got_keys, want_keys):
    return [want_keys.index(k) for k in got_keys]


def test_a_tensordict_put_by_one_process_comes_back_equal_in_another(server):
    part = "td-two-processes"
    writer = subprocess.run(
        [sys.executable, "-m", "tests.services.queue.tensordicts", server.address, part, "7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert writer.returncode == 0, writer.stderr
    want = sample(7)
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        got = client.claim(part, "t", ["input_ids"], len(LENGTHS), fields=ALL, as_tensordict=True)
        assert isinstance(got["fields"], TensorDict)
        assert_rows_equal(got["fields"], want, _order(got["keys"], keys(7)))
        client.ack(part, "t", got["lease_id"])
        back = client.get(part, keys(7)[::-1], as_tensordict=True)
        assert_rows_equal(back["fields"], want, list(range(len(LENGTHS)))[::-1])
        client.clear(part)


def test_a_claim_returns_a_tensordict_of_its_required_fields_and_an_empty_one_on_timeout(server):
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("td-required", keys(1), sample(1))
        got = client.claim("td-required", "t", ["input_ids", "meta"], 8, as_tensordict=True)
        assert sorted(got["fields"].keys()) == ["input_ids", "meta"]
        empty = client.claim(
            "td-required", "t", ["input_ids"], 8, timeout_s=0.05, as_tensordict=True
        )
        assert empty["keys"] == [] and empty["fields"].batch_size == (0,)
        client.clear("td-required")


def test_claimed_jagged_leaves_view_the_received_frames(server, monkeypatch):
    received = []

    def spy(*args, **kw):
        frames = recv(*args, **kw)
        received.append(frames)
        return frames

    recv = client_mod.recv_frames
    monkeypatch.setattr(client_mod, "recv_frames", spy)
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("td-frames", keys(2), sample(2))
        before = len(received)
        got = client.claim("td-frames", "t", ["hidden"], 8, fields=ALL, as_tensordict=True)
        claim_replies = received[before:]
        client.clear("td-frames")
    spans = [
        (np.frombuffer(f.buffer, np.uint8).ctypes.data, len(f.buffer))
        for frames in claim_replies
        for f in frames[2:]
        if hasattr(f, "buffer")
    ]
    for name in ("hidden", "input_ids"):
        ptr = got["fields"].get(name).values().data_ptr()
        assert any(start <= ptr < start + size for start, size in spans), name


def test_claimed_jagged_leaves_view_the_shared_memory_pool(server):
    with QueueClient(server.address, timeout_s=20, shm="always") as client:
        client.put("td-shm", keys(3), sample(3))
        assert client._shm.puts == 1
        got = client.claim("td-shm", "t", ["hidden"], 8, fields=ALL, shm=True, as_tensordict=True)
        assert client._shm.reader.owns(got["fields"].get("hidden").values())
        assert_rows_equal(got["fields"], sample(3), _order(got["keys"], keys(3)))
        client.clear("td-shm")


def test_a_claimed_tensordict_materializes_into_padded_tensors(server):
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("td-pad", keys(4), sample(4))
        got = client.claim("td-pad", "t", ALL, 8, as_tensordict=True)
        client.clear("td-pad")
    batch = materialize(got["fields"], "padded", {"input_ids": -1})
    order = _order(got["keys"], keys(4))
    assert batch["input_ids"].shape == (len(LENGTHS), max(LENGTHS))
    lengths = [LENGTHS[i] for i in order]
    for row, k in zip(batch["input_ids"], lengths, strict=True):
        assert bool((row[k:] == -1).all())
    assert batch["meta"].dtype == object and batch["source"].tolist() == ["corpus-4"] * 4


def test_a_put_of_a_leaf_msgpack_cannot_carry_is_refused_before_it_is_sent(server):
    td = TensorDict(
        {"x": torch.zeros(2), "meta": NonTensorStack(NonTensorData(1), NonTensorData({1j}))}, [2]
    )
    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        with pytest.raises(ValueError, match="'meta'") as refused:
            client.put("td-refused", ["a", "b"], td)
        assert isinstance(refused.value, NonTensorLeafError)
        assert "\n" not in str(refused.value)
        assert client.list("td-refused")["keys"] == []


def test_field_mappings_still_put_and_claim_as_before(server):
    rows = [torch.arange(k) for k in (3, 0)]
    from xtoken_core.wire import JaggedColumn

    with QueueClient(server.address, timeout_s=20, shm="never") as client:
        client.put("td-mapping", ["a", "b"], {"ids": JaggedColumn.from_rows(rows)})
        got = client.claim("td-mapping", "t", ["ids"], 2)
        assert isinstance(got["fields"]["ids"], JaggedColumn)
        client.clear("td-mapping")
