"""A corrupt record in the middle of a real server's log: the start stops naming the file and
offset (exit code 3); ``--salvage`` keeps the valid records after it."""

from __future__ import annotations

import subprocess
import sys

import torch

from services.queue.client import QueueClient
from services.queue.durable import log_files, read_records
from tests.services.queue.conftest import ROOT, ServerProcess


def put_and_stop(tmp_path, data: str) -> None:
    srv = ServerProcess(tmp_path, "--data-dir", data)
    try:
        with QueueClient(srv.address, timeout_s=5, shm="never") as c:
            for i in range(3):
                c.put("p", [f"k{i}"], {"x": torch.full((1, 64), i, dtype=torch.int32)})
    finally:
        assert srv.terminate() == 0
        srv.stop()


def test_a_flipped_byte_stops_the_start_and_salvage_keeps_the_records_after_it(tmp_path):
    data = str(tmp_path / "data")
    put_and_stop(tmp_path, data)
    ((_, path),) = log_files(data)
    ends = [end for end, _ in read_records(path)]
    assert len(ends) == 3
    bad = ends[0]  # the second put's record
    with open(path, "r+b") as f:
        f.seek(bad + 40)
        byte = f.read(1)
        f.seek(bad + 40)
        f.write(bytes([byte[0] ^ 0x01]))
    cmd = [sys.executable, "-m", "services.cli", "queue", "serve", "--bind", "tcp://127.0.0.1:*"]
    run = subprocess.run(
        [*cmd, "--data-dir", data], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 3, run.stderr
    assert f"{path}: corrupt record at byte {bad}" in run.stderr and "--salvage" in run.stderr
    srv = ServerProcess(tmp_path, "--data-dir", data, "--salvage")
    try:
        with QueueClient(srv.address, timeout_s=5, shm="never") as c:
            assert c.list("p")["keys"] == ["k0", "k2"]
            got = c.get("p", ["k2"])
            assert got["fields"]["x"].tolist() == [[2] * 64]
    finally:
        srv.stop()
    assert "corrupt record at byte" in srv.log()
