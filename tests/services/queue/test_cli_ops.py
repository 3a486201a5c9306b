"""`xtoken queue list|peek|clear|drain` as real subprocesses against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from services.queue.client import QueueClient
from tests.services.queue.conftest import ROOT
from xtoken_core.wire.tensors import JaggedColumn


def queue_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "queue", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _fill(address: str, partition: str, n: int) -> None:
    ids = JaggedColumn.from_rows([torch.arange(3 + i) for i in range(n)])
    with QueueClient(address) as client:
        client.put(partition, [f"k{i}" for i in range(n)], {"ids": ids, "x": torch.zeros(n, 8)})


def test_list_prints_partitions_with_samples_human_bytes_and_tasks(server):
    _fill(server.address, "ops-list", 3)
    with QueueClient(server.address) as client:
        lease = client.claim("ops-list", "trainer", ["x"], 1)
        client.ack("ops-list", "trainer", lease["lease_id"])
    proc = queue_cli("list", "--queue", server.address)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("ops-list "))
    assert row.split()[1] == "3" and " B" in row and "trainer 1/0" in row
    proc = queue_cli("list", "--queue", server.address, "--json")
    part = json.loads(proc.stdout)["ops-list"]
    assert part["samples"] == 3 and part["tasks"]["trainer"] == {"consumed": 1, "leased": 0}


def test_peek_prints_keys_and_field_shapes_without_consuming(server):
    _fill(server.address, "ops-peek", 4)
    proc = queue_cli("peek", "--queue", server.address, "--partition", "ops-peek", "-n", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "k0" in out and "k1" in out and "k2" not in out
    assert "ids int64 [3] (jagged)" in out and "ids int64 [4] (jagged)" in out
    assert "x float32 [8]" in out and "4 samples" in out
    with QueueClient(server.address) as client:
        assert len(client.claim("ops-peek", "t", ["x"], 10)["keys"]) == 4


def test_clear_asks_for_yes_then_clears(server):
    _fill(server.address, "ops-clear", 3)
    proc = queue_cli("clear", "--queue", server.address, "--partition", "ops-clear")
    assert proc.returncode == 2 and "--yes" in proc.stderr and "3 samples" in proc.stderr
    proc = queue_cli("clear", "--queue", server.address, "--partition", "ops-clear", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert "cleared 3 samples" in proc.stdout
    with QueueClient(server.address) as client:
        assert client.list("ops-clear")["keys"] == []


def test_drain_claims_and_acks_everything_under_a_task_and_counts_it(server):
    _fill(server.address, "ops-drain", 7)
    cmd = ("drain", "--queue", server.address, "--partition", "ops-drain", "--task", "ops")
    proc = queue_cli(*cmd, "--batch", "3")
    assert proc.returncode == 0, proc.stderr
    assert "drained 7 samples" in proc.stdout
    with QueueClient(server.address) as client:
        status = client.status("ops-drain", "ops")
    assert status["consumed"] == 7 and status["pending"] == 0
    assert "drained 0 samples" in queue_cli(*cmd).stdout


def test_operator_commands_name_the_flags_when_the_server_does_not_answer():
    proc = queue_cli("list", "--queue", "tcp://127.0.0.1:1", "--timeout-s", "0.3")
    assert proc.returncode == 1
    assert "--queue" in proc.stderr and "--timeout-s" in proc.stderr
    assert "Traceback" not in proc.stderr
