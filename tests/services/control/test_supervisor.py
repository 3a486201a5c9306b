"""The Supervisor without HTTP: the run state machine, the restart policy per role with backoff and
budget, heartbeats (a frozen process is dead), stop, and re-attachment after a restart of the
control plane. The run's processes are real subprocesses that play a script (exit after N seconds
with a code, or run until signalled) in place of the workers, so each case takes seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from services.collator.config import CollatorConfig
from services.common import config as cfgmod
from services.common.config import ConfigError
from services.control.states import Conflict, RunNotFound
from services.control.store import Store
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig
from tests.services.control.conftest import FOREVER, LIFECYCLE, tiny_config


def wait_state(sup, run_id, states, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = sup.get(run_id)
        if run["state"] in states:
            return run
        time.sleep(0.05)
    raise AssertionError(f"run not in {states}: {sup.get(run_id)}\n{sup.events(run_id)}")


def kinds(sup, run_id):
    return [
        (e["kind"], e["data"].get("state") or e["data"].get("process")) for e in sup.events(run_id)
    ]


def test_a_run_whose_trainers_finish_goes_through_its_states_to_succeeded(make):
    sup = make({"trainer0": [(1.0, 0)]})
    run = sup.submit(tiny_config())
    done = wait_state(sup, run["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done
    states = [s for k, s in kinds(sup, run["id"]) if k == "state"]
    assert states == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    procs = {p["name"]: p for p in sup.processes(run["id"])}
    assert set(procs) == {"queue", "collator", "teacher0", "trainer0"}
    assert procs["trainer0"]["exit_code"] == 0
    assert all(p["state"] != "running" for p in procs.values()), procs  # everything stopped
    assert all(p["pid"] and p["host"] for p in procs.values())


def test_a_teacher_crash_restarts_it_in_place_after_its_backoff(make):
    sup = make({"teacher0": [(0.3, 1), FOREVER], "trainer0": [(3.0, 0)]})
    run = sup.submit(tiny_config(restart_backoff_s=0.4))
    rid = run["id"]
    wait_state(sup, rid, {"RECOVERING"})
    assert "teacher0 exited with code 1: restart 1 of 2 (process)" in sup.get(rid)["reason"]
    assert sup.get(rid)["attempt"] == 1
    done = wait_state(sup, rid, {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done
    launcher = sup.launchers[-1]
    assert launcher.starts["teacher0"] == 2 and launcher.starts["trainer0"] == 1
    ev = [e for e in sup.events(rid) if e["kind"] == "recovering"][0]
    assert ev["data"]["delay_s"] == pytest.approx(0.4)
    restarted = [e for e in sup.events(rid) if e["kind"] == "restarted"][0]
    assert restarted["time"] - ev["time"] >= 0.35  # the backoff was waited
    states = [s for k, s in kinds(sup, rid) if k == "state"]
    assert states[-3:] == ["RECOVERING", "RUNNING", "SUCCEEDED"], states
    assert {p["name"]: p["restarts"] for p in sup.processes(rid)}["teacher0"] == 1


def test_a_trainer_rank_crash_restarts_every_rank_on_a_new_rendezvous_port(make):
    sup = make({"trainer0": [FOREVER, (0.5, 0)], "trainer1": [(0.5, -9 % 256), (0.5, 0)]})
    run = sup.submit(tiny_config(trainers=2, restart_backoff_s=0.1))
    done = wait_state(sup, run["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done
    launcher = sup.launchers[-1]
    assert launcher.starts == {
        "queue": 1,
        "collator": 1,
        "teacher0": 1,
        "trainer0": 2,
        "trainer1": 2,
    }
    ports = [e["MASTER_PORT"] for e in launcher.envs["trainer0"]]
    assert ports[0] != ports[1]
    assert [e["MASTER_PORT"] for e in launcher.envs["trainer1"]] == ports
    rec = [e["data"] for e in sup.events(run["id"]) if e["kind"] == "recovering"]
    assert [(r["process"], r["scope"]) for r in rec] == [("trainer1", "group")]


def test_a_spent_budget_fails_the_run_naming_the_process_code_and_log(make):
    sup = make({"teacher0": [(0.2, 5)]})
    run = sup.submit(tiny_config(max_restarts=1, restart_backoff_s=0.05))
    done = wait_state(sup, run["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "FAILED"
    assert done["failed_process"] == "teacher0" and done["exit_code"] == 5
    assert "restart budget of teacher0 spent (1 of 1)" in done["reason"]
    assert "boom: exiting with 5" in done["log_tail"]
    assert sup.launchers[-1].starts["teacher0"] == 2
    assert all(p["state"] != "running" for p in sup.processes(run["id"]))


def test_a_deterministic_failure_fails_the_run_without_a_restart(make):
    sup = make({"teacher0": [(0.2, 2)]})  # exit 2: bad input or config
    run = sup.submit(tiny_config(max_restarts=3, restart_backoff_s=0.05))
    done = wait_state(sup, run["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "FAILED" and done["exit_code"] == 2
    assert "not restarted" in done["reason"]
    assert sup.launchers[-1].starts["teacher0"] == 1


def test_stop_ends_an_active_run_and_only_an_active_one(make):
    sup = make({})
    run = sup.submit(tiny_config())
    wait_state(sup, run["id"], {"RUNNING"})
    time.sleep(0.5)  # the stand-ins have their SIGTERM handler
    sup.stop(run["id"], grace_s=5)
    done = wait_state(sup, run["id"], {"STOPPED"})
    assert "checkpointed" in done["reason"]
    assert all(p["state"] != "running" for p in sup.processes(run["id"]))
    with pytest.raises(Conflict, match="only a run in .*RUNNING.* can be stopped"):
        sup.stop(run["id"])
    with pytest.raises(RunNotFound):
        sup.stop("nope")


def test_the_queue_figures_name_its_address_and_are_none_until_it_answers(make):
    sup = make({})
    run = sup.submit(tiny_config())
    wait_state(sup, run["id"], {"RUNNING"})
    q = sup.queue(run["id"])
    assert q["run_id"] == run["id"]
    assert q["address"] == sup.get(run["id"])["queue"] and q["address"]
    assert q["stats"] is None and q["updated"] is None  # the stand-in queue never answers
    with pytest.raises(RunNotFound):
        sup.queue("nope")


@pytest.mark.parametrize("teacher", ["heartbeat", "no-heartbeat"])
def test_a_frozen_process_stops_heart_beating_and_is_restarted(make, teacher):
    # with a heartbeat file its beats stop; without one (before its first beat) it is state T
    plan = [LIFECYCLE] if teacher == "heartbeat" else [FOREVER]
    sup = make({"trainer0": [(30.0, 0)], "teacher0": plan}, dead_after_s=0.5)
    run = sup.submit(tiny_config(restart_backoff_s=0.05, heartbeat_s=0.1, hang_after_s=5.0))
    wait_state(sup, run["id"], {"RUNNING"})
    pid = sup.launchers[-1].processes["teacher0"].pid
    if teacher == "heartbeat":
        deadline = time.monotonic() + 20
        while _row(sup, run["id"], "teacher0")["last_heartbeat"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    deadline = t0 + 10
    while sup.launchers[-1].starts["teacher0"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    detect = time.monotonic() - t0
    assert sup.launchers[-1].starts["teacher0"] == 2
    assert detect < 2.0
    assert ("unresponsive", "teacher0") in kinds(sup, run["id"])
    why = [e["data"]["reason"] for e in sup.events(run["id"]) if e["kind"] == "unresponsive"][0]
    assert (
        why.endswith("frozen") and ("no heartbeat" if teacher == "heartbeat" else "state T") in why
    )
    exited = [e["data"] for e in sup.events(run["id"]) if e["kind"] == "exited"]
    assert exited[0] == {"process": "teacher0", "role": "teacher", "code": -9}
    sup.stop(run["id"], grace_s=2)
    wait_state(sup, run["id"], {"STOPPED"})


def test_a_hung_main_loop_is_detected_by_its_heartbeat_and_restarted(make, tmp_path, monkeypatch):
    # teacher0 runs the real lifecycle; its main loop hangs at its 5th progress (once: the
    # restarted one finds the marker); its heartbeat thread goes on beating
    monkeypatch.setenv("XTOKEN_TEST_HANG", f"teacher0:5:{tmp_path / 'hung'}")
    sup = make({"teacher0": [LIFECYCLE], "trainer0": [FOREVER]}, dead_after_s=2.0)
    run = sup.submit(tiny_config(restart_backoff_s=0.05, heartbeat_s=0.2, hang_after_s=1.0))
    rid = run["id"]
    wait_state(sup, rid, {"RUNNING"})
    deadline = time.monotonic() + 20
    while not (tmp_path / "hung").exists():
        assert time.monotonic() < deadline, sup.launchers[-1].processes["teacher0"].tail()
        time.sleep(0.02)
    hung_at = time.monotonic()
    beat = _row(sup, rid, "teacher0")["last_heartbeat"]
    assert beat is not None and abs(beat - time.time()) < 2.0  # the real beat, not "now"
    while sup.launchers[-1].starts["teacher0"] < 2:
        assert time.monotonic() - hung_at < 10, sup.events(rid)
        time.sleep(0.02)
    detect = time.monotonic() - hung_at
    assert 1.0 <= detect < 1.0 + 2.0, detect  # hang_after_s, plus a beat and a tick or two
    unresponsive = [e["data"] for e in sup.events(rid) if e["kind"] == "unresponsive"]
    assert [u["process"] for u in unresponsive] == ["teacher0"]
    assert "hung" in unresponsive[0]["reason"] and "hang_after_s=1" in unresponsive[0]["reason"]
    exited = [e["data"] for e in sup.events(rid) if e["kind"] == "exited"]
    assert exited[0] == {"process": "teacher0", "role": "teacher", "code": -9}
    # the restarted teacher beats and moves: no second kill, and its row shows fresh beats
    time.sleep(2.0)
    assert sup.launchers[-1].starts["teacher0"] == 2
    assert sup.get(rid)["state"] == "RUNNING"
    row = _row(sup, rid, "teacher0")
    assert row["restarts"] == 1 and time.time() - row["last_heartbeat"] < 1.0
    sup.stop(rid, grace_s=5)
    wait_state(sup, rid, {"STOPPED"})


def _row(sup, rid, name):
    return {p["name"]: p for p in sup.processes(rid)}[name]


def test_a_new_supervisor_reattaches_the_live_processes_and_goes_on(make, tmp_path):
    store = Store(tmp_path / "control.db")
    sup = make({"trainer0": [(4.0, 0)]}, store=store)
    run = sup.submit(tiny_config(restart_backoff_s=0.05))
    rid = run["id"]
    wait_state(sup, rid, {"RUNNING"})
    time.sleep(0.3)
    pids = {p["name"]: p["pid"] for p in sup.processes(rid)}
    sup.shutdown()  # the control plane goes away; its runs' processes do not
    assert all(os.kill(pid, 0) is None for pid in pids.values())

    sup2 = make({"teacher0": [FOREVER]}, store=store)
    sup2.recover()
    assert sup2.get(rid)["state"] == "RUNNING"
    assert ("reattached", None) in kinds(sup2, rid)
    assert {p["name"]: p["pid"] for p in sup2.processes(rid)} == pids
    # a re-attached process that dies (no exit code: not our child) is restarted per policy
    os.killpg(pids["teacher0"], signal.SIGKILL)
    done = wait_state(sup2, rid, {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done  # trainer0's end is read from summary.json
    assert sup2.launchers[-1].starts == {"teacher0": 1}


def test_a_reattached_run_restarts_its_processes_with_the_sections_they_were_launched_with(
    make, tmp_path
):
    store = Store(tmp_path / "control.db")
    sup = make({}, store=store)
    rid = sup.submit(tiny_config(restart_backoff_s=0.05))["id"]
    wait_state(sup, rid, {"RUNNING"})
    time.sleep(0.3)  # the runtime record is saved
    config_dir = Path(sup.get(rid)["run_dir"]) / "config"
    launched = {p.name: p.read_bytes() for p in sorted(config_dir.glob("*.json"))}
    assert Path(json.loads(launched["trainer.json"])["loss"]["projection"]).is_file()
    sup.shutdown()

    sup2 = make({}, store=store)
    sup2.recover()
    assert sup2.get(rid)["state"] == "RUNNING"
    assert {p.name: p.read_bytes() for p in sorted(config_dir.glob("*.json"))} == launched
    # a trainer rank that dies after the re-attach restarts its group from the same section
    trainer0 = {p["name"]: p["pid"] for p in sup2.processes(rid)}["trainer0"]
    os.killpg(trainer0, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while sup2.launchers[-1].starts.get("trainer0", 0) < 1:
        assert time.monotonic() < deadline, sup2.events(rid)
        time.sleep(0.05)
    assert {p.name: p.read_bytes() for p in sorted(config_dir.glob("*.json"))} == launched


def _running_then_gone(make, store) -> str:
    """A run started, its control plane shut down and every process of it SIGKILLed; its id."""
    sup = make({}, store=store)
    rid = sup.submit(tiny_config())["id"]
    wait_state(sup, rid, {"RUNNING"})
    pids = [p["pid"] for p in sup.processes(rid)]
    sup.shutdown()
    for pid in pids:
        os.killpg(pid, signal.SIGKILL)
    for launcher in sup.launchers:
        for proc in launcher.processes.values():
            proc.popen.wait(5)
    return rid


def test_a_run_with_no_process_left_after_a_restart_is_interrupted_and_resumable(make, tmp_path):
    store = Store(tmp_path / "control.db")
    rid = _running_then_gone(make, store)

    sup2 = make({"trainer0": [(0.5, 0)]}, store=store)
    sup2.recover()
    run = sup2.get(rid)
    assert run["state"] == "INTERRUPTED" and "resume it" in run["reason"]
    assert {p["state"] for p in sup2.processes(rid)} == {"gone"}
    sup2.resume(rid)
    assert wait_state(sup2, rid, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
    with pytest.raises(Conflict, match="can be resumed"):
        sup2.resume(rid)


def test_a_run_the_control_plane_died_while_starting_is_started_again(make, tmp_path):
    store = Store(tmp_path / "control.db")
    rid = _running_then_gone(make, store)
    store.update_run(rid, state="STARTING", runtime=None)  # as when it died mid-launch

    sup2 = make({"trainer0": [(0.5, 0)]}, store=store)
    sup2.recover()
    assert wait_state(sup2, rid, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
    relaunched = [e for e in sup2.events(rid) if e["kind"] == "relaunched"]
    assert relaunched and "while it was starting the run" in relaunched[0]["text"]


def test_a_resume_is_an_event_on_the_run_naming_the_checkpoint_it_goes_on_from(make):
    sup = make({})
    rid = sup.submit(tiny_config())["id"]
    wait_state(sup, rid, {"RUNNING"})
    sup.stop(rid, grace_s=5)
    run_dir = Path(wait_state(sup, rid, {"STOPPED"})["run_dir"])
    (run_dir / "checkpoints" / "step_6").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_6")

    sup.resume(rid)
    wait_state(sup, rid, {"RUNNING"})
    resumed = [e for e in sup.events(rid) if e["kind"] == "resumed"]
    assert [e["data"] for e in resumed] == [
        {"from_state": "STOPPED", "step": 6, "checkpoint": str(run_dir / "checkpoints" / "step_6")}
    ]
    assert resumed[0]["text"] == "resumed from STOPPED at the checkpoint of step 6"
    seq = kinds(sup, rid)
    at = seq.index(("resumed", None))
    assert seq[at - 1 : at + 2] == [("state", "STOPPED"), ("resumed", None), ("state", "PENDING")]
    assert [r["id"] for r in sup.list()] == [rid]  # the same record, no second one


def test_a_reused_pid_is_not_reattached(tmp_path):
    from services.launch.spec import ProcessSpec
    from services.supervise.attach import attach, identity

    spec = ProcessSpec("teacher0", "teacher", ["teacher"], log_file=str(tmp_path / "t.log"))
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "services.cli", "teacher"]
    )
    try:
        deadline = time.monotonic() + 10  # until it has exec'd (a fork shows pytest's cmdline)
        while "services.cli" not in identity(p.pid)["cmdline"] and time.monotonic() < deadline:
            time.sleep(0.01)
        ticks = identity(p.pid)["start_ticks"]
        assert attach(spec, p.pid, ticks) is not None
        assert attach(spec, p.pid, ticks + 1) is None  # another process under the same pid
        other = ProcessSpec("trainer0", "trainer", ["trainer"], log_file="x")
        assert attach(other, p.pid, ticks) is None  # not the command it was started with
    finally:
        p.kill()
        p.wait()
    assert attach(spec, p.pid, ticks) is None


def test_the_store_keeps_runs_processes_and_events_across_connections(tmp_path):
    db = tmp_path / "c.db"
    s = Store(db)
    s.create_run("r1", "one", {"a": 1}, "/runs/r1")
    s.update_run("r1", state="RUNNING", runtime={"queue": "tcp://x"})
    s.put_process("r1", "teacher0", role="teacher", host="h", pid=5, state="running")
    s.put_process("r1", "teacher0", restarts=2)
    ev = s.add_event("r1", "state", {"state": "RUNNING"})
    s.close()
    s = Store(db)
    run = s.get_run("r1")
    assert (run["state"], run["config"], run["runtime"]) == (
        "RUNNING",
        {"a": 1},
        {"queue": "tcp://x"},
    )
    p = s.processes("r1")[0]
    assert (p["pid"], p["restarts"], p["role"]) == (5, 2, "teacher")
    assert s.events("r1") == [ev] and s.events("r1", after=ev["id"]) == []
    with pytest.raises(ValueError, match="exists already"):
        s.create_run("r1", "x", {}, "/x")
    with pytest.raises(ValueError, match="unknown run fields"):
        s.update_run("r1", nope=1)
    assert json.loads(json.dumps(s.list_runs()))[0]["id"] == "r1"


@pytest.fixture
def external_queue(tmp_path):
    """A `xtoken queue serve` of its own (as the compose `queue` service): its address."""
    from tests.services.queue.conftest import ServerProcess

    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


def test_a_run_on_the_default_queue_starts_none_and_uses_partitions_of_its_own(
    make, external_queue
):
    from services.queue.client import QueueClient

    sup = make({"trainer0": [FOREVER]}, default_queue=external_queue)
    run = sup.submit(tiny_config())
    rid = run["id"]
    assert run["config"]["queue"] == {"address": external_queue}  # recorded: resume uses it
    wait_state(sup, rid, {"RUNNING"})
    assert sup.get(rid)["queue"] == sup.queue(rid)["address"] == external_queue
    launcher = sup.launchers[-1]
    assert "queue" not in launcher.starts and "queue" not in {p["name"] for p in sup.processes(rid)}
    run_dir = Path(run["run_dir"])

    def written(name: str, config_class: type) -> dict:  # as the process reads it
        shared = json.loads((run_dir / "config" / "context.json").read_text())
        section = json.loads((run_dir / "config" / f"{name}.json").read_text())
        return cfgmod.with_context(config_class, section, shared)

    assert written("collator", CollatorConfig)["worker"]["partition"] == f"{rid}.train"
    for section, config_class in (("trainer", TrainerConfig), ("teacher0", TeacherConfig)):
        cfg = written(section, config_class)
        assert cfg["queue"] == external_queue and cfg["partition"] == f"{rid}.train"

    # what a launch leaves in the run's partitions is cleared by the next (resume): a fresh start
    # as on a queue of its own; another run's partitions there are left alone
    with QueueClient(external_queue, timeout_s=10, name="test") as client:
        client.put(f"{rid}.train", ["k0"], {"x": np.zeros((1, 2), np.int64)})
        client.put("other.train", ["k0"], {"x": np.zeros((1, 2), np.int64)})
        sup.stop(rid, grace_s=5)
        wait_state(sup, rid, {"STOPPED"})
        sup.resume(rid)
        wait_state(sup, rid, {"RUNNING"})
        assert client.list(f"{rid}.train")["keys"] == []
        assert client.list("other.train")["keys"] == ["k0"]
    assert sup.launchers[-1].starts.get("queue") is None


def test_a_config_may_keep_a_queue_of_its_own_or_name_another(make, external_queue):
    sup = make({"trainer0": [FOREVER]}, default_queue="tcp://127.0.0.1:9")
    own = sup.submit(tiny_config(**{"queue.address": None}))
    assert own["config"]["queue"] == {"address": None}
    named = sup.submit(tiny_config(**{"queue.address": external_queue}))
    wait_state(sup, own["id"], {"RUNNING"})
    wait_state(sup, named["id"], {"RUNNING"})
    assert sup.launchers[0].starts["queue"] == 1 and sup.get(own["id"])["queue"] != external_queue
    assert (
        "queue" not in sup.launchers[1].starts and sup.get(named["id"])["queue"] == external_queue
    )
    with pytest.raises(ConfigError, match=r"queue: address='5555' is not a queue address: use tcp"):
        sup.submit(tiny_config(**{"queue.address": "5555"}))


def test_the_snapshot_has_the_memory_of_every_trainer_rank_and_every_teachers_groups(make):
    from services.control import prometheus
    from services.control.states import STATES

    sup = make({})
    further = {"tokenizer": "qwen3", "model": "tiny", "groups": 2}
    run = sup.submit(tiny_config(trainers=2, teachers=2, extra_teachers=[further]))
    rid = run["id"]
    wait_state(sup, rid, {"RUNNING"})
    metrics = Path(run["run_dir"]) / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    figures = {"trainer.rank0": 10.0, "trainer.rank1": 11.0, "teacher.group1": 21.0,
               "t1.teacher.group0": 30.0, "t1.teacher.group1": 31.0}  # fmt: skip
    for name, mb in figures.items():
        with open(metrics / f"{name}.jsonl", "a") as f:  # an older figure, then the latest
            f.write(json.dumps({"event": "step", "memory_mb": 1.0}) + "\n")
            f.write(json.dumps({"event": "step", "memory_mb": mb}) + "\n")
    deadline = time.monotonic() + 10
    while len(memory := sup.snapshot()["runs"][0]["memory"]) < 5:
        assert time.monotonic() < deadline, memory
        time.sleep(0.05)
    assert memory == [
        {"role": "teacher", "teacher": 0, "rank": 1, "mb": 21.0, "memory": "host"},
        {"role": "teacher", "teacher": 1, "rank": 0, "mb": 30.0, "memory": "host"},
        {"role": "teacher", "teacher": 1, "rank": 1, "mb": 31.0, "memory": "host"},
        {"role": "trainer", "rank": 0, "mb": 10.0, "memory": "host"},
        {"role": "trainer", "rank": 1, "mb": 11.0, "memory": "host"},
    ]
    text = prometheus.render(sup.snapshot(), states=STATES, now=time.time())
    line = f'xtoken_process_memory_bytes{{run="{rid}",role="trainer",rank="1",memory="host"}}'
    assert f"{line} {11 * 2**20}" in text
    for teacher, group, mb in ((0, 1, 21), (1, 0, 30), (1, 1, 31)):
        line = (f'xtoken_process_memory_bytes{{run="{rid}",role="teacher",teacher="{teacher}",'
                f'rank="{group}",memory="host"}}')  # fmt: skip
        assert f"{line} {mb * 2**20}" in text
    sup.stop(rid, grace_s=5)
    wait_state(sup, rid, {"STOPPED"})


def test_a_rollout_worker_restarts_in_place_and_its_figures_reach_the_run_and_the_exposition(
    make,
):
    from services.control import prometheus
    from services.control.states import STATES

    sup = make({"rollout0": [(0.3, 1), FOREVER], "trainer0": [(3.0, 0)]})
    run = sup.submit(
        tiny_config(
            **{"data.on_policy_fraction": 0.5, "rollout.max_new_tokens": 16},
            restart_backoff_s=0.2,
        )
    )
    rid = run["id"]
    metrics = Path(run["run_dir"]) / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    batch = {"event": "rollout", "time": 1.0, "version": 3, "tokens_per_s": 250.0,
             "samples_per_s": 4.0, "pending": 2, "wait_s": 0.1}  # fmt: skip
    (metrics / "rollout0.jsonl").write_text(json.dumps(batch) + "\n")
    on_policy = {"samples": 2, "mean_staleness": 1.5, "dropped_stale": 3, "wait_s": 0.0,
                 "teacher_logprob_per_byte": -2.0}  # fmt: skip
    step = {"event": "step", "time": 2.0, "step": 1, "loss": 1.0, "on_policy": on_policy}
    (metrics / "trainer.rank0.jsonl").write_text(json.dumps(step) + "\n")
    deadline = time.monotonic() + 10
    while not (rows := sup.get(rid)["rollouts"]):
        assert time.monotonic() < deadline, "no rollout figures"
        time.sleep(0.05)
    assert rows == [{"worker": 0, "time": 1.0, "version": 3, "tokens_per_s": 250.0,
                     "samples_per_s": 4.0, "pending": 2, "wait_s": 0.1}]  # fmt: skip
    text = prometheus.render(sup.snapshot(), states=STATES, now=time.time())
    assert f'xtoken_rollout_tokens_per_second{{run="{rid}",rank="0"}} 250' in text
    assert f'xtoken_on_policy_staleness{{run="{rid}"}} 1.5' in text
    assert f'xtoken_on_policy_dropped_stale_total{{run="{rid}"}} 3' in text
    done = wait_state(sup, rid, {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done
    procs = {p["name"]: p for p in sup.processes(rid)}
    assert procs["rollout0"]["role"] == "rollout" and procs["rollout0"]["restarts"] == 1
    assert sup.launchers[-1].starts["rollout0"] == 2  # in place: the trainer ran on
    assert sup.launchers[-1].starts["trainer0"] == 1
