"""AsyncQueueClient and a dead, hung or restarted server, as QueueClient (test_dead_server.py,
test_epoch.py): noticed within 2 s, the request in flight sent again at once, a ``stop`` (event or
callable) obeyed at once, an old lease's ack a typed error (real server processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
import torch

from services.queue.client import AsyncQueueClient
from services.queue.errors import QueueError, StaleEpochError
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire import JaggedColumn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids(n, length=1000):
    return {"ids": JaggedColumn.from_rows([torch.arange(length) + i for i in range(n)])}


async def wait_for(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return False


async def sigkill(server: ServerProcess) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    await asyncio.to_thread(server.proc.wait, 10)


def test_an_async_put_parked_on_a_sigkilled_server_lands_on_its_replacement_at_once(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = ServerProcess(tmp_path, "--bind", address, "--capacity", "100KB")
    servers = [first]

    async def main():
        async with AsyncQueueClient(address, timeout_s=30, retries=1) as c:
            await c.put("p", [f"a{i}" for i in range(12)], ids(12))  # 96 KB: the next put waits
            parked = asyncio.create_task(c.put("p", ["b0"], ids(1), timeout_s=60))
            await asyncio.sleep(0.5)
            assert not parked.done()  # parked on the first server
            await sigkill(first)
            t0 = time.monotonic()
            assert await wait_for(lambda: c.disconnects >= 1, 2.0), "a dead server went unnoticed"
            assert time.monotonic() - t0 < 2.0
            second = await asyncio.to_thread(
                ServerProcess, tmp_path, "--bind", address, "--capacity", "100KB"
            )
            servers.append(second)
            ready = time.monotonic()
            reply = await asyncio.wait_for(parked, 10)
            landed = time.monotonic()
            assert reply["new_samples"] == 1
            assert landed - ready < 2.0  # not the 30 s reply timeout
            assert c.epoch_changes == 1 and (await c.list("p"))["keys"] == ["b0"]

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize("kind", ["asyncio.Event", "callable"])
def test_an_async_client_waiting_on_a_dead_server_stops_at_once_when_told(tmp_path, kind):
    server = ServerProcess(tmp_path)

    async def main():
        event = asyncio.Event()
        stop = event if kind == "asyncio.Event" else event.is_set
        async with AsyncQueueClient(server.address, timeout_s=30, retries=3, stop=stop) as c:
            await c.hello()
            claim = asyncio.create_task(c.claim("p", "t", ["ids"], 1, timeout_s=60))
            await asyncio.sleep(0.3)
            await sigkill(server)
            assert await wait_for(lambda: c.disconnects >= 1, 2.0)
            t0 = time.monotonic()
            event.set()
            with pytest.raises(QueueError) as err:
                await asyncio.wait_for(claim, 5)
            assert time.monotonic() - t0 < 0.5
            assert err.value.code == "stopped" and not err.value.retryable
            # a stopped client refuses further requests at once, without a server
            with pytest.raises(QueueError, match="told to stop"):
                await c.stats()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_an_async_claim_held_by_a_live_server_stops_at_once_when_told(server):
    async def main():
        stop = asyncio.Event()
        async with AsyncQueueClient(server.address, timeout_s=30, stop=stop) as c:
            claim = asyncio.create_task(c.claim("stop-live", "t", ["ids"], 1, timeout_s=60))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            stop.set()
            with pytest.raises(QueueError) as err:
                await asyncio.wait_for(claim, 5)
            assert time.monotonic() - t0 < 0.5 and err.value.code == "stopped"
            assert c.disconnects == 0

    asyncio.run(main())


def test_an_async_client_notices_a_hung_server_by_heartbeats_within_two_seconds(tmp_path):
    server = ServerProcess(tmp_path)

    async def main():
        async with AsyncQueueClient(server.address, timeout_s=30, retries=3) as c:
            await c.hello()
            claim = asyncio.create_task(c.claim("p", "t", ["ids"], 1, timeout_s=3))
            await asyncio.sleep(0.3)
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert await wait_for(lambda: c.disconnects >= 1, 3.0), (
                    "a hung server went unnoticed"
                )
                assert time.monotonic() - t0 < 2.5
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            reply = await asyncio.wait_for(claim, 40)
            assert reply["keys"] == []  # the claim sent again timed out normally

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_an_async_client_sees_a_restart_and_its_old_leases_acks_are_stale(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = ServerProcess(tmp_path, "--bind", address)
    servers = [first]
    seen: list[tuple] = []

    async def main():
        async with (
            AsyncQueueClient(
                address, timeout_s=3, retries=3, on_epoch=lambda *e: seen.append(e)
            ) as c,
            AsyncQueueClient(address, timeout_s=3, name="prefetch") as prefetch,
        ):
            old = (await c.hello())["epoch"]
            await c.put("ep", ["a", "b"], ids(2, 3))
            lease = (await c.claim("ep", "t", ["ids"], 2))["lease_id"]
            assert c.disconnects == 0
            await sigkill(first)
            second = await asyncio.to_thread(ServerProcess, tmp_path, "--bind", address)
            servers.append(second)
            with pytest.raises(StaleEpochError) as err:
                await c.ack("ep", "t", lease)
            assert err.value.code == "stale_epoch" and not err.value.retryable
            new = c.epoch
            assert new != old and c.epoch_changes == 1 and seen == [(old, new)]
            assert (await c.list("ep"))["keys"] == []  # the new instance holds nothing old
            # another client of this process claims on the new instance; c, dropped while
            # idle, said hello again on reconnecting, so it may ack that lease (same owner)
            await c.put("ep", ["c"], ids(1, 3))
            fresh = (await prefetch.claim("ep", "t", ["ids"], 1))["lease_id"]
            assert (await c.ack("ep", "t", fresh))["count"] == 1

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
