"""Server instances (epochs): every reply names one; after a SIGKILL and a restart at the same
address a client notices the new instance and an old lease's ack is a typed error."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError, StaleEpochError
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire import JaggedColumn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids(n):
    return {"ids": JaggedColumn.from_rows([torch.arange(3) + i for i in range(n)])}


def test_every_reply_and_error_names_the_server_instance(server):
    with QueueClient(server.address, timeout_s=10) as client:
        epoch = client.hello()["epoch"]
        assert len(epoch) == 16 and client.epoch == epoch
        client.put("ep", ["a"], ids(1))
        got = client.claim("ep", "t", ["ids"], 1)
        assert got["epoch"] == epoch and got["lease_id"].startswith(f"{epoch}:")
        assert client.ack("ep", "t", got["lease_id"])["epoch"] == epoch
        with pytest.raises(QueueError) as err:
            client.get("ep", ["missing"])
        assert err.value.code == "not_found" and client.epoch_changes == 0


def test_a_restarted_server_is_a_new_instance_and_acks_of_old_leases_are_refused(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = ServerProcess(tmp_path, "--bind", address)
    seen: list[tuple] = []
    try:
        with QueueClient(address, timeout_s=3, retries=3, on_epoch=lambda *e: seen.append(e)) as c:
            old = c.hello()["epoch"]
            c.put("ep", ["a", "b"], ids(2))
            lease = c.claim("ep", "t", ["ids"], 2)["lease_id"]
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            second = ServerProcess(tmp_path, "--bind", address)
            try:
                with pytest.raises(StaleEpochError) as err:
                    c.ack("ep", "t", lease)
                assert err.value.code == "stale_epoch" and not err.value.retryable
                assert old in err.value.message and "restarted" in err.value.message
                new = c.epoch
                assert new != old and c.epoch_changes == 1 and seen == [(old, new)]
                with pytest.raises(StaleEpochError):
                    c.nack("ep", "t", lease)
                # the new instance holds nothing of the old one (memory only)
                assert c.list("ep")["keys"] == []
                assert c.hello()["epoch"] == new and c.epoch_changes == 1
            finally:
                second.stop()
    finally:
        first.stop()
