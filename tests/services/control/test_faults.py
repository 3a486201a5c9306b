"""Faults under the control plane, with real worker processes (slow): SIGKILL of a collator, the
teacher, a trainer rank or the run's queue -> restart per policy and every sample trained as
without the kill; SIGKILL of the control plane itself -> the run is re-attached and finishes; two
runs at once never see each other's samples; stop -> checkpoint -> resume trains every sample once;
a shared queue SIGKILLed and started again on its address -> the run restarts on the new instance.

Run: ``./scripts/test.sh -m slow tests/services/control`` (about 6 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from benchmarks.faults.lineage import trained_records
from services.control.store import Store
from tests.e2e.conftest import (
    assert_exactly_once,
    checkpoint_keys,
    corpus_parts,
    free_port,
    key_log_lines,
    keys_after,
    latest_checkpoint,
    trained_keys,
)
from tests.services.control.conftest import ControlServer, tiny_config, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True)
def _heldout(server, demo):
    """An explicit held-out corpus in the data root: every text of data.train is trained."""
    shutil.copy(demo.heldout_path, server.data_root / "heldout.txt")


def _config(**overrides):
    """``tiny_config`` with ``data.heldout`` named (without it the run holds out the last texts
    of data.train, which these tests expect to train)."""
    return tiny_config(**{"data.heldout": "heldout.txt", **overrides})


def _submit(c, config) -> dict:
    r = c.post("/v1/runs", json=config)
    assert r.status_code == 201, r.text
    return r.json()


def _wait_step(c, rid: str, step: int, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = c.get(f"/v1/runs/{rid}").json()
        if (run.get("step") or 0) >= step:
            return run
        assert run["state"] not in ("FAILED", "SUCCEEDED", "STOPPED"), run
        time.sleep(0.1)
    pytest.fail(f"run {rid} did not reach step {step}: {c.get(f'/v1/runs/{rid}').json()}")


def _pids(c, rid: str) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}


def _corpus(server: ControlServer, demo, name: str, n: int, start: int = 0):
    (path,), keys = corpus_parts(demo, server.data_root / name, n=n, parts=1, start=start)
    return f"{name}/{path.name}", keys


@pytest.mark.parametrize("victim", ["collator", "teacher0"])
def test_a_killed_collator_or_teacher_restarts_in_place_and_every_sample_trains_once(
    server, demo, victim
):
    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        if victim == "collator":  # small puts: the kill lands while it still collates
            config = _config(**{"data.train": data, "collator.batch": 2})
        else:
            config = _config(**{"data.train": data})
        rid = _submit(c, config)["id"]
        if victim == "collator":
            wait_state(c, rid, {"RUNNING"}, 120)
            deadline = time.monotonic() + 60  # tokenizers loaded: it is putting samples
            while "loaded smollm2" not in _read(c, rid, "collator"):
                assert time.monotonic() < deadline, _read(c, rid, "collator")
                time.sleep(0.05)
            time.sleep(0.5)
        else:
            _wait_step(c, rid, 2)
        pid = _pids(c, rid)[victim]
        os.killpg(pid, signal.SIGKILL)
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        procs = {p["name"]: p for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}
        assert procs[victim]["restarts"] == 1 and procs[victim]["pid"] != pid
        assert_exactly_once(trained_keys(Path(done["run_dir"])), keys)


def _read(c, rid: str, process: str) -> str:
    r = c.get(f"/v1/runs/{rid}/logs", params={"process": process, "lines": 10000})
    return r.text if r.status_code == 200 else ""


def test_a_killed_trainer_rank_restarts_every_rank_from_the_checkpoint(server, demo):
    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        rid = _submit(c, _config(**{"data.train": data, "trainers": 2}))["id"]
        run = _wait_step(c, rid, 3)
        run_dir = Path(run["run_dir"])
        assert latest_checkpoint(run_dir) is not None
        os.kill(_pids(c, rid)["trainer1"], signal.SIGKILL)
        checkpoint = latest_checkpoint(run_dir)
        saved = checkpoint_keys(checkpoint)  # read now: later checkpoints rotate it away
        lines = key_log_lines(run_dir)
        wait_state(c, rid, {"RECOVERING"}, 30)
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        procs = {p["name"]: p for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}
        assert procs["trainer0"]["restarts"] == procs["trainer1"]["restarts"] == 1
        after = keys_after(run_dir, lines)
        assert not saved & set(after), "a checkpointed key was trained again"
        assert_exactly_once(sorted(saved) + after, keys)
        assert set(trained_keys(run_dir)) == set(keys)  # the same key set as without the kill


def test_a_hung_trainer_is_detected_by_its_heartbeat_and_restarted_from_the_checkpoint(
    tmp_path, demo, monkeypatch
):
    # the real trainer's main loop blocks forever at its 6th iteration (once): its process lives
    # and its heartbeat thread beats, but it makes no progress: hung after hang_after_s
    marker = tmp_path / "hung"
    monkeypatch.setenv("XTOKEN_TEST_HANG", f"trainer0:6:{marker}")
    server = ControlServer(tmp_path / "server")
    try:
        data, keys = _corpus(server, demo, "c", 64)
        hang_after_s = 4.0
        with server.client() as c:
            config = _config(**{"data.train": data, "hang_after_s": hang_after_s})
            rid = _submit(c, config)["id"]
            deadline = time.monotonic() + 180
            while not marker.exists():
                run = c.get(f"/v1/runs/{rid}").json()
                assert run["state"] not in ("FAILED", "SUCCEEDED") and time.monotonic() < deadline
                time.sleep(0.05)
            hung_at = time.time()
            run_dir = Path(c.get(f"/v1/runs/{rid}").json()["run_dir"])
            checkpoint = latest_checkpoint(run_dir)  # the hung rank writes nothing more
            saved = checkpoint_keys(checkpoint) if checkpoint else set()
            lines = key_log_lines(run_dir)
            pid = _pids(c, rid)["trainer0"]
            row = _procs(c, rid)["trainer0"]
            assert row["state"] == "running" and time.time() - row["last_heartbeat"] < 3.0
            done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
            assert done["state"] == "SUCCEEDED", done
            events = Store(server.runs_root / "control.db").events(rid)
            hung = [e for e in events if e["kind"] == "unresponsive"]
            assert [e["data"]["process"] for e in hung] == ["trainer0"], hung
            assert hung[0]["data"]["pid"] == pid and hung[0]["data"]["reason"].endswith("hung")
            # detected within hang_after_s plus a beat and a few supervisor ticks
            assert hang_after_s <= hung[0]["time"] - hung_at < hang_after_s + 3.0
            procs = _procs(c, rid)
            assert procs["trainer0"]["restarts"] == 1 and procs["trainer0"]["pid"] != pid
        after = keys_after(run_dir, lines)
        assert not saved & set(after), "a checkpointed key was trained again"
        assert_exactly_once(sorted(saved) + after, keys)
        assert set(trained_keys(run_dir)) == set(keys)
    finally:
        server.stop()


def _procs(c, rid: str) -> dict[str, dict]:
    return {p["name"]: p for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}


def test_a_killed_queue_restarts_the_run_from_the_checkpoint_and_loses_no_sample(server, demo):
    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        rid = _submit(c, _config(**{"data.train": data}))["id"]
        run = _wait_step(c, rid, 3)
        run_dir = Path(run["run_dir"])
        os.kill(_pids(c, rid)["queue"], signal.SIGKILL)  # its samples were in its memory only
        at_kill = latest_checkpoint(run_dir)
        recovering = wait_state(c, rid, {"RECOVERING"}, 30)
        assert "queue" in recovering["reason"], recovering
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        procs = {p["name"]: p for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}
        assert procs["queue"]["restarts"] == procs["trainer0"]["restarts"] == 1  # the whole run
        # the trainer may finish a checkpoint after the queue died (its step was queued before):
        # what counts is the checkpoint the restarted trainer resumed from, step R. Kept: what
        # the first trainer trained up to R, and all the restarted one trained (from R + 1)
        resumed = json.loads((run_dir / "summary.json").read_text())["resumed_from"]
        assert resumed >= int(at_kill.name.split("_")[1])
        records = trained_records(run_dir)
        restart = max(i for i, r in enumerate(records) if r["step"] == resumed + 1)
        before = [k for r in records[:restart] if r["step"] <= resumed for k in r["keys"]]
        after = [k for r in records[restart:] for k in r["keys"]]
        assert not set(before) & set(after), "a checkpointed key was trained again"
        assert_exactly_once(before + after, keys)
        assert set(trained_keys(run_dir)) == set(keys)


def test_a_killed_control_plane_reattaches_its_run_which_finishes(server, demo):
    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        rid = _submit(c, _config(**{"data.train": data}))["id"]
        _wait_step(c, rid, 2)
        pids = _pids(c, rid)
        running = [
            p["pid"]
            for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]
            if p["state"] == "running"
        ]
    assert len(running) >= 3  # queue, teacher, trainer (the collator may be done)
    server.kill()
    time.sleep(1.0)
    for pid in running:  # the run's processes outlive the control plane
        os.kill(pid, 0)
    server.start()
    with server.client() as c:
        run = c.get(f"/v1/runs/{rid}").json()
        assert run["state"] in ("RUNNING", "SUCCEEDED"), run
        assert _pids(c, rid) == pids
        kinds = [e["kind"] for e in _events(c, rid)]
        assert "reattached" in kinds
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        assert_exactly_once(trained_keys(Path(done["run_dir"])), keys)
        # metrics of the whole run were read again from its files
        assert c.get(f"/v1/runs/{rid}/metrics").json()["steps"][-1]["step"] == done["step"]


def test_a_collator_that_ends_while_the_control_plane_is_down_is_done_not_restarted(server, demo):
    from services.supervise.attach import is_alive

    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        rid = _submit(c, _config(**{"data.train": data}))["id"]
        deadline = time.monotonic() + 120
        while "collator" not in _pids(c, rid) and time.monotonic() < deadline:
            time.sleep(0.05)
        collator = _pids(c, rid)["collator"]
    server.kill()
    deadline = time.monotonic() + 120
    while is_alive(collator) and time.monotonic() < deadline:  # it ends unseen
        time.sleep(0.2)
    assert not is_alive(collator)
    server.start()
    with server.client() as c:
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        row = _procs(c, rid)["collator"]
        assert row["restarts"] == 0 and row["pid"] == collator, row
    trained = trained_keys(Path(done["run_dir"]))
    assert trained and len(set(trained)) == len(trained) and set(trained) <= set(keys)
    code = json.loads((Path(done["run_dir"]) / "exit" / "collator.code").read_text())
    assert code == {"pid": collator, "code": 0}


def _events(c, rid: str) -> list[dict]:
    import json

    out = []
    with c.stream("GET", f"/v1/runs/{rid}/events", timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
            if line == ": keep-alive":
                break
            if out and out[-1]["kind"] == "reattached":
                break
    return out


def test_two_runs_at_once_each_train_their_own_samples_only(server, demo):
    data_a, keys_a = _corpus(server, demo, "a", 32)
    data_b, keys_b = _corpus(server, demo, "b", 32, start=32)
    assert not set(keys_a) & set(keys_b)
    with server.client() as c:
        a = _submit(c, _config(**{"data.train": data_a}))
        b = _submit(c, _config(**{"data.train": data_b}))
        done_a = wait_state(c, a["id"], {"SUCCEEDED", "FAILED"}, 300)
        done_b = wait_state(c, b["id"], {"SUCCEEDED", "FAILED"}, 300)
    assert done_a["state"] == done_b["state"] == "SUCCEEDED", (done_a, done_b)
    assert done_a["run_dir"] != done_b["run_dir"]
    assert_exactly_once(trained_keys(Path(done_a["run_dir"])), keys_a)
    assert_exactly_once(trained_keys(Path(done_b["run_dir"])), keys_b)
    qa = (Path(done_a["run_dir"]) / "config" / "context.json").read_text()
    qb = (Path(done_b["run_dir"]) / "config" / "context.json").read_text()
    assert qa != qb


def test_stop_checkpoints_and_resume_finishes_with_every_sample_trained_once(server, demo):
    data, keys = _corpus(server, demo, "c", 64)
    with server.client() as c:
        rid = _submit(c, _config(**{"data.train": data, "trainers": 2}))["id"]
        _wait_step(c, rid, 2)
        r = c.post(f"/v1/runs/{rid}/stop", json={"grace_s": 120})
        assert r.status_code == 202 and r.json()["state"] in ("RUNNING", "STOPPING")
        stopped = wait_state(c, rid, {"STOPPED", "FAILED"}, 180)
        assert stopped["state"] == "STOPPED", stopped
        assert "checkpointed" in stopped["reason"]
        run_dir = Path(stopped["run_dir"])
        assert stopped["checkpoint"]["step"] == stopped["step"]
        series = c.get(f"/v1/runs/{rid}/metrics").json()["steps"]
        assert series[-1]["step"] == stopped["step"]  # the curve reaches the stop's checkpoint
        assert all(
            p["state"] != "running" for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]
        )
        before = trained_keys(run_dir)
        assert 0 < len(before) < len(keys)

        r = c.post(f"/v1/runs/{rid}/resume")
        assert r.status_code == 202, r.text
        done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
        assert done["state"] == "SUCCEEDED", done
        assert_exactly_once(trained_keys(run_dir), keys)


def test_two_runs_on_one_external_queue_each_train_their_own_samples_once(tmp_path, demo):
    # the compose layout: one queue server, the control plane pointed at it (--queue); run a
    # takes that default, run b names the queue in its config; neither starts a queue
    from services.queue.client import QueueClient
    from tests.services.queue.conftest import ServerProcess

    queue = ServerProcess(tmp_path, "--capacity", "512MiB")
    server = ControlServer(tmp_path / "server", extra=["--queue", queue.address])
    try:
        data_a, keys_a = _corpus(server, demo, "a", 32)
        data_b, keys_b = _corpus(server, demo, "b", 32, start=32)
        with server.client() as c, QueueClient(queue.address, timeout_s=10, name="t") as q:
            a = _submit(c, _config(**{"data.train": data_a}))
            b = _submit(c, _config(**{"data.train": data_b, "queue.address": queue.address}))
            seen: set[str] = set()
            views: dict[str, set[str]] = {a["id"]: set(), b["id"]: set()}
            while True:
                seen |= set(q.list()["partitions"])
                for rid in views:
                    stats = c.get(f"/v1/runs/{rid}/queue").json()["stats"] or {}
                    views[rid] |= set(stats.get("partitions") or {})
                states = [c.get(f"/v1/runs/{r}").json()["state"] for r in views]
                if all(s in ("SUCCEEDED", "FAILED") for s in states):
                    break
                time.sleep(0.5)
            done_a = c.get(f"/v1/runs/{a['id']}").json()
            done_b = c.get(f"/v1/runs/{b['id']}").json()
            assert done_a["state"] == done_b["state"] == "SUCCEEDED", (done_a, done_b)
            for run in (done_a, done_b):
                assert run["queue"] == queue.address
                assert run["config"]["queue"]["address"] == queue.address
                assert "queue" not in _pids(c, run["id"])
        # every partition on the shared queue belongs to one of the runs, by its id
        assert seen and all(p.startswith((f"{a['id']}.", f"{b['id']}.")) for p in seen), seen
        assert f"{a['id']}.train" in seen and f"{b['id']}.train" in seen
        # each run's queue view shows its own partitions only
        assert views[a["id"]] and all(p.startswith(f"{a['id']}.") for p in views[a["id"]])
        assert views[b["id"]] and all(p.startswith(f"{b['id']}.") for p in views[b["id"]])
        assert_exactly_once(trained_keys(Path(done_a["run_dir"])), keys_a)
        assert_exactly_once(trained_keys(Path(done_b["run_dir"])), keys_b)
    finally:
        server.stop()
        queue.stop()


def test_a_restarted_shared_queue_recovers_its_run_which_trains_every_sample(tmp_path, demo):
    # the compose queue service SIGKILLed and started again on its address without --data-dir:
    # the control plane sees a new instance, and the run starts again on it from its checkpoint
    from tests.services.queue.conftest import ServerProcess

    args = ("--bind", f"tcp://127.0.0.1:{free_port()}", "--capacity", "512MiB")
    queues = [ServerProcess(tmp_path, *args)]
    server = ControlServer(tmp_path / "server", extra=["--queue", queues[0].address])
    try:
        data, keys = _corpus(server, demo, "c", 64)
        with server.client() as c:
            rid = _submit(c, _config(**{"data.train": data}))["id"]
            run_dir = Path(_wait_step(c, rid, 3)["run_dir"])
            before = _pids(c, rid)
            os.kill(queues[0].proc.pid, signal.SIGKILL)  # every sample of the run is gone
            queues[0].proc.wait(10)
            queues.append(ServerProcess(tmp_path, *args))
            done = wait_state(c, rid, {"SUCCEEDED", "FAILED"}, 300)
            assert done["state"] == "SUCCEEDED", done
            after = _pids(c, rid)
        assert after["collator"] != before["collator"] and after["trainer0"] != before["trainer0"]
        events = Store(server.runs_root / "control.db").events(rid)
        (event,) = [e["data"] for e in events if e["kind"] == "queue_restarted"]
        assert event["durable"] is False and event["address"] == queues[0].address
        # a trainer rank may die first on a lease of the old instance; the run restarts anyway
        causes = [e["data"]["reason"] for e in events if e["data"].get("state") == "RECOVERING"]
        assert any(r.startswith("queue restarted: epoch ") for r in causes), causes
        trained = trained_keys(run_dir)
        assert set(trained) == set(keys)  # every sample, though the queue lost them all
        # what the trainer trained after its last checkpoint (every 2 steps of 4 samples) before
        # it died on the old instance's lease is trained again, once
        again = {k for k in trained if trained.count(k) > 1}
        assert len(again) <= 8 and all(trained.count(k) == 2 for k in again), again
    finally:
        server.stop()
        for queue in queues:
            queue.stop()
