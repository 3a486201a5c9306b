"""The launcher protocol and factory: kinds, their errors, Ray bundles and forwarded variables,
and ``xtoken run --launcher`` refusing what cannot work before anything starts."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from services.launch import make_launcher
from services.launch.base import LaunchedProcess, Launcher
from services.launch.local import LocalLauncher
from services.launch.spec import ProcessSpec

NEEDS_RAY = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed: ./scripts/test.sh -m ray installs it (the ray extra)",
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens


def test_the_local_launcher_and_its_processes_follow_the_protocol(tmp_path):
    launcher = make_launcher("local", parent_sentinel=False)
    assert isinstance(launcher, LocalLauncher) and isinstance(launcher, Launcher)
    assert launcher.parent_sentinel is False
    proc = launcher.start(ProcessSpec("version", "cli", ["--version"],
                                      log_file=str(tmp_path / "version.log")))
    assert isinstance(proc, LaunchedProcess)
    assert proc.host == socket.gethostname() and proc.pid > 0
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.stop(grace_s=30) == {"version": 0}
    assert proc.tail().startswith("xtoken ")


@pytest.mark.parametrize(
    ("kind", "address", "message"),
    [
        ("docker", None, "launcher 'docker' is unknown; use one of local, ray"),
        ("local", "10.0.0.1:6379", "only for the ray launcher; drop it or use launcher ray"),
        ("ray", None, "needs the cluster's address: pass --ray-address HOST:PORT"),
        pytest.param(
            "ray", "head-without-port", "'head-without-port' is not HOST:PORT", marks=NEEDS_RAY
        ),
    ],
)
def test_a_launcher_that_cannot_work_is_refused_with_the_fix(kind, address, message):
    with pytest.raises(ValueError, match=message):
        make_launcher(kind, address)


def test_the_ray_launcher_without_ray_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install "):
        make_launcher("ray", "127.0.0.1:6379")


@NEEDS_RAY
def test_an_unreachable_ray_cluster_is_a_clear_error_not_a_hang():
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError, match=rf"cannot reach the Ray cluster at '{address}'.*ray "
                                         r"start --head --port PORT"):
        make_launcher("ray", address, connect_timeout_s=5)


@NEEDS_RAY
def test_spec_resources_become_a_ray_bundle():
    from services.launch.ray import _bundle

    assert _bundle({"gpu": 1}, 0.25) == {"GPU": 1.0, "CPU": 0.25}
    assert _bundle({"CPU": 4, "gpu": 0, "nvme": 1}, 0.25) == {"CPU": 4.0, "nvme": 1.0}
    assert _bundle({}, 0.5) == {"CPU": 0.5}
    with pytest.raises(ValueError, match=r"resources\['gpu'\]=-1: must be >= 0"):
        _bundle({"gpu": -1}, 0.25)


@NEEDS_RAY
def test_only_the_runs_own_variables_travel_from_the_driver_to_ray_workers():
    from services.launch.ray import forwarded_env

    env = {"XTOKEN_CACHE": "/c", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "NCCL_DEBUG": "INFO", "PATH": "/bin", "HOME": "/root", "XTOKEN_PARENT_PID": "7"}
    assert forwarded_env(env) == {"XTOKEN_CACHE": "/c", "HF_HUB_OFFLINE": "1",
                                  "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO"}


def _xtoken_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"run_dir": str(tmp_path / "run")}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), "--no-progress", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_xtoken_run_refuses_a_launcher_it_cannot_use_before_starting_anything(tmp_path):
    out = _xtoken_run(tmp_path, "--launcher", "local", "--ray-address", "10.0.0.1:6379")
    assert out.returncode == 2
    assert "--ray-address is only for --launcher ray; drop one of them" in out.stderr
    address = f"127.0.0.1:{_closed_port()}"
    out = _xtoken_run(tmp_path, "--ray-address", address)  # implies --launcher ray
    assert out.returncode == 2
    if importlib.util.find_spec("ray") is None:
        assert "xtoken run: the ray launcher needs Ray, which is not installed" in out.stderr
    else:
        assert f"xtoken run: cannot reach the Ray cluster at '{address}'" in out.stderr
    assert not (tmp_path / "run" / "logs").exists(), "nothing may start"
