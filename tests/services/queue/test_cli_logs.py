"""`xtoken queue serve` log lines for operators: connects, error replies, periodic stats."""

from __future__ import annotations

import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError


def _wait_for(srv, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = srv.log()
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the server log:\n{srv.log()}")


def test_serve_logs_connects_errors_and_stats_every_log_every_seconds(make_server):
    srv = make_server("--log-every-s", "1", "--max-claim-wait-s", "1", "--capacity", "256MiB")
    with QueueClient(srv.address, name="trainer-0") as client:
        client.put("logs", ["a", "b"], {"x": torch.zeros(2, 256)})
        with pytest.raises(QueueError):
            client.claim("logs", "t", ["x"], 1, timeout_s=5.0)
    log = _wait_for(srv, "[queue] stats:")
    assert "(capacity 256.0 MiB," in log
    assert "[queue] client trainer-0 connected" in log
    assert "error reply to a claim: bad_request" in log and "--max-claim-wait-s" in log
    line = next(x for x in log.splitlines() if "[queue] stats:" in x and "2 samples" in x)
    assert "1 partition" in line and "KiB of 256.0 MiB" in line and "1 error" in line


def test_log_every_zero_turns_the_stats_line_off(make_server):
    srv = make_server("--log-every-s", "0")
    with QueueClient(srv.address) as client:
        client.stats()
    time.sleep(1.5)
    assert "[queue] stats:" not in srv.log()
