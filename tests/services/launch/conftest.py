"""Launcher fixtures: a real local Ray cluster (``ray start --head`` on this machine, stopped with
its session) for the tests marked ``ray``."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.e2e import conftest as e2e

RAY = pathlib.Path(sys.executable).with_name("ray")
# Two logical GPUs on a CPU machine: Ray assigns them (CUDA_VISIBLE_DEVICES) like real ones.
FAKE_GPUS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """``HOST:PORT`` of a Ray head started here (2 CPUs, 2 logical GPUs, the custom resource
    ``head`` that pins a spec to it, no dashboard), stopped
    (SIGTERM to the blocking ``ray start``, which stops every process of its session) after the
    session."""
    pytest.importorskip(
        "ray", reason="ray is not installed: ./scripts/test.sh -m ray installs it (the ray extra)"
    )
    port = _free_port()
    temp = pathlib.Path(tempfile.mkdtemp(prefix="xtkray", dir="/tmp"))  # short: socket paths
    log_path = temp / "head.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen(
            [
                str(RAY), "start", "--head", "--node-ip-address", "127.0.0.1",
                "--port", str(port), "--num-cpus", "2", "--num-gpus", str(FAKE_GPUS),
                "--resources", '{"head": 100}',
                "--disable-usage-stats", "--include-dashboard", "false",
                "--object-store-memory", str(128 << 20), "--temp-dir", str(temp), "--block",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log_path.read_text(errors="replace"):
        if head.poll() is not None or time.monotonic() > deadline:
            head.kill()
            pytest.fail(f"ray start --head failed:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.2)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


# The end-to-end fixtures of tests/e2e (demo corpus, projection file, process registry), for the
# run through each launcher.
demo = e2e.demo
projection = e2e.projection
procs = e2e.procs


@pytest.fixture
def second_node(ray_cluster):
    """A second Ray node (its own raylet on this machine) joined to :func:`ray_cluster` for one
    test, with 1 CPU and the custom resource ``node2`` (a spec asks for it to land there); the
    caller connects its driver first, so the driver stays on the head."""
    temp = pathlib.Path(tempfile.mkdtemp(prefix="xtkray2", dir="/tmp"))
    log_path = temp / "node2.log"
    with open(log_path, "wb") as log:
        node = subprocess.Popen(
            [
                str(RAY), "start", "--address", ray_cluster, "--num-cpus", "1", "--num-gpus", "0",
                "--resources", '{"node2": 1}', "--disable-usage-stats",
                "--object-store-memory", str(128 << 20), "--block",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log_path.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            node.kill()
            pytest.fail(f"ray start (second node) failed:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.2)
    try:
        yield "node2"
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
        shutil.rmtree(temp, ignore_errors=True)
