"""A connection without the token costs the server (almost) nothing: it is refused in the ZMTP
handshake before it can send a message, and connections are capped (real servers on loopback)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.queue.auth import TOKEN_ENV, TOKEN_FILE_ENV
from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.wire import encode_message

TOKEN = "s3cret-" + "y" * 32
MIB = 1024**2
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


def _secured(make_server, tmp_path, *args: str):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return make_server("--auth-token-file", str(path), *args, env=_env())


def peak_rss(pid: int) -> int:
    """Peak resident set size of a process so far (VmHWM of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def flood(address: str, n: int, nbytes: int, timeout_s: float = 20.0) -> str:
    """Send ``n`` requests of ``nbytes`` each on a plain DEALER (no token, never a hello).

    Returns:
        ``"answered"`` when the server answered all of them (it took them in), ``"refused"``
        when the connection was refused at its handshake (nothing was sent).
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a DEALER whose only peer refused it has no pipe left to queue on: a send blocks for good
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    monitor = sock.get_monitor_socket(_FAILED)
    sock.connect(address)
    big = memoryview(bytearray(nbytes))
    head = encode_message("stats", {}, request_id=1)
    try:
        for _ in range(n):
            try:
                sock.send_multipart([*head, big], copy=False)
            except zmq.Again:  # refused before this send: the monitor says so below
                break
        answered = 0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = dict(poller.poll(100))
            if monitor in ready:
                recv_monitor_message(monitor)
                return "refused"
            if sock in ready:
                sock.recv_multipart()
                answered += 1
                if answered == n:
                    return "answered"
        raise AssertionError(f"no handshake failure and {answered} of {n} answers")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def test_a_connection_without_the_token_cannot_make_the_server_hold_its_messages(
    make_server, tmp_path
):
    srv = _secured(make_server, tmp_path, "--capacity", "32MiB", "--busy-poll-us", "0")
    with QueueClient(srv.address, timeout_s=10, token=TOKEN, shm="never") as ok:
        ok.put("p", ["warm"], {"x": torch.zeros(1, 1024)})
        base = peak_rss(srv.proc.pid)
        outcome = flood(srv.address, 4, 64 * MIB)
        grown = peak_rss(srv.proc.pid) - base
        print(f"flood {outcome}: server peak RSS +{grown / MIB:.1f} MiB for 4 x 64 MiB sent")
        assert outcome == "refused"
        assert grown < 8 * MIB, grown
        # the server keeps serving the clients that have the token
        assert ok.put("p", ["k"], {"x": torch.ones(1, 1024)})["new_samples"] == 1
    assert srv.proc.poll() is None


def test_connections_past_max_connections_are_refused_naming_the_setting(make_server, tmp_path):
    srv = _secured(make_server, tmp_path, "--max-connections", "2")
    held = [QueueClient(srv.address, timeout_s=5, retries=0, token=TOKEN) for _ in range(2)]
    try:
        for c in held:
            c.stats()  # each holds one open connection
        with QueueClient(srv.address, timeout_s=5, retries=0, token=TOKEN) as extra:
            with pytest.raises(QueueError) as err:
                extra.stats()
            assert err.value.code == "too_many_connections" and err.value.retryable
            assert "--max-connections" in err.value.message
            held.pop().close()
            deadline = time.monotonic() + 10
            while True:  # the server sees the closed connection within moments
                try:
                    assert extra.stats()["requests"] >= 2
                    break
                except QueueError as e:
                    if e.code != "too_many_connections" or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        for c in held:
            c.close()
    assert srv.proc.poll() is None
