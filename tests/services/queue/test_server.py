"""Queue server over real sockets: concurrency, leases, back-pressure, bad input, shutdown."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from tests.services.queue.conftest import ROOT
from xtoken_core.wire import JaggedColumn, decode_message, encode_message


def sample_rows(keys, width=4):
    """Deterministic per-key rows: row for key k has len 1 + hash % 7 and known values."""
    rows, sums = [], []
    for k in keys:
        n = 1 + sum(map(ord, k)) % 7
        row = torch.arange(n * width, dtype=torch.float32).reshape(n, width) + sum(map(ord, k))
        rows.append(row)
        sums.append(float(row.sum()))
    return JaggedColumn.from_rows(rows), torch.tensor(sums, dtype=torch.float64)


def put_samples(client, partition, keys):
    hidden, sums = sample_rows(keys)
    return client.put(partition, keys, {"hidden": hidden, "checksum": sums})


def raw_request(address, frames, timeout_ms=5000):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "no reply from the server"
        return decode_message(sock.recv_multipart())
    finally:
        sock.close()


def test_hello_reports_protocol_and_capacity(server):
    with QueueClient(server.address, timeout_s=10) as client:
        info = client.hello()
    assert info["protocol_version"] == 1
    assert info["capacity_bytes"] == 256 * 2**20
    assert "[queue] listening on" in server.log()


def test_concurrent_producers_and_consumers_lose_nothing_and_duplicate_nothing(server):
    partition, n_producers, per_producer = "concurrent", 3, 40
    seen: list[str] = []
    bad: list[str] = []
    lock = threading.Lock()
    done_producing = threading.Event()

    def produce(p):
        with QueueClient(server.address, timeout_s=10) as client:
            for start in range(0, per_producer, 5):
                put_samples(client, partition, [f"p{p}-{i}" for i in range(start, start + 5)])

    def consume():
        with QueueClient(server.address, timeout_s=10) as client:
            while True:
                got = client.claim(partition, "train", ["hidden", "checksum"], 8, timeout_s=0.3)
                if not got["keys"]:
                    if done_producing.is_set():
                        return
                    continue
                col, sums = got["fields"]["hidden"], got["fields"]["checksum"]
                with lock:
                    for i, k in enumerate(got["keys"]):
                        if float(col.row(i).sum()) != float(sums[i]):
                            bad.append(k)
                        seen.append(k)
                client.ack(partition, "train", got["lease_id"])

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    consumers = [threading.Thread(target=consume) for _ in range(2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(60)
    done_producing.set()
    for t in consumers:
        t.join(60)
    expected = {f"p{p}-{i}" for p in range(n_producers) for i in range(per_producer)}
    assert not bad
    assert len(seen) == len(expected) and set(seen) == expected
    with QueueClient(server.address) as client:
        status = client.status(partition, "train")
    assert status["consumed"] == len(expected) and status["pending"] == 0


def test_tasks_consume_the_same_samples_independently(server):
    with QueueClient(server.address) as client:
        put_samples(client, "tasks", ["a", "b", "c"])
        teacher = client.claim("tasks", "teacher", ["hidden"], 10)
        client.ack("tasks", "teacher", teacher["lease_id"])
        trainer = client.claim("tasks", "trainer", ["hidden"], 10)
        assert teacher["keys"] == trainer["keys"] == ["a", "b", "c"]
        assert client.claim("tasks", "teacher", ["hidden"], 10, timeout_s=0)["keys"] == []


def test_claim_times_out_with_no_samples_and_waits_without_blocking_others(server):
    with QueueClient(server.address) as waiter, QueueClient(server.address) as other:
        result: dict = {}

        def wait_claim():
            t0 = time.monotonic()
            result["reply"] = waiter.claim("empty", "t", ["x"], 1, timeout_s=0.6)
            result["elapsed"] = time.monotonic() - t0

        thread = threading.Thread(target=wait_claim)
        thread.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        other.stats()
        assert time.monotonic() - t0 < 0.4  # answered while the claim is parked
        thread.join(10)
    assert result["reply"]["keys"] == [] and result["reply"]["lease_id"] is None
    assert result["elapsed"] >= 0.55


def test_parked_claim_is_answered_when_data_arrives(server):
    with QueueClient(server.address) as consumer, QueueClient(server.address) as producer:
        out: dict = {}
        thread = threading.Thread(
            target=lambda: out.update(consumer.claim("late", "t", ["hidden"], 4, timeout_s=10))
        )
        t0 = time.monotonic()
        thread.start()
        time.sleep(0.3)
        put_samples(producer, "late", ["k1", "k2"])
        thread.join(10)
    assert out["keys"] == ["k1", "k2"]
    assert time.monotonic() - t0 < 5


def test_lease_of_a_killed_consumer_expires_and_samples_are_redelivered(server):
    with QueueClient(server.address) as client:
        put_samples(client, "kill", ["s0", "s1", "s2"])
    code = (
        "import sys, time\n"
        "from services.queue.client import QueueClient\n"
        f"c = QueueClient({server.address!r})\n"
        "got = c.claim('kill', 'train', ['hidden'], 2, lease_s=1.0)\n"
        "print(','.join(got['keys']), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        claimed = proc.stdout.readline().strip().split(",")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert claimed == ["s0", "s1"]
    with QueueClient(server.address) as client:
        first = client.claim("kill", "train", ["hidden"], 3, timeout_s=0)
        assert first["keys"] == ["s2"]  # the killed consumer's samples are still leased
        again = client.claim("kill", "train", ["hidden"], 3, timeout_s=5)
        assert again["keys"] == ["s0", "s1"]  # redelivered after the 1 s lease expired


def test_full_queue_makes_puts_wait_then_fail_retryable(make_server):
    srv = make_server("--capacity", "4KiB")
    with QueueClient(srv.address) as client, QueueClient(srv.address) as other:
        client.put("p", ["a"], {"x": torch.zeros(1, 600)})  # 2400 bytes
        t0 = time.monotonic()
        with pytest.raises(QueueError) as exc:
            client.put("p", ["b"], {"x": torch.zeros(1, 600)}, timeout_s=0.4)
        assert time.monotonic() - t0 >= 0.35
        assert exc.value.code == "queue_full" and exc.value.retryable
        assert "--capacity" in exc.value.message
        # A parked put goes through as soon as a clear frees the bytes.
        out: dict = {}
        thread = threading.Thread(
            target=lambda: out.update(
                client.put("p", ["b"], {"x": torch.ones(1, 600)}, timeout_s=10)
            )
        )
        thread.start()
        time.sleep(0.3)
        assert other.stats()["parked_puts"] == 1
        other.clear("p", ["a"])
        thread.join(10)
        assert out["written"] == 1
        assert other.list("p")["keys"] == ["b"]


def test_malformed_messages_get_error_replies_and_the_server_keeps_serving(make_server):
    srv = make_server("--max-message-bytes", "64KiB")
    good = encode_message("hello", {"protocol_version": 1, "client": "raw"}, request_id=7)
    header = bytes(good[0])
    wrong_version = header[:4] + bytes([9]) + header[5:]
    unknown_type = header[:6] + struct.pack("<H", 999) + header[8:]
    put = encode_message(
        "put",
        {"partition": "p", "keys": ["a"], "fields": {"x": torch.zeros(1, 1000)}},
        request_id=8,
    )
    assert len(put) == 3
    cases = {
        "garbage": ([b"\x00garbage", b"\xff\xfe"], "bad_header"),
        "truncated": ([header], "bad_frames"),
        "bad_msgpack": ([header, b"\xc1\xc1"], "bad_body"),
        "wrong_version": ([wrong_version, bytes(good[1])], "bad_version"),
        "unknown_type": ([unknown_type, bytes(good[1])], "unknown_type"),
        "missing_frame": ([bytes(put[0]), bytes(put[1])], "bad_frames"),
        "extra_frame": ([bytes(f) for f in put] + [b"spare"], "bad_frames"),
        "short_frame": ([bytes(put[0]), bytes(put[1]), bytes(put[2])[:-4]], "bad_frames"),
        "bad_body": (
            [
                bytes(encode_message("get", {"partition": "p"}, request_id=3)[0]),
                bytes(encode_message("get", {"partition": "p"})[1]),
            ],
            "bad_body",
        ),
        "oversize": ([header, bytes(good[1]), b"\x00" * 70000], "too_large"),
    }
    for name, (frames, code) in cases.items():
        reply = raw_request(srv.address, frames)
        assert reply.msg_type == "error", name
        assert reply.body["code"] == code, (name, reply.body)
        assert reply.body["retryable"] is False
    assert raw_request(srv.address, [bytes(f) for f in good]).request_id == 7
    assert raw_request(srv.address, [wrong_version, bytes(good[1])]).request_id == 7
    with QueueClient(srv.address) as client:
        assert client.hello()["protocol_version"] == 1
    assert srv.proc.poll() is None


def test_sigterm_answers_parked_requests_and_exits_zero(make_server):
    srv = make_server()
    out: dict = {}

    def wait_claim():
        try:
            with QueueClient(srv.address, retries=0) as client:
                client.claim("p", "t", ["x"], 1, timeout_s=30)
        except QueueError as e:
            out["error"] = e

    thread = threading.Thread(target=wait_claim)
    thread.start()
    time.sleep(0.5)
    assert srv.terminate() == 0
    thread.join(10)
    assert out["error"].code == "shutting_down" and out["error"].retryable
    assert "stopped" in srv.log()


class _DropFirstReply(threading.Thread):
    """A ROUTER<->DEALER forwarder that loses the first reply that does not answer a hello
    (to exercise client retries; a client says hello first on each connection)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(daemon=True)
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.upstream = upstream
        self.stop = threading.Event()
        self.dropped = 0
        self._hellos: set[int] = set()  # request ids of hellos (their replies pass)

    def run(self) -> None:
        back: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, *frames = self.front.recv_multipart()
                    if struct.unpack_from("<H", frames[0], 6)[0] == 1:  # type code 1: hello
                        self._hellos.add(struct.unpack_from("<Q", frames[0], 8)[0])
                    if ident not in back:
                        b = zmq.Context.instance().socket(zmq.DEALER)
                        b.setsockopt(zmq.LINGER, 0)
                        b.connect(self.upstream)
                        back[ident] = b
                        poller.register(b, zmq.POLLIN)
                    back[ident].send_multipart(frames)
                else:
                    frames = sock.recv_multipart()
                    ident = next(i for i, s in back.items() if s is sock)
                    hello = struct.unpack_from("<Q", frames[0], 8)[0] in self._hellos
                    if self.dropped == 0 and not hello:
                        self.dropped += 1
                        continue
                    self.front.send_multipart([ident, *frames])
        for b in back.values():
            b.close()
        self.front.close()


def test_client_retries_a_lost_reply_and_the_put_is_stored_once(server):
    proxy = _DropFirstReply(server.address)
    proxy.start()
    try:
        with QueueClient(proxy.address, timeout_s=0.5, retries=2) as client:
            hidden, sums = sample_rows(["r1", "r2"])
            reply = client.put(
                "retry", ["r1", "r2"], {"hidden": hidden, "checksum": sums}, timeout_s=0
            )
    finally:
        proxy.stop.set()
        proxy.join(5)
    assert proxy.dropped == 1
    assert reply["duplicates"] == 4 and reply["written"] == 0  # first attempt stored them
    with QueueClient(server.address) as client:
        assert client.list("retry")["keys"] == ["r1", "r2"]


def test_client_timeout_names_the_setting():
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.ROUTER)  # accepts, never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        with QueueClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, retries=1) as client:
            with pytest.raises(QueueError) as exc:
                client.stats()
    finally:
        sink.close(linger=0)
    assert exc.value.code == "timeout" and exc.value.retryable
    assert "timeout_s" in exc.value.message and "2 attempt" in exc.value.message


def test_server_errors_raise_queue_error_with_code(server):
    with QueueClient(server.address) as client:
        with pytest.raises(QueueError) as exc:
            client.get("nowhere", ["k"])
        assert exc.value.code == "not_found" and not exc.value.retryable
        with pytest.raises(QueueError) as exc:
            client.ack("nowhere", "t", 123456)
        assert exc.value.code == "unknown_lease"


@pytest.mark.parametrize("busy_poll_us", [-1, 2_000_000])
def test_busy_poll_outside_its_range_is_refused_naming_the_flag(busy_poll_us):
    from services.queue.server import ServerConfig

    with pytest.raises(ValueError, match="--busy-poll-us"):
        ServerConfig(busy_poll_us=busy_poll_us)


def test_a_server_without_busy_polling_answers_claims_and_parked_claims(make_server):
    srv = make_server("--busy-poll-us", "0")
    with QueueClient(srv.address, timeout_s=10) as client:
        client.put("nb", ["a"], {"x": torch.arange(4).reshape(1, 4)})
        got = client.claim("nb", "t", ["x"], 1)
        assert got["keys"] == ["a"] and got["fields"]["x"].tolist() == [[0, 1, 2, 3]]
        assert client.claim("nb", "t", ["x"], 1, timeout_s=0.2)["keys"] == []
