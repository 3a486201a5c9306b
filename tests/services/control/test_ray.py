"""The control plane with the Ray launcher on a local Ray cluster (`ray start --head` on loopback):
a tiny run submitted over REST runs as Ray actors and reaches SUCCEEDED with its metrics; after a
control-plane restart a Ray run is INTERRUPTED with none of its actors left, and resumes.

Run: ``./scripts/test.sh -m ray tests/services/control/test_ray.py``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    assert_exactly_once,
    checkpoint_keys,
    corpus_parts,
    key_log_lines,
    keys_after,
    latest_checkpoint,
    pid_alive,
    trained_keys,
    wait_for,
)
from tests.services.control.conftest import ControlServer, tiny_config, wait_state
from tests.services.launch.conftest import ray_cluster  # noqa: F401 (the cluster fixture)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]


def _config(server: ControlServer, demo, train: str) -> dict:
    """``tiny_config`` training on ``train`` with an explicit held-out corpus in the data root
    (without ``data.heldout`` the run holds out the last texts of data.train, which these tests
    expect to train)."""
    shutil.copy(demo.heldout_path, server.data_root / "heldout.txt")
    return tiny_config(**{"data.train": train, "data.heldout": "heldout.txt"})


def test_a_run_under_the_ray_launcher_succeeds_and_trains_each_sample_once(
    ray_cluster, demo, tmp_path  # noqa: F811
):
    server = ControlServer(tmp_path / "server",
                           extra=["--launcher", "ray", "--ray-address", ray_cluster])
    try:
        (path,), keys = corpus_parts(demo, server.data_root / "c", n=16, parts=1)
        with server.client() as c:
            r = c.post("/v1/runs", json=_config(server, demo, f"c/{path.name}"))
            assert r.status_code == 201, r.text
            done = wait_state(c, r.json()["id"], {"SUCCEEDED", "FAILED"}, 360)
            assert done["state"] == "SUCCEEDED", (done, server.tail())
            assert c.get(f"/v1/runs/{done['id']}/metrics").json()["steps"][-1]["step"] == 4
            procs = c.get(f"/v1/runs/{done['id']}/processes").json()["processes"]
            assert {p["name"]: p["exit_code"] for p in procs}["trainer0"] == 0
        assert_exactly_once(trained_keys(Path(done["run_dir"])), keys)
    finally:
        server.stop()


def test_after_a_control_plane_restart_a_ray_run_is_interrupted_with_no_actor_left(
    ray_cluster, demo, tmp_path  # noqa: F811
):
    # The run's actors belong to the control plane's Ray job (non-detached): when that process
    # dies, Ray ends them and removes their placement groups, and each worker stops with its
    # actor (its dead-parent sentinel). The restarted control plane does not re-attach them: the
    # run is INTERRUPTED, and its resume trains what its checkpoint lacks, each sample once.
    import ray

    server = ControlServer(tmp_path / "server",
                           extra=["--launcher", "ray", "--ray-address", ray_cluster])
    try:
        (path,), keys = corpus_parts(demo, server.data_root / "c", n=48, parts=1)
        with server.client() as c:
            r = c.post("/v1/runs", json=_config(server, demo, f"c/{path.name}"))
            assert r.status_code == 201, r.text
            rid = r.json()["id"]
            deadline = time.monotonic() + 300
            while (c.get(f"/v1/runs/{rid}").json().get("step") or 0) < 2:
                assert time.monotonic() < deadline, server.tail()
                time.sleep(0.2)
            pids = [p["pid"] for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]]
        server.kill()
        wait_for(lambda: not any(pid_alive(p) for p in pids), 60, "the run's workers to end")
        ray.init(address=ray_cluster, namespace="xtoken-test", log_to_driver=False)
        try:
            def released() -> bool:
                groups = ray.util.placement_group_table().values()
                left = [g for g in groups if g["name"].startswith("xtoken-")
                        and g["state"] != "REMOVED"]
                free = ray.available_resources().get("CPU", 0.0)
                return not left and free == ray.cluster_resources().get("CPU")

            wait_for(released, 60, "the run's actors and placement groups to be released")
        finally:
            ray.shutdown()

        server.start()
        with server.client() as c:
            run = wait_state(c, rid, {"INTERRUPTED", "RUNNING", "FAILED"}, 60)
            assert run["state"] == "INTERRUPTED" and "resume it" in run["reason"], run
            procs = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
            assert {p["state"] for p in procs} <= {"gone", "exited", "failed"}, procs
            run_dir = Path(run["run_dir"])
            checkpoint = latest_checkpoint(run_dir)
            saved = checkpoint_keys(checkpoint) if checkpoint else set()
            lines = key_log_lines(run_dir)
            assert c.post(f"/v1/runs/{rid}/resume").status_code == 202
            done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 360)
            assert done["state"] == "SUCCEEDED", (done, server.tail())
        after = keys_after(run_dir, lines)
        assert not saved & set(after), "a checkpointed key was trained again"
        assert_exactly_once(sorted(saved) + after, keys)
    finally:
        server.stop()
