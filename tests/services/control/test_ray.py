"""The control plane with the Ray launcher on a local Ray cluster (`ray start --head` on loopback):
a tiny run submitted over REST runs as Ray actors and reaches SUCCEEDED with its metrics.

Run: ``./scripts/test.sh -m ray tests/services/control/test_ray.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import assert_exactly_once, corpus_parts, trained_keys
from tests.services.control.conftest import ControlServer, tiny_config, wait_state
from tests.services.launch.conftest import ray_cluster  # noqa: F401 (the cluster fixture)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]


def test_a_run_under_the_ray_launcher_succeeds_and_trains_each_sample_once(
    ray_cluster, demo, tmp_path  # noqa: F811
):
    server = ControlServer(tmp_path / "server",
                           extra=["--launcher", "ray", "--ray-address", ray_cluster])
    try:
        (path,), keys = corpus_parts(demo, server.data_root / "c", n=16, parts=1)
        with server.client() as c:
            r = c.post("/v1/runs", json=tiny_config(**{"data.train": f"c/{path.name}"}))
            assert r.status_code == 201, r.text
            done = wait_state(c, r.json()["id"], {"SUCCEEDED", "FAILED"}, 360)
            assert done["state"] == "SUCCEEDED", (done, server.tail())
            assert c.get(f"/v1/runs/{done['id']}/metrics").json()["steps"][-1]["step"] == 4
            procs = c.get(f"/v1/runs/{done['id']}/processes").json()["processes"]
            assert {p["name"]: p["exit_code"] for p in procs}["trainer0"] == 0
        assert_exactly_once(trained_keys(Path(done["run_dir"])), keys)
    finally:
        server.stop()
