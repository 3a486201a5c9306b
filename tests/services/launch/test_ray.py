"""RayLauncher on a real local Ray cluster: workers as actors' subprocesses, ready files, signals
and exit codes (a SIGKILL is the worker's death), GPU bundles, colocation, placement errors."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import time

import pytest

from services.launch import make_launcher
from services.launch.base import Launcher
from services.launch.spec import ProcessSpec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def _queue_spec(tmp_path, name: str = "queue", **kw) -> ProcessSpec:
    return ProcessSpec(
        name,
        kw.pop("role", "queue"),
        ["queue", "serve", "--bind", "tcp://127.0.0.1:*", "--capacity", "16MiB"],
        log_file=str(tmp_path / "logs" / f"{name}.log"),
        ready_file=str(tmp_path / "ready" / name),
        **kw,
    )


def _environ(pid: int) -> dict[str, str]:
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _ppid(pid: int) -> int:
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_code(proc, timeout_s: float = 30.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()


@pytest.fixture
def launcher(ray_cluster):
    launcher = make_launcher("ray", ray_cluster, place_timeout_s=5.0)
    yield launcher
    launcher.close()


def test_a_worker_runs_under_its_actor_reports_ready_and_a_sigkill_is_its_death(
    launcher, tmp_path
):
    assert isinstance(launcher, Launcher)
    proc = launcher.start(_queue_spec(tmp_path))
    info = launcher.wait_ready(proc, 60)
    assert info["pid"] == proc.pid and info["endpoint"].startswith("tcp://127.0.0.1:")
    assert proc.host == socket.gethostname()
    actor_pid = _ppid(proc.pid)  # the worker is the actor's child, in its own process group
    assert "WorkerActor" in pathlib.Path(f"/proc/{actor_pid}/cmdline").read_text()
    assert os.getpgid(proc.pid) == proc.pid
    assert _environ(proc.pid)["XTOKEN_PARENT_PID"] == str(actor_pid)
    assert "[queue] ready" in proc.tail()
    with pytest.raises(ValueError, match="'queue' is already running"):
        launcher.start(_queue_spec(tmp_path))

    os.kill(proc.pid, signal.SIGKILL)  # from outside, as a crash or the OOM killer would
    assert _wait_code(proc) == -signal.SIGKILL
    deadline = time.monotonic() + 20
    while _alive(actor_pid) and time.monotonic() < deadline:  # ray.kill is asynchronous
        time.sleep(0.1)
    assert not _alive(actor_pid), "the actor of an ended worker is released"
    assert "[queue] ready" in proc.tail()  # kept after the actor is gone
    assert launcher.stop(grace_s=5) == {"queue": -signal.SIGKILL}


def test_stop_sigterms_through_the_actor_and_the_worker_drains_to_exit_zero(launcher, tmp_path):
    first = launcher.start(_queue_spec(tmp_path, "q"))
    launcher.wait_ready(first, 60)
    assert launcher.stop(["q"], grace_s=30) == {"q": 0}
    assert not _alive(first.pid)
    assert "stopped (SIGTERM), exit code 0" in first.tail()
    assert not (tmp_path / "ready" / "q").exists()
    second = launcher.start(_queue_spec(tmp_path, "q"))  # a restart under the same name
    assert second.pid != first.pid and launcher.processes["q"] is second
    launcher.wait_ready(second, 60)
    second.signal(signal.SIGKILL)
    assert _wait_code(second) == -signal.SIGKILL


def test_a_process_that_exits_before_ready_raises_with_its_log_tail(launcher, tmp_path):
    spec = ProcessSpec(
        "teacher0",
        "teacher",
        ["teacher", "--slots", "1"],
        log_file=str(tmp_path / "teacher0.log"),
        ready_file=str(tmp_path / "ready" / "teacher0"),
    )
    proc = launcher.start(spec)
    with pytest.raises(RuntimeError) as exc:
        launcher.wait_ready(proc, 60)
    message = str(exc.value)
    assert "teacher0 exited with code 2 before it was ready" in message
    assert "[teacher] error: slots=1: the ring needs >= 2 slots" in message
    assert launcher.stop(grace_s=1) == {"teacher0": 2}


def test_gpu_bundles_set_the_ranks_devices_and_a_group_shares_one_node(launcher, tmp_path):
    ranks = []
    for r in range(2):
        env = {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
        spec = _queue_spec(tmp_path, f"trainer{r}", role="trainer", env=env,
                           resources={"gpu": 1}, group="0")
        ranks.append(launcher.start(spec))
    for proc in ranks:
        launcher.wait_ready(proc, 60)
    envs = [_environ(p.pid) for p in ranks]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "1"]  # Ray's assignment
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]  # each rank sees its one GPU as 0
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["MASTER_ADDR"] for e in envs] == ["127.0.0.1"] * 2  # one node: unchanged
    assert ranks[0].node["node_id"] == ranks[1].node["node_id"]
    assert [p.node["gpu_ids"] for p in ranks] in (
        [["0"], ["1"]],
        [["1"], ["0"]],
    )

    with pytest.raises(ValueError, match=r"cannot place trainer2: the cluster has no room for "
                                         r"\{'GPU': 1.0, 'CPU': 0.25\}.*ray status"):
        launcher.start(_queue_spec(tmp_path, "trainer2", role="trainer", resources={"gpu": 1}))
    assert "trainer2" not in launcher.processes
    codes = launcher.stop(grace_s=30)
    assert codes == {"trainer0": 0, "trainer1": 0}
    # the GPUs are free again: a new rank gets one
    again = launcher.start(_queue_spec(tmp_path, "trainer2", role="trainer", resources={"gpu": 1}))
    launcher.wait_ready(again, 60)


def test_driver_variables_reach_the_worker_but_not_its_parent_pid(
    launcher, tmp_path, monkeypatch
):
    monkeypatch.setenv("XTOKEN_TEST_MARK", "from-the-driver")
    monkeypatch.setenv("UNRELATED_TEST_MARK", "stays-home")
    proc = launcher.start(_queue_spec(tmp_path, env={"OMP_NUM_THREADS": "1"}))
    launcher.wait_ready(proc, 60)
    env = _environ(proc.pid)
    assert env["XTOKEN_TEST_MARK"] == "from-the-driver"
    assert "UNRELATED_TEST_MARK" not in env
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["XTOKEN_PARENT_PID"] != str(os.getpid())


def test_on_two_nodes_groups_stay_together_the_queue_by_the_driver_and_ranks_reach_rank0(
    launcher, second_node, tmp_path
):
    queue = launcher.start(_queue_spec(tmp_path, "queue"))
    rdzv = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    rank0 = launcher.start(_queue_spec(tmp_path, "trainer0", role="trainer", group="0",
                                       env={**rdzv, "RANK": "0"}, resources={"head": 1}))
    # rank 1 must land on the second node (its resource), and its teacher must follow it there
    rank1 = launcher.start(_queue_spec(tmp_path, "trainer1", role="trainer", group="1",
                                       env={**rdzv, "RANK": "1"}, resources={second_node: 1}))
    teacher1 = launcher.start(_queue_spec(tmp_path, "teacher1", role="teacher", group="1"))
    procs = [queue, rank0, rank1, teacher1]
    for proc in procs:
        launcher.wait_ready(proc, 60)
    node = {p.spec.name: p.node["node_id"] for p in procs}
    assert node["queue"] == launcher.driver_node_id  # Run talks to it at its loopback address
    assert node["trainer1"] != launcher.driver_node_id
    assert node["teacher1"] == node["trainer1"]  # colocation group "1"
    envs = {p.spec.name: _environ(p.pid) for p in procs}
    assert envs["trainer0"]["MASTER_ADDR"] == "127.0.0.1"  # rank 0 hosts the rendezvous
    assert node["trainer0"] != node["trainer1"]
    # rank 1 on another node reaches rank 0's node (Ray gives nodes the host's IP, not loopback)
    assert envs["trainer1"]["MASTER_ADDR"] == rank0.node["node_ip"]
    assert not envs["trainer1"]["MASTER_ADDR"].startswith("127.")
    assert launcher.stop(grace_s=30) == {name: 0 for name in node}


def test_the_ranks_of_a_unit_are_reserved_at_once_or_not_at_all(launcher, tmp_path):
    """A unit of three one-GPU ranks on a cluster of two GPUs: its rank 0 is refused before
    anything starts (one rank per GPU would have left the third with no room, the group
    half-started)."""

    def rank(i: int) -> ProcessSpec:
        env = {"RANK": str(i), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        name = "teacher0" if i == 0 else f"teacher0.{i}"
        return _queue_spec(tmp_path, name, role="teacher", env=env, resources={"gpu": 1},
                           group="teacher0", unit="teacher0")  # fmt: skip

    with pytest.raises(ValueError, match=r"^cannot place teacher0: the cluster has no room for 3 "
                       r"x \{'GPU': 1.0, 'CPU': 0.25\} on one node \(unit teacher0\)"):  # fmt: skip
        launcher.start(rank(0))
    assert launcher.processes == {}
    one = launcher.start(_queue_spec(tmp_path, "trainer0", role="trainer", resources={"gpu": 1}))
    launcher.wait_ready(one, 60)  # every GPU was given back


def test_a_tensor_parallel_teacher_groups_gloo_ranks_run_on_one_node_in_one_placement_group(
    launcher, second_node, tmp_path, demo, projection
):
    """A run's two-rank CPU teacher group (teacher.tensor_parallel 2, gloo, an shm ring), on a
    cluster of two nodes either of which could hold the group: its ranks hold bundles 0 and 1 of
    one STRICT_PACK placement group, on one node, rendezvous there and serve the trainer."""
    import ray

    from services.supervise.config import run_config_from_dict, run_config_to_dict
    from services.supervise.driver import Driver
    from tests.e2e.conftest import corpus_parts, step_records, tiny_run_config, wait_for

    paths, _ = corpus_parts(demo, tmp_path / "data", n=16, parts=1)
    base = tiny_run_config(tmp_path / "run", paths[0], str(demo.heldout_path), projection)
    data = run_config_to_dict(base)
    data["trainers"] = 1
    data["teacher"]["tensor_parallel"] = 2
    run = Driver(run_config_from_dict(data), launcher=launcher, progress=False)
    run.prepare()
    run.launch()
    try:
        ranks = [launcher.processes[name] for name in ("teacher0", "teacher0.1")]
        launcher.wait_ready(ranks[0], 180)  # after both ranks joined the group and loaded
        assert ranks[1].poll() is None, ranks[1].tail()
        (pg, first), (other, second) = ranks[0].bundle, ranks[1].bundle
        assert other is pg and (first, second) == (0, 1)
        table = ray.util.placement_group_table(pg)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert table["bundles"][0] == {"CPU": 0.25} == table["bundles"][1]
        assert len(set(table["bundles_to_node_id"].values())) == 1
        assert ranks[0].node["node_id"] == ranks[1].node["node_id"]
        assert ranks[0].node["node_id"] in table["bundles_to_node_id"].values()
        envs = [_environ(p.pid) for p in ranks]
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
        assert envs[1]["MASTER_ADDR"] == "127.0.0.1"  # one node: rank 0 at loopback
        wait_for(lambda: step_records(run.run_dir, 0), 240, "a step served by the group")
    finally:
        codes = launcher.stop(grace_s=30)
    assert codes["teacher0"] == 0 and codes["teacher0.1"] in (0, -signal.SIGTERM), codes
    assert pg is not None and ray.util.placement_group_table(pg)["state"] == "REMOVED"
