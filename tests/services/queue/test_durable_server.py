"""Durable mode (``--data-dir``) with real server processes: samples, consumed sets,
registrations and tombstones survive a SIGKILL and a restart; leases do not."""

from __future__ import annotations

import logging
import os
import signal
import socket

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import StaleEpochError
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire import JaggedColumn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids(keys):
    return {"ids": JaggedColumn.from_rows([torch.arange(5) + int(k[1:]) for k in keys])}


def kill(server: ServerProcess) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    server.stop()


@pytest.mark.parametrize("fsync", ["interval", "always"])
def test_state_survives_a_sigkill_and_a_restart_on_the_same_data_dir(tmp_path, fsync):
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ("--bind", address, "--data-dir", str(tmp_path / "data"), "--fsync", fsync)
    first = ServerProcess(tmp_path, *args)
    second = None
    try:
        with QueueClient(address, timeout_s=5, retries=5) as c:
            hello = c.hello()
            assert hello["durable"] and not hello["shm_pool"]
            keys = [f"k{i}" for i in range(10)]
            c.put("p", keys, ids(keys))
            c.put("kept", ["k100"], ids(["k100"]))  # no registered task: kept once consumed
            got = c.claim("p", "train", ["ids"], 4, register=True)
            c.ack("p", "train", got["lease_id"])  # retention drops k0..k3
            leased = c.claim("p", "train", ["ids"], 2)  # k4, k5: leased, never acked
            got = c.claim("kept", "t", ["ids"], 1)
            c.ack("kept", "t", got["lease_id"])
            c.clear("p", ["k9"])
            old = c.epoch
            kill(first)
            second = ServerProcess(tmp_path, *args)
            assert c.list("p")["keys"] == [f"k{i}" for i in range(4, 9)]
            assert c.epoch != old and c.epoch_changes == 1
            with pytest.raises(StaleEpochError, match="durable"):
                c.ack("p", "train", leased["lease_id"])
            status = c.status("p", "train")
            assert status["registered"] and status["dropped"] == 4 and status["consumed"] == 0
            # leases are gone: k4 and k5 are claimable again, consumed keys stay consumed
            again = c.claim("p", "train", ["ids"], 10)
            assert again["keys"] == [f"k{i}" for i in range(4, 9)]
            assert again["fields"]["ids"].values[:5].tolist() == [4, 5, 6, 7, 8]
            assert c.put("p", ["k0", "k1"], ids(["k0", "k1"]))["consumed"] == 2
            assert c.status("kept", "t")["consumed"] == 1
            assert c.list("kept")["keys"] == ["k100"]
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_clean_restart_recovers_too_and_reports_it(tmp_path):
    args = ("--data-dir", str(tmp_path / "data"))
    first = ServerProcess(tmp_path, *args)
    with QueueClient(first.address, timeout_s=5) as c:
        c.put("p", ["k1", "k2"], ids(["k1", "k2"]))
    assert first.terminate() == 0
    first.stop()
    second = ServerProcess(tmp_path, *args)
    try:
        with QueueClient(second.address, timeout_s=5) as c:
            assert c.list("p")["keys"] == ["k1", "k2"]
        assert "recovered 2 samples" in second.log()
    finally:
        second.stop()


def test_a_durable_restart_is_not_reported_as_lost_samples(tmp_path, caplog):
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ("--bind", address, "--data-dir", str(tmp_path / "data"), "--fsync", "always")
    first = ServerProcess(tmp_path, *args)
    second = None
    try:
        with QueueClient(address, timeout_s=5, retries=5) as c:
            c.put("p", ["k1"], ids(["k1"]))  # answered once fsynced: survives the SIGKILL
            kill(first)
            second = ServerProcess(tmp_path, *args)
            with caplog.at_level(logging.WARNING, logger="services.queue.client"):
                assert c.list("p")["keys"] == ["k1"]  # the sample is there
        lines = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "durable" in lines[0] and "samples and what was acked are kept" in lines[0]
        assert "samples and leases are gone" not in lines[0]
        assert c.server_durable is True
    finally:
        first.stop()
        if second is not None:
            second.stop()
