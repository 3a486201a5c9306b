"""Errors a queue user can see name CLI flags or run settings, never a wire or Python argument."""

from __future__ import annotations

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError


def test_a_full_queue_names_the_capacity_and_put_timeout_flags(make_server):
    srv = make_server("--capacity", "64KiB", "--shm-pool-free", "0")
    with QueueClient(srv.address, shm="never") as client:
        client.put("full", ["a"], {"x": torch.zeros(1, 12 * 1024)})
        with pytest.raises(QueueError) as err:
            client.put("full", ["b"], {"x": torch.zeros(1, 12 * 1024)}, timeout_s=0.2)
    msg = str(err.value)
    assert err.value.code == "queue_full"
    assert "--capacity" in msg and "--put-timeout-s" in msg and "timeout_ms" not in msg
    assert "48.0 KiB of 64.0 KiB" in msg  # human sizes


def test_a_claim_wait_above_the_bound_names_the_flag_not_timeout_ms(make_server):
    srv = make_server("--max-claim-wait-s", "2")
    with QueueClient(srv.address) as client:
        client.put("bound", ["a"], {"x": torch.zeros(1, 4)})
        with pytest.raises(QueueError) as err:
            client.claim("bound", "t", ["x"], 1, timeout_s=5.0)
    msg = str(err.value)
    assert "--max-claim-wait-s" in msg and "claim_timeout_s" in msg and "timeout_ms" not in msg
