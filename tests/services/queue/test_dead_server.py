"""A dead, hung or restarted server is noticed within 2 s (the connection drops or ZMTP
heartbeats go unanswered): the request in flight is sent again at once, to the replacement if
one comes up, a client told to stop gives up at once, and a stopping one sends nothing again,
nor anything into a connection that dropped while it was idle (real server processes)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire import JaggedColumn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ids(n, length=1000):
    return {"ids": JaggedColumn.from_rows([torch.arange(length) + i for i in range(n)])}


def wait_for(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _claim_in_thread(client: QueueClient, result: dict) -> threading.Thread:
    """A 60 s claim on a thread of its own (started): ``result`` gets its ``error`` (a
    QueueError) and the time ``t`` it returned."""

    def claim():
        try:
            client.claim("p", "t", ["ids"], 1, timeout_s=60)
        except QueueError as e:
            result["error"] = e
        result["t"] = time.monotonic()

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    return thread


def test_a_put_parked_on_a_server_that_is_sigkilled_lands_on_its_replacement_at_once(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = ServerProcess(tmp_path, "--bind", address, "--capacity", "100KB")
    second = None
    result: dict = {}
    try:
        with QueueClient(address, timeout_s=30, retries=1, shm="never") as c:
            c.put("p", [f"a{i}" for i in range(12)], ids(12))  # 96 KB: the next put waits

            def put():
                try:
                    result["reply"] = c.put("p", ["b0"], ids(1), timeout_s=60)
                except QueueError as e:
                    result["error"] = e
                result["t"] = time.monotonic()

            thread = threading.Thread(target=put, daemon=True)
            thread.start()
            time.sleep(0.5)
            assert not result  # parked on the first server
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            assert wait_for(lambda: c.disconnects >= 1, 2.0), "a dead server went unnoticed"
            second = ServerProcess(tmp_path, "--bind", address, "--capacity", "100KB")
            ready = time.monotonic()
            thread.join(10)
            assert "error" not in result, result.get("error")
            assert result["reply"]["new_samples"] == 1
            assert result["t"] - ready < 2.0  # not the 30 s reply timeout
            assert c.epoch_changes == 1 and c.list("p")["keys"] == ["b0"]
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_client_waiting_on_a_dead_server_stops_at_once_when_told(tmp_path):
    server = ServerProcess(tmp_path)
    stop = threading.Event()
    result: dict = {}
    try:
        with QueueClient(server.address, timeout_s=30, retries=3, stop=stop) as c:
            c.hello()
            thread = _claim_in_thread(c, result)
            time.sleep(0.3)
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            assert wait_for(lambda: c.disconnects >= 1, 2.0)
            t0 = time.monotonic()
            stop.set()
            thread.join(5)
            assert result["t"] - t0 < 0.5
            assert result["error"].code == "stopped" and not result["error"].retryable
    finally:
        server.stop()


def test_a_stopping_client_takes_a_live_servers_reply_but_sends_nothing_again(tmp_path):
    """``stopping`` (a worker's SIGTERM): a claim waiting at a live server ends as usual, one
    whose server dies raises ``stopped`` at once, not sent again (30 s + 60 s per try, 4 tries)."""
    server = ServerProcess(tmp_path)
    stopping = threading.Event()
    result: dict = {}
    try:
        with QueueClient(server.address, timeout_s=30, retries=3, stopping=stopping) as c:
            c.put("p", ["a0"], ids(1))
            stopping.set()
            assert c.claim("p", "t", ["ids"], 1, timeout_s=5)["keys"] == ["a0"]
            assert c.claim("p", "t", ["ids"], 1, timeout_s=0.5)["keys"] == []  # waited: no error
            thread = _claim_in_thread(c, result)
            time.sleep(0.3)
            t0 = time.monotonic()
            os.kill(server.proc.pid, signal.SIGKILL)
            thread.join(10)
            assert result["t"] - t0 < 2.5  # the drop is noticed within ~2 s
            assert result["error"].code == "stopped" and not result["error"].retryable
            assert "not sent again (its connection dropped)" in result["error"].message
            assert c.disconnects == 0  # no resend
    finally:
        server.stop()


def test_a_stopping_client_whose_idle_connection_dropped_sends_nothing(tmp_path):
    """The queue died while the client was idle (a trainer's step computes while its run stops):
    the next request raises ``stopped`` at once, not sent into a connection that reconnects to
    nothing (where it would wait ``timeout_s`` for no reply)."""
    server = ServerProcess(tmp_path)
    stopping = threading.Event()
    try:
        with QueueClient(server.address, timeout_s=10, retries=2, stopping=stopping) as c:
            c.put("p", ["a0"], ids(1))
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            time.sleep(0.5)  # the drop reaches the client's monitor
            stopping.set()
            t0 = time.monotonic()
            with pytest.raises(QueueError) as exc:
                c.stats()
            assert time.monotonic() - t0 < 1.0
            assert exc.value.code == "stopped" and not exc.value.retryable
            assert "stats to " in exc.value.message
            assert "not sent (its connection dropped): this client is stopping" in exc.value.message
    finally:
        server.stop()


def test_a_hung_server_is_noticed_by_heartbeats_within_two_seconds(tmp_path):
    server = ServerProcess(tmp_path)
    try:
        with QueueClient(server.address, timeout_s=30, retries=3) as c:
            c.hello()
            result: dict = {}
            thread = threading.Thread(
                target=lambda: result.setdefault("r", c.claim("p", "t", ["ids"], 1, timeout_s=3)),
                daemon=True,
            )
            thread.start()
            time.sleep(0.3)
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert wait_for(lambda: c.disconnects >= 1, 3.0), "a hung server went unnoticed"
                assert time.monotonic() - t0 < 2.5
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            thread.join(40)
            assert result["r"]["keys"] == []  # the claim sent again timed out normally
    finally:
        server.stop()


def test_a_client_of_a_live_server_counts_no_disconnect(server):
    with QueueClient(server.address, timeout_s=5) as c:
        c.hello()
        assert c.disconnects == 0


def test_a_reservation_of_a_server_that_died_is_made_again_on_its_replacement(tmp_path):
    from xtoken_core.wire.shm import fields_layout_bytes

    address = f"tcp://127.0.0.1:{free_port()}"
    first = ServerProcess(tmp_path, "--bind", address)
    second = None
    try:
        with QueueClient(address, timeout_s=10, retries=2, shm="auto") as c:
            assert c.hello()["shm_pool"]
            fields = ids(4)
            region = c.reserve(fields_layout_bytes(fields))
            values = region.empty((fields["ids"].values.numel(),), torch.int64)
            values.copy_(fields["ids"].values)
            built = {"ids": JaggedColumn(values, fields["ids"].offsets)}
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            second = ServerProcess(tmp_path, "--bind", address)
            reply = c.put("p", ["a", "b", "c", "d"], built, reservation=region)
            assert reply["new_samples"] == 4 and c._shm.rereserved == 1
            got = c.get("p", ["a", "b", "c", "d"])["fields"]["ids"]
            assert torch.equal(got.values, fields["ids"].values)
            assert c.epoch_changes == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()
