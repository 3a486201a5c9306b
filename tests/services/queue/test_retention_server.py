"""Retention over real sockets: a stream ten times the capacity flows through a small queue,
a re-put of consumed keys is answered ``consumed``, not redelivered, and not an error."""

from __future__ import annotations

import threading

import torch

from services.queue.client import QueueClient
from xtoken_core.wire import JaggedColumn

ROW = 256  # int64 values per sample: 2 KiB


def fields(keys):
    rows = [torch.full((ROW,), int(k.split("-")[1]), dtype=torch.int64) for k in keys]
    return {"ids": JaggedColumn.from_rows(rows)}


def test_ten_times_the_capacity_flows_through_and_a_re_put_is_refused_as_consumed(make_server):
    srv = make_server("--capacity", "256KiB", "--put-timeout-s", "10")
    total = 10 * 256 * 1024 // (ROW * 8)
    keys = [f"k-{i}" for i in range(total)]
    got: list[str] = []
    errors: list[str] = []

    def consume():
        with QueueClient(srv.address, timeout_s=10) as client:
            while len(got) < total:
                reply = client.claim("p", "c", ["ids"], 16, timeout_s=2, register=True)
                if not reply["keys"]:
                    errors.append(f"consumer starved after {len(got)} samples")
                    return
                values = reply["fields"]["ids"]
                for i, k in enumerate(reply["keys"]):
                    if int(values.row(i)[0]) != int(k.split("-")[1]):
                        errors.append(f"bad row for {k}")
                got.extend(reply["keys"])
                client.ack("p", "c", reply["lease_id"])

    thread = threading.Thread(target=consume)
    thread.start()
    with QueueClient(srv.address, timeout_s=10, shm="never") as producer:
        for start in range(0, total, 8):
            batch = keys[start : start + 8]
            reply = producer.put("p", batch, fields(batch), timeout_s=10)
            assert reply["new_samples"] == len(batch) and reply["consumed"] == 0
        thread.join(60)
        assert not errors and sorted(got) == sorted(keys) and len(got) == total
        stats = producer.stats()
        part = stats["partitions"]["p"]
        assert part["samples"] == 0 and part["dropped"] == total and part["registered"] == ["c"]
        assert stats["bytes_used"] == 0
        # a restarted producer puts the same keys again: refused as consumed, nothing stored
        again = producer.put("p", keys[:8], fields(keys[:8]), timeout_s=1)
        assert again["consumed"] == 8 and again["new_samples"] == 0
        with QueueClient(srv.address, timeout_s=10) as client:
            assert client.claim("p", "c", ["ids"], 16, timeout_s=0.2)["keys"] == []
        assert producer.hello()["retention"] is True
