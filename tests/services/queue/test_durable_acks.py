"""A durable ack that reached the log is honoured after a SIGKILL: resent to the restarted server
it is answered as acked, and its samples are not delivered again."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import StaleEpochError
from tests.services.queue.conftest import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_logged_ack_resent_after_a_sigkill_is_answered_as_acked(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ("--bind", address, "--data-dir", str(tmp_path / "data"))
    first = ServerProcess(tmp_path, *args)
    second = None
    try:
        with QueueClient(address, timeout_s=5, retries=5, shm="never") as c:
            keys = [f"k{i}" for i in range(6)]
            c.put("p", keys, {"x": torch.arange(6).view(6, 1)})
            acked = c.claim("p", "t", ["x"], 2)
            part = c.claim("p", "t", ["x"], 2)
            lost = c.claim("p", "t", ["x"], 1)  # never acked: its samples come back
            # the ack is answered once its record is written: a SIGKILL now cannot lose it
            assert c.ack("p", "t", acked["lease_id"])["count"] == 2
            assert c.ack("p", "t", part["lease_id"], keys=part["keys"][:1])["count"] == 1
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            second = ServerProcess(tmp_path, *args)
            # the same acks again, as a client whose replies the kill took sends them
            assert c.ack("p", "t", acked["lease_id"])["count"] == 2
            assert c.ack("p", "t", part["lease_id"], keys=part["keys"][:1])["count"] == 1
            with pytest.raises(StaleEpochError):  # its ack never reached the log
                c.ack("p", "t", lost["lease_id"])
            again = c.claim("p", "t", ["x"], 10)
            assert sorted(again["keys"]) == sorted([*part["keys"][1:], *lost["keys"], "k5"])
            assert not set(again["keys"]) & set(acked["keys"])
    finally:
        first.stop()
        if second is not None:
            second.stop()
