"""Claims parked by clients that died or hung lease nothing; waits are bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from tests.services.queue.conftest import ROOT, ServerProcess
from xtoken_core.wire import JaggedColumn

# A client process that parks N claims (one DEALER each, 15 s wait, 60 s lease) and then sleeps.
GHOST = """
import sys, time, zmq
from xtoken_core.wire import encode_message
address, n, partition = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = zmq.Context()
socks = []
for i in range(n):
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    body = {"partition": partition, "task": "t", "required_fields": ["ids"], "batch_size": 2,
            "timeout_ms": 15000, "lease_ms": 60000}
    s.send_multipart(encode_message("claim", body, request_id=1))
    socks.append(s)
print("parked", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server for the module: fast heartbeats, waits bounded to 40 s."""
    flags = ("--heartbeat-s", "0.3", "--max-claim-wait-s", "40", "--max-put-wait-s", "40")
    server = ServerProcess(tmp_path_factory.mktemp("dead"), *flags, "--put-timeout-s", "5")
    yield server
    server.stop()


def ids(n):
    return {"ids": JaggedColumn.from_rows([torch.arange(3) + i for i in range(n)])}


def park_ghost(address, n, partition):
    proc = subprocess.Popen(
        [sys.executable, "-c", GHOST, address, str(n), partition],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "parked"
    return proc


def wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s")


def test_claims_parked_by_a_sigkilled_client_are_dropped_within_seconds(srv):
    ghost = park_ghost(srv.address, 20, "ghost")
    try:
        with QueueClient(srv.address, timeout_s=10) as client:
            wait_for(lambda: client.stats()["parked_claims"] == 20, 10)
            dropped = client.stats()["parked_dropped"]
            os.kill(ghost.pid, signal.SIGKILL)
            ghost.wait(10)
            killed = time.monotonic()
            gone = wait_for(lambda: client.stats()["parked_claims"] == 0, 5)
            assert gone - killed < 3.0
            assert client.stats()["parked_dropped"] - dropped == 20
            client.put("ghost", [f"k{i}" for i in range(40)], ids(40))
            assert client.status("ghost", "t")["leased"] == 0
            got = client.claim("ghost", "t", ["ids"], 40, timeout_s=1)
            assert len(got["keys"]) == 40  # nothing leased to the dead client
    finally:
        ghost.kill()
        ghost.wait(10)


def test_data_arriving_for_a_dead_clients_claims_goes_to_a_live_one_at_once(srv):
    ghost = park_ghost(srv.address, 20, "ghost2")
    try:
        with QueueClient(srv.address, timeout_s=10) as client:
            wait_for(lambda: client.stats()["parked_claims"] == 20, 10)
            os.kill(ghost.pid, signal.SIGKILL)
            ghost.wait(10)
            time.sleep(0.2)  # the connections are closed; the probe may not have run yet
            client.put("ghost2", [f"k{i}" for i in range(40)], ids(40))
            got = client.claim("ghost2", "t", ["ids"], 40, timeout_s=1)
            assert len(got["keys"]) == 40, client.status("ghost2", "t")
    finally:
        ghost.kill()
        ghost.wait(10)


def test_claims_parked_by_a_hung_client_are_dropped_after_missed_heartbeats(srv):
    ghost = park_ghost(srv.address, 5, "hung")
    try:
        with QueueClient(srv.address, timeout_s=10) as client:
            wait_for(lambda: client.stats()["parked_claims"] == 5, 10)
            os.kill(ghost.pid, signal.SIGSTOP)  # alive, connected, silent
            stopped = time.monotonic()
            gone = wait_for(lambda: client.stats()["parked_claims"] == 0, 8)
            assert gone - stopped < 4.0
    finally:
        ghost.kill()
        ghost.wait(10)


def test_a_live_client_waiting_long_keeps_its_parked_claim(srv):
    with QueueClient(srv.address, timeout_s=10) as waiter, QueueClient(srv.address) as other:
        out: dict = {}
        thread = threading.Thread(
            target=lambda: out.update(waiter.claim("live", "t", ["ids"], 4, timeout_s=4.5))
        )
        thread.start()
        time.sleep(2.5)  # several probes and heartbeats pass
        assert other.stats()["parked_claims"] == 1
        other.put("live", ["a", "b"], ids(2))
        thread.join(10)
    assert out["keys"] == ["a", "b"]


@pytest.mark.parametrize(
    ("call", "flag"),
    [
        (lambda c: c.claim("cap", "t", ["ids"], 1, timeout_s=50), "--max-claim-wait-s"),
        (lambda c: c.put("cap", ["a"], ids(1), timeout_s=50), "--max-put-wait-s"),
    ],
)
def test_a_wait_above_the_servers_bound_is_refused_naming_the_bound(srv, call, flag):
    with QueueClient(srv.address, timeout_s=10, shm="never") as client:
        with pytest.raises(QueueError) as err:
            call(client)
    assert err.value.code == "bad_request" and not err.value.retryable
    assert flag in err.value.message and "bound of 40s" in err.value.message


def test_a_default_wait_above_the_bound_is_a_settings_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "queue",
            "serve",
            "--bind",
            "tcp://127.0.0.1:*",
            "--claim-timeout-s",
            "10",
            "--max-claim-wait-s",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--max-claim-wait-s" in proc.stderr + proc.stdout
