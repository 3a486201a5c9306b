"""AsyncQueueClient against a real server: the same calls as the sync client."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.queue.client import AsyncQueueClient
from services.queue.errors import QueueError
from xtoken_core.wire import JaggedColumn


def test_async_client_puts_claims_and_acks(server):
    async def main():
        async with AsyncQueueClient(server.address, timeout_s=10) as client:
            assert (await client.hello())["protocol_version"] == 1
            ids = JaggedColumn.from_rows([torch.arange(3), torch.arange(2)])
            put = await client.put("async", ["a", "b"], {"ids": ids})
            again = await client.put("async", ["a", "b"], {"ids": ids})
            got = await client.get("async", ["b"])
            claim = await client.claim("async", "t", ["ids"], 8)
            acked = await client.ack("async", "t", claim["lease_id"])
            empty = await client.claim("async", "t", ["ids"], 8, timeout_s=0.1)
            status = await client.status("async", "t")
            with pytest.raises(QueueError) as exc:
                await client.nack("async", "t", claim["lease_id"])
            return put, again, got, claim, acked, empty, status, exc.value

    put, again, got, claim, acked, empty, status, err = asyncio.run(main())
    assert put["written"] == 2 and again["duplicates"] == 2
    assert got["fields"]["ids"].values.tolist() == [0, 1]
    assert claim["keys"] == ["a", "b"] and acked["count"] == 2
    assert empty["keys"] == []
    assert status["consumed"] == 2
    assert err.code == "unknown_lease"


def test_async_client_times_out_naming_the_setting():
    async def main():
        async with AsyncQueueClient("tcp://127.0.0.1:1", timeout_s=0.2, retries=0) as client:
            await client.stats()

    with pytest.raises(QueueError, match="timeout_s") as exc:
        asyncio.run(main())
    assert exc.value.code == "timeout"


def test_a_put_while_another_thread_imports_tensordict_sends_its_fields_as_they_are(monkeypatch):
    """A module still being imported (no classes yet) is in sys.modules: it made no TensorDict."""
    import sys
    import types

    from services.queue.client import _wire_fields

    monkeypatch.setitem(sys.modules, "tensordict", types.ModuleType("tensordict"))
    fields = {"ids": torch.arange(3).reshape(3, 1)}
    assert _wire_fields(["a", "b", "c"], fields) is fields
