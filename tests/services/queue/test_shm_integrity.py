"""The pool's files are checked: bytes of a stored sample that another process changed in
/dev/shm after the put are never served; the request gets an error naming the cause, the changed
samples are dropped, everything else is served (real servers on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.errors import QueueError
from xtoken_core.ipc import SHM_DIR
from xtoken_core.wire.shm import fields_layout_bytes


def overwrite(name: str, offset: int, data: bytes) -> None:
    """Write ``data`` into pool file ``name`` from another process (same user, as any could)."""
    path = os.path.join(SHM_DIR, name)
    code = f"import os; fd = os.open({path!r}, os.O_RDWR); os.pwrite(fd, {data!r}, {offset})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_pool_write_after_the_put_is_refused_naming_the_cause(make_server):
    srv = make_server("--capacity", "64MiB")
    x = torch.arange(1 << 18, dtype=torch.int64).view(1, -1)  # 2 MiB
    with QueueClient(srv.address, timeout_s=10) as c:
        region = c.reserve(fields_layout_bytes({"x": x}))
        c.put("p", ["changed"], {"x": x}, reservation=region)
        c.put("p", ["kept"], {"x": x + 1})  # through another pool segment
        overwrite(region.name, 4096, b"\xff" * 8)
        with pytest.raises(QueueError) as err:
            c.claim("p", "t", ["x"], 2)
        assert err.value.code == "corrupt" and err.value.retryable
        assert region.name in err.value.message and "put" in err.value.message
        assert c.list("p")["keys"] == ["kept"]
        assert c.stats()["shm_pool"]["tampered"] == 1
        got = c.claim("p", "t", ["x"], 2)
        assert got["keys"] == ["kept"] and torch.equal(got["fields"]["x"], x + 1)
        # the producer may put the sample again
        assert c.put("p", ["changed"], {"x": x})["new_samples"] == 1
        assert torch.equal(c.get("p", ["changed"])["fields"]["x"], x)
    assert srv.proc.poll() is None
    assert "changed after" in srv.log()
