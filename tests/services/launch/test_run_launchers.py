"""The whole pipeline through each launcher, as a user starts it: ``xtoken run CONFIG --launcher
local`` and ``--launcher ray --ray-address ADDR`` (a real local Ray cluster): queue, collator
workers, an shm teacher and two gloo trainer ranks train every sample exactly once, the loss
falls, every process exits cleanly and none is left behind; a SIGKILLed trainer rank under Ray
is seen dead by the run, which restarts the ranks from the checkpoint without losing a sample."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import threading
import time

import pytest

from services.common.metrics import read_jsonl
from services.supervise.config import DataConfig, QueueConfig, RunCollatorConfig, RunConfig
from services.teacher.config import TeacherConfig
from tests.e2e.conftest import (
    CTX,
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    assert_exactly_once,
    corpus_parts,
    evals,
    feed_totals,
    pid_alive,
    step_records,
    tiny_trainer,
    trained_keys,
    wait_for,
    write_config,
)

LAUNCHERS = [
    pytest.param("local", marks=pytest.mark.slow),
    pytest.param("ray", marks=pytest.mark.ray),
]


def _config(tmp_path, demo, projection, n: int, **trainer) -> tuple[RunConfig, list[str]]:
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=n, parts=1)
    config = RunConfig(
        run_dir=str(tmp_path / "run"),
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=CTX,
        ctx_teacher=CTX,
        queue=QueueConfig(capacity_bytes=1 << 30),
        trainers=2,
        restart_backoff_s=0.5,
        data=DataConfig(train=str(paths[0]), heldout=str(demo.heldout_path)),
        collator=RunCollatorConfig(workers=2, batch=8),
        teacher=TeacherConfig(
            model="tiny", transport="shm", max_batch=4, max_length=CTX, checksum=True
        ),
        trainer=tiny_trainer(projection, **trainer),
    )
    return config, corpus


def _launcher_args(kind: str, request) -> list[str]:
    if kind == "local":
        return ["--launcher", "local"]
    return ["--launcher", "ray", "--ray-address", request.getfixturevalue("ray_cluster")]


def _xtoken_run(procs, tmp_path, config: RunConfig, kind: str, request):
    """``xtoken run`` of ``config`` through launcher ``kind``, as a user starts it."""
    argv = ["run", str(write_config(tmp_path / "run.json", config)), "--no-progress"]
    return procs.start("run", [*argv, *_launcher_args(kind, request)], ready=False)


class _Watcher:
    """Records the pid (and parent pid) of every process that writes a ready file in a run."""

    def __init__(self, run_dir: pathlib.Path) -> None:
        self.ready = run_dir / "ready"
        self.seen: dict[str, tuple[int, int]] = {}  # name -> (pid, ppid), the latest
        self.all_pids: set[int] = set()
        self.parents: dict[int, str] = {}  # ppid -> its command line, read while it ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for path in list(self.ready.glob("*")) if self.ready.is_dir() else []:
                try:
                    pid = json.loads(path.read_text())["pid"]
                    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                except (OSError, ValueError, KeyError):
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                self.seen[path.name] = (pid, ppid)
                self.all_pids.update((pid, ppid))
                if ppid not in self.parents:
                    self.parents[ppid] = _cmdline(ppid)
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _exit_codes(run_dir: pathlib.Path) -> dict[str, list[str]]:
    return {
        log.name: re.findall(r"exit code (-?\d+)", log.read_text(errors="replace"))
        for log in sorted((run_dir / "logs").glob("*.log"))
    }


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", LAUNCHERS)
def test_xtoken_run_trains_every_sample_once_and_every_process_exits_cleanly(
    kind, request, procs, tmp_path, demo, projection
):
    config, corpus = _config(tmp_path, demo, projection, n=44)
    run_dir = pathlib.Path(config.run_dir)
    watcher = _Watcher(run_dir)
    started = time.monotonic()
    run = _xtoken_run(procs, tmp_path, config, kind, request)
    try:
        assert run.wait(300) == 0, run.tail()
    finally:
        watcher.close()
    elapsed = time.monotonic() - started
    print(f"xtoken run --launcher {kind}: {elapsed:.1f}s")

    assert f'"launcher": "{kind}"' in run.log()
    assert set(watcher.seen) == {"queue", "teacher0", "trainer0", "trainer1"}, watcher.seen
    parents = {watcher.parents[ppid] for _, ppid in watcher.seen.values()}
    if kind == "ray":  # every worker ran as the child of its own Ray actor
        assert all("WorkerActor" in p for p in parents), parents
    else:
        assert len({ppid for _, ppid in watcher.seen.values()}) == 1  # all children of the run
    wait_for(lambda: not [p for p in watcher.all_pids if pid_alive(p)], 30,
             "every worker (and its actor) to be gone")
    codes = _exit_codes(run_dir)  # servers log theirs; workers that finish say nothing
    assert set(codes) == {"collator.log", "queue.log", "teacher0.log", "trainer0.log",
                          "trainer1.log"}
    assert all(c in ([], ["0"]) for c in codes.values()), codes
    assert codes["queue.log"] == codes["teacher0.log"] == ["0"]  # stopped by SIGTERM: drained
    for log in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.name
    teacher = watcher.seen["teacher0"][0]
    assert not list(pathlib.Path("/dev/shm").glob(f"xtk_{teacher}_*")), "the ring is left behind"

    assert_exactly_once(trained_keys(run_dir), corpus)
    assert feed_totals(run_dir)["checksum_mismatch"] == 0
    before_after = evals(run_dir)
    assert before_after["after"] < before_after["before"], before_after
    losses = [r["loss"] for r in step_records(run_dir, 0)]
    assert losses[-1] < losses[0], losses


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_sigkilled_trainer_rank_under_ray_is_restarted_from_the_checkpoint_losing_nothing(
    request, procs, tmp_path, demo, projection
):
    config, corpus = _config(tmp_path, demo, projection, n=64, schedule={"checkpoint_every": 2})
    run_dir = pathlib.Path(config.run_dir)
    watcher = _Watcher(run_dir)
    run = _xtoken_run(procs, tmp_path, config, "ray", request)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file()
                 and len(step_records(run_dir, 1)) >= 3, 240, "a checkpoint and a step after it")
        victim, actor = watcher.seen["trainer1"]
        assert "WorkerActor" in watcher.parents[actor]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: watcher.seen["trainer1"][0] != victim, 120, "trainer1 restarted")
        resumed = json.loads((run_dir / "ready" / "trainer1").read_text())["step"]
        assert run.wait(300) == 0, run.tail()
    finally:
        watcher.close()
    assert "trainer1 exited with code -9" in run.log(), run.tail()
    assert resumed > 0
    # per rank: the first generation up to the checkpoint it resumed from, then the second
    kept: list[str] = []
    for path in sorted((run_dir / "keys").glob("trainer.rank*.jsonl")):
        records = [r for r in read_jsonl(path) if r.get("event") == "trained"]
        starts = [i for i in range(1, len(records))
                  if records[i]["step"] <= records[i - 1]["step"]]
        assert len(starts) == 1, f"{path.name}: generations start at {starts}"
        first, second = records[:starts[0]], records[starts[0]:]
        assert second[0]["step"] == resumed + 1
        kept += [k for r in first if r["step"] <= resumed for k in r["keys"]]
        kept += [k for r in second for k in r["keys"]]
    assert_exactly_once(kept, corpus)
    assert feed_totals(run_dir)["checksum_mismatch"] == 0


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_sigterm_on_xtoken_run_under_ray_checkpoints_exits_zero_and_leaves_no_process(
    request, procs, tmp_path, demo, projection
):
    config, corpus = _config(tmp_path, demo, projection, n=96, feed={"grad_accum": 2})
    run_dir = pathlib.Path(config.run_dir)
    watcher = _Watcher(run_dir)
    run = _xtoken_run(procs, tmp_path, config, "ray", request)
    try:
        wait_for(lambda: step_records(run_dir, 0), 240, "the first trained step")
        run.signal(signal.SIGTERM)
        assert run.wait(120) == 0, run.tail()
    finally:
        watcher.close()
    wait_for(lambda: not [p for p in watcher.all_pids if pid_alive(p)], 30,
             "every worker and its actor to be gone")
    codes = _exit_codes(run_dir)
    assert codes["trainer0.log"] == codes["trainer1.log"] == ["0"], codes  # stopped, drained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] and summary["step"] < len(corpus) // (2 * 4 * 2), summary
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{summary['step']:08d}"  # checkpoint_every=0: written by the stop
    trained = trained_keys(run_dir)
    assert len(trained) == len(set(trained)) and set(trained) <= set(corpus)


def _kill_teacher_after_two_steps(procs, tmp_path, config, kind: str, request):
    """``xtoken run`` of ``config``: teacher0 SIGKILLed after rank 0's second step; waits for its
    successor and for the run to exit 0. Returns the run."""
    run_dir = pathlib.Path(config.run_dir)
    watcher = _Watcher(run_dir)
    run = _xtoken_run(procs, tmp_path, config, kind, request)
    try:
        wait_for(lambda: len(step_records(run_dir, 0)) >= 2, 240, "two steps of rank 0")
        victim, _ = watcher.seen["teacher0"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: watcher.seen["teacher0"][0] != victim, 120, "teacher0 restarted")
        assert run.wait(300) == 0, run.tail()
    finally:
        watcher.close()
    return run


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_teacher_placed_on_another_node_serves_topk_and_its_sigkill_loses_no_sample(
    request, procs, tmp_path, demo, projection, second_node
):
    config, corpus = _config(tmp_path, demo, projection, n=64)
    config.teacher.transport = "auto"
    config.teacher.resources = {second_node: 1}  # the teacher on the second node, by resources
    run_dir = pathlib.Path(config.run_dir)
    run = _kill_teacher_after_two_steps(procs, tmp_path, config, "ray", request)
    log = run.log()
    assert "placed apart from the trainer ranks" in log and "transport topk" in log, run.tail()
    assert "teacher0 exited with code -9" in log, run.tail()
    nodes = dict(re.findall(r"started (\w+) \(pid \d+ on [^,]+, ray node (\w+)", log))
    assert nodes["teacher0"] != nodes["trainer0"] == nodes["trainer1"], nodes
    section = json.loads((run_dir / "config" / "teacher0.json").read_text())
    assert section["transport"] == "topk"
    assert_exactly_once(trained_keys(run_dir), corpus)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_sigkilled_topk_teacher_asked_two_steps_ahead_restarts_losing_no_sample(
    request, procs, tmp_path, demo, projection
):
    """A teacher that answers through the queue, asked two steps ahead (``feed.ahead_steps:
    2``): SIGKILLed with those requests out, its successor serves them again and every sample
    trains once."""
    config, corpus = _config(tmp_path, demo, projection, n=64)
    config.teacher.transport = "topk"
    config.trainer.feed.ahead_steps = 2
    run_dir = pathlib.Path(config.run_dir)
    run = _kill_teacher_after_two_steps(procs, tmp_path, config, "local", request)
    assert "teacher0 exited with code -9" in run.log(), run.tail()
    trainer = json.loads((run_dir / "config" / "trainer.json").read_text())
    assert trainer["feed"]["ahead_steps"] == 2
    assert_exactly_once(trained_keys(run_dir), corpus)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_sigkilled_rank_of_a_tensor_parallel_teacher_restarts_its_group_losing_no_sample(
    request, procs, tmp_path, demo, projection
):
    config, corpus = _config(tmp_path, demo, projection, n=64)
    config.teacher.tensor_parallel = 2  # two gloo ranks, one unit
    run_dir = pathlib.Path(config.run_dir)
    watcher = _Watcher(run_dir)
    run = _xtoken_run(procs, tmp_path, config, "local", request)
    try:
        wait_for(lambda: len(step_records(run_dir, 0)) >= 2, 240, "two steps of rank 0")
        rank0 = watcher.seen["teacher0"][0]
        victim = next(
            p for p in _children(watcher.seen["teacher0"][1]) if p != rank0 and "teacher" in
            _cmdline(p)
        )  # fmt: skip
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: watcher.seen["teacher0"][0] != rank0, 120, "the group restarted")
        assert run.wait(300) == 0, run.tail()
    finally:
        watcher.close()
    assert "teacher0.1 exited with code -9" in run.log(), run.tail()
    assert_exactly_once(trained_keys(run_dir), corpus)


def _children(ppid: int) -> list[int]:
    """The pids whose parent is ``ppid``."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out
