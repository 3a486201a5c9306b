"""Trust no client: a shared token in the hello, leases bound to their claimer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.queue.auth import TOKEN_ENV, TOKEN_FILE_ENV, is_loopback, load_token
from services.queue.client import QueueClient
from services.queue.errors import QueueError
from tests.services.queue.conftest import ROOT
from xtoken_core.wire import decode_message, encode_message

TOKEN = "s3cret-" + "x" * 32


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env.update(extra)
    return env


@pytest.fixture
def secured(make_server, tmp_path):
    """A server that needs TOKEN, given in a file (never on the command line)."""
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return make_server("--auth-token-file", str(path), env=_env())


def _raw(address: str, *frames: bytes, token: str | None = None) -> dict:
    """Send raw frames on a fresh DEALER (no hello; ``token`` in its ZMTP handshake) and return
    the decoded reply."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    if token is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, b"raw")
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    sock.connect(address)
    try:
        sock.send_multipart(list(frames))
        msg = decode_message(sock.recv_multipart())
        return {"type": msg.msg_type, **msg.body}
    finally:
        sock.close()


def refused_at_handshake(address: str, token: str | None = None) -> int:
    """Connect a DEALER (``token`` as its ZMTP PLAIN password) and return the handshake
    failure its monitor reports."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, b"raw")
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    try:
        while monitor.poll(10_000):
            event = recv_monitor_message(monitor)["event"]
            if event & failed:
                return event
            raise AssertionError(f"the handshake succeeded ({event})")
        raise AssertionError("no handshake outcome in 10 s")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def _put(client: QueueClient, partition: str, n: int = 2) -> None:
    keys = [f"k{i}" for i in range(n)]
    client.put(partition, keys, {"ids": torch.arange(n * 3, dtype=torch.int64).view(n, 3)})


def test_a_refusal_seen_before_the_request_is_sent_is_that_requests_refusal(secured):
    """The connection is open (its hello sent) and refused in its handshake before the request
    goes out: the request is refused at once, not sent on a socket that never reconnects."""
    with QueueClient(secured.address, timeout_s=20, retries=0) as anon:
        anon._socket("stats")  # connects and sends the hello, as a request's first step does
        time.sleep(1.0)  # the local server refuses the handshake in milliseconds
        t0 = time.monotonic()
        with pytest.raises(QueueError) as err:
            anon.stats()
    assert err.value.code == "unauthorized"
    assert time.monotonic() - t0 < 15  # refused, not timed out


def test_client_without_token_is_refused_and_server_keeps_serving(secured):
    # the refusal comes in milliseconds; the budget only bounds a host too busy to see it
    with QueueClient(secured.address, timeout_s=30, retries=0) as anon:
        assert anon.token is None
        with pytest.raises(QueueError) as err:
            anon.stats()
    assert err.value.code == "unauthorized"
    assert not err.value.retryable
    assert TOKEN_ENV in err.value.message and "--auth-token-file" in err.value.message
    # a raw client without the token: closed in its handshake, before it sends anything
    assert refused_at_handshake(secured.address) == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert refused_at_handshake(secured.address, "wrong") == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # one with the token that never says hello: every request refused, with an error reply
    body = encode_message("stats", {}, request_id=7)
    reply = _raw(secured.address, *body, token=TOKEN)
    assert reply["type"] == "error" and reply["code"] == "unauthorized"
    with QueueClient(secured.address, timeout_s=5, retries=0, token=TOKEN) as ok:
        assert ok.hello()["auth"] is True
        _put(ok, "auth-anon")
        assert ok.stats()["samples"] >= 2
    assert secured.proc.poll() is None


def test_wrong_token_is_refused(secured):
    # the refusal comes at once; the long timeout only keeps a loaded machine from answering
    # "timeout" first
    with QueueClient(secured.address, timeout_s=20, retries=0, token="wrong") as bad:
        with pytest.raises(QueueError) as err:
            bad.hello()
        assert err.value.code == "unauthorized"
        assert "does not match" in err.value.message
        assert TOKEN_ENV in err.value.message
        with pytest.raises(QueueError) as err:
            bad.list()
        assert err.value.code == "unauthorized"
    with QueueClient(secured.address, timeout_s=5, retries=0, token=TOKEN) as ok:
        assert ok.list()["partitions"] is not None


def test_client_reads_token_from_env(secured, monkeypatch, tmp_path):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with QueueClient(secured.address, timeout_s=5, retries=0) as client:
        assert client.stats()["requests"] >= 1
    monkeypatch.delenv(TOKEN_ENV)
    path = tmp_path / "client-token"
    path.write_text(TOKEN)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    with QueueClient(secured.address, timeout_s=5, retries=0) as client:
        assert client.stats()["requests"] >= 1


def test_garbage_before_hello_gets_an_error_reply(secured):
    reply = _raw(secured.address, b"\x00garbage-header", b"\xff\xfe", token=TOKEN)
    assert reply["type"] == "error"
    reply = _raw(secured.address, b"just one frame", token=TOKEN)
    assert reply["type"] == "error"
    with QueueClient(secured.address, timeout_s=5, retries=0, token=TOKEN) as ok:
        ok.stats()
    assert secured.proc.poll() is None


def test_second_client_cannot_ack_or_nack_the_first_clients_lease(secured):
    a = QueueClient(secured.address, timeout_s=5, retries=0, token=TOKEN, instance="trainer-a")
    b = QueueClient(secured.address, timeout_s=5, retries=0, token=TOKEN, instance="stranger-b")
    try:
        _put(a, "auth-own")
        got = a.claim("auth-own", "t", ["ids"], 2, lease_s=60)
        lease = got["lease_id"]
        epoch, _, secret = lease.partition(":")
        assert epoch == a.epoch and re.fullmatch(r"[0-9a-f]{32}", secret)
        for op in (b.ack, b.nack):
            with pytest.raises(QueueError) as err:
                op("auth-own", "t", lease)
            assert err.value.code == "not_owner"
        # a connection that never said hello is no owner either
        frames = encode_message(
            "ack",
            {"partition": "auth-own", "task": "t", "lease_id": lease, "keys": None},
            request_id=3,
        )
        assert _raw(secured.address, *frames, token=TOKEN)["code"] == "unauthorized"
        status = a.status("auth-own", "t")
        assert (status["leased"], status["consumed"]) == (2, 0)
        # another client of the same instance (a helper thread's, a reconnect) may ack
        with QueueClient(
            secured.address, timeout_s=5, retries=0, token=TOKEN, instance="trainer-a"
        ) as helper:
            assert helper.ack("auth-own", "t", lease)["count"] == 2
    finally:
        a.close()
        b.close()


def test_leases_are_bound_without_a_token_too(make_server):
    srv = make_server(env=_env())
    a = QueueClient(srv.address, timeout_s=5, retries=0, instance="a")
    b = QueueClient(srv.address, timeout_s=5, retries=0, instance="b")
    try:
        _put(a, "open-own")
        lease = a.claim("open-own", "t", ["ids"], 2)["lease_id"]
        with pytest.raises(QueueError) as err:
            b.ack("open-own", "t", lease)
        assert err.value.code == "not_owner"
        frames = encode_message(
            "ack",
            {"partition": "open-own", "task": "t", "lease_id": lease, "keys": None},
            request_id=3,
        )
        assert _raw(srv.address, *frames)["code"] == "not_owner"
        a.close()  # a new connection of the same client still owns the lease
        assert a.ack("open-own", "t", lease)["count"] == 2
        # a client with a token talks to a server without one (its handshake falls back)
        with QueueClient(srv.address, timeout_s=5, retries=0, token=TOKEN) as c:
            assert c.list("open-own")["keys"] == ["k0", "k1"]
    finally:
        a.close()
        b.close()


def test_bind_beyond_loopback_without_token_exits_2():
    cmd = [sys.executable, "-m", "services.cli", "queue", "serve", "--bind", "tcp://0.0.0.0:*"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 2, out.stderr
    assert "--auth-token-file" in out.stderr + out.stdout
    assert "--insecure" in out.stderr + out.stdout


def test_token_file_and_loopback_helpers(tmp_path, monkeypatch):
    assert load_token() is None
    monkeypatch.setenv(TOKEN_ENV, " abc \n")
    assert load_token() == "abc"
    path = tmp_path / "t"
    path.write_text("from-file\n")
    assert load_token(str(path)) == "from-file"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_token(str(path))
    with pytest.raises(ValueError, match="--auth-token-file"):
        load_token(str(tmp_path / "missing"))
    for ok in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/q"):
        assert is_loopback(ok), ok
    for bad in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.3:1", "tcp://eth0:1"):
        assert not is_loopback(bad), bad


def test_a_forgotten_hello_is_said_again(monkeypatch):
    """The server remembers the newest hellos only; a client with a token whose connection was
    forgotten gets unauthorized once, says hello on a new connection and goes on."""
    import threading

    from services.queue import server as server_mod

    monkeypatch.setattr(server_mod, "_MAX_HELLOS", 1)
    srv = server_mod.QueueServer(
        server_mod.ServerConfig(bind="tcp://127.0.0.1:*", auth_token=TOKEN, busy_poll_us=0)
    )
    address = srv.bind()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    a = QueueClient(address, timeout_s=5, retries=0, token=TOKEN, instance="a")
    b = QueueClient(address, timeout_s=5, retries=0, token=TOKEN, instance="b")
    try:
        _put(a, "forgot")
        lease = a.claim("forgot", "t", ["ids"], 2)["lease_id"]
        b.stats()  # a's hello is forgotten
        assert a.ack("forgot", "t", lease)["count"] == 2
        assert srv.refused == 1
    finally:
        a.close()
        b.close()
        srv.stop()
        thread.join(10)
