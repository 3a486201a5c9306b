"""The store's refusals as a client reads them from a real server: sizes for people, the flag."""

from __future__ import annotations

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.wire import JaggedColumn


@pytest.mark.parametrize("shm", ["never", "auto"])
def test_a_sample_larger_than_the_capacity_is_refused_in_human_sizes_naming_the_flag(
    make_server, shm
):
    server = make_server("--capacity", "100KB")
    with QueueClient(server.address, timeout_s=10, shm=shm) as client:
        with pytest.raises(QueueError) as exc:
            client.put("big", ["a"], {"ids": JaggedColumn.from_rows([torch.arange(50_000)])})
    error = exc.value
    assert error.code == "queue_full" and not error.retryable
    assert error.message == (
        "a sample of 390.6 KiB is larger than the whole queue capacity (97.7 KiB): restart the "
        "queue server with a larger --capacity (more than 390.6 KiB a sample)"
    )
