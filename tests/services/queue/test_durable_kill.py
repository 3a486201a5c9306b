"""Durable mode under SIGKILL (slow): 20 kills of the server at random moments while a put loop
and a registered consumer run; restarted on the same ``--data-dir``, every sample is delivered
intact and consumed exactly once."""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import socket
import threading
import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError, StaleEpochError
from tests.services.queue.conftest import ServerProcess
from xtoken_core.wire import JaggedColumn

ROUNDS = 20
BATCH = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(i: int) -> torch.Tensor:
    """The content of key ``s<i>``: a length and values that a checksum can tell apart."""
    n = 8 + (i * 37) % 120
    return (torch.arange(n, dtype=torch.int64) * 1_000_003 + i) % (1 << 40)


def fields(idx: list[int]) -> dict:
    return {"ids": JaggedColumn.from_rows([sample(i) for i in idx])}


class Producer(threading.Thread):
    """Puts batches until stopped; after a restart it puts everything again (the server
    answers keys it holds as duplicates and consumed ones as consumed)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.put: list[int] = []
        self.lost = 0  # answered puts a restarted server did not have (log lag at the kill)
        self.error: BaseException | None = None

    def put_batch(self, c: QueueClient, idx: list[int]) -> dict:
        while True:
            try:
                return c.put("p", [f"s{i}" for i in idx], fields(idx), timeout_s=5)
            except QueueError as e:
                if not e.retryable:
                    raise

    def run(self) -> None:
        try:
            with QueueClient(self.address, timeout_s=2, retries=30, name="producer") as c:
                seen = 0
                n = 0
                while not self.stop.is_set():
                    idx = list(range(n, n + BATCH))
                    self.put_batch(c, idx)
                    self.put.extend(idx)
                    n += BATCH
                    if c.epoch_changes != seen:
                        seen = c.epoch_changes
                        self.replay(c)
                    time.sleep(0.01)
                self.replay(c)  # after the last kill
        except BaseException as e:  # reported by the test
            self.error = e

    def replay(self, c: QueueClient) -> None:
        for start in range(0, len(self.put), 256):
            self.lost += self.put_batch(c, self.put[start : start + 256])["new_samples"]


class Consumer(threading.Thread):
    """Claims (registered), checks every sample against its checksum, acks."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.acked: collections.Counter[str] = collections.Counter()
        self.uncertain: set[str] = set()  # ack sent, no answer to count on (a kill)
        self.delivered: collections.Counter[str] = collections.Counter()
        self.corrupt = 0
        self.stale = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with QueueClient(self.address, timeout_s=2, retries=30, name="consumer") as c:
                while not self.stop.is_set():
                    try:
                        got = c.claim("p", "train", ["ids"], BATCH, timeout_s=0.2, register=True)
                    except QueueError:
                        continue
                    if not got["keys"]:
                        continue
                    col = got["fields"]["ids"]
                    for r, key in enumerate(got["keys"]):
                        self.delivered[key] += 1
                        row = col.values[col.offsets[r] : col.offsets[r + 1]]
                        if not torch.equal(row, sample(int(key[1:]))):
                            self.corrupt += 1
                    time.sleep(random.random() * 0.03)  # kills land between claim and ack
                    try:
                        c.ack("p", "train", got["lease_id"])
                    except StaleEpochError:
                        # claimed from an instance that died, or the ack was applied and its
                        # reply lost, then sent again to the replacement: the server knows
                        self.stale += 1
                        self.uncertain.update(got["keys"])
                        continue
                    except QueueError:
                        self.uncertain.update(got["keys"])  # applied or not: the server knows
                        continue
                    self.acked.update(got["keys"])
        except BaseException as e:
            self.error = e


@pytest.mark.slow
def test_twenty_sigkills_under_load_lose_and_duplicate_nothing(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    args = ("--bind", address, "--data-dir", str(tmp_path / "data"), "--compact-min", "1MiB")
    rng = random.Random(10)
    server = ServerProcess(tmp_path, *args)
    producer, consumer = Producer(address), Consumer(address)
    restarts: list[float] = []
    replays: list[float] = []
    try:
        producer.start()
        consumer.start()
        for _ in range(ROUNDS):
            time.sleep(rng.uniform(0.05, 1.0))
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            server.stop()
            t0 = time.monotonic()
            server = ServerProcess(tmp_path, *args)
            restarts.append(time.monotonic() - t0)
            m = re.search(r"records of .* in ([0-9.]+)s", server.log())
            replays.append(float(m.group(1)) if m else float("nan"))
            assert producer.error is None and consumer.error is None
        time.sleep(0.5)
        producer.stop.set()
        producer.join(60)
        assert producer.error is None, producer.error
        keys = {f"s{i}" for i in producer.put}
        deadline = time.monotonic() + 60
        with QueueClient(address, timeout_s=5) as c:
            while time.monotonic() < deadline:
                status = c.status("p", "train")
                if status["samples"] == 0 and status["dropped"] >= len(keys):
                    break
                time.sleep(0.1)
            status = c.status("p", "train")
        consumer.stop.set()
        consumer.join(30)
        assert consumer.error is None, consumer.error
    finally:
        producer.stop.set()
        consumer.stop.set()
        server.stop()
    twice = [k for k, n in consumer.acked.items() if n > 1]
    never = keys - set(consumer.acked) - consumer.uncertain
    print(
        f"\n[kill] {len(keys)} samples, {ROUNDS} SIGKILLs: restart to ready "
        f"{sorted(restarts)[len(restarts) // 2]:.2f}s median (max {max(restarts):.2f}s), replay "
        f"max {max(replays):.3f}s; answered puts lost by the log lag {producer.lost} (put "
        f"again); acks lost to a kill {len(consumer.uncertain)}, stale leases "
        f"{consumer.stale}; redeliveries {sum(consumer.delivered.values()) - len(keys)}; "
        f"corrupt {consumer.corrupt}; acked twice {len(twice)}; never consumed {len(never)}"
    )
    assert consumer.corrupt == 0
    assert twice == []  # an answered ack is logged before its reply: never redelivered
    assert never == set()
    assert status["samples"] == 0 and status["dropped"] == len(keys)  # each consumed once
    assert set(consumer.delivered) == keys
