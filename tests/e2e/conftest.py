"""End-to-end fixtures: a distillation run made of real processes started by their CLIs (queue,
collators, teacher, trainer ranks) on loopback, stopped or killed with real signals, always
cleaned up; readers of the run directory's keys and metrics logs.

Every process runs ``python -m services.cli ...`` in its own session (so a signal can reach a
process and the workers it started), logs to ``<tmp>/logs/<name>.log`` and names this pytest
process as its supervising parent (``XTOKEN_PARENT_PID``): nothing outlives the test session.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from services.common.config import to_dict
from services.common.lifecycle import PARENT_PID_ENV, read_ready
from services.common.metrics import read_jsonl
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # pytest run as `pytest`: benchmarks/ is not importable yet
    sys.path.insert(0, str(ROOT))
# the keys logs' reader and the count against the corpus, shared with the fault campaign
from benchmarks.faults.lineage import tally, trained_records  # noqa: E402
from tests.sections import build, merged  # noqa: E402

STUDENT_TOKENIZER = "mistral"
TEACHER_TOKENIZER = "smollm2"
CTX = 64
PARTITION = "train"
# Two cores run every process of a test: one intra-op thread each keeps them from fighting.
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ----------------------------------------------------------------------------- small helpers


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: pathlib.Path, config: Any) -> pathlib.Path:
    """Write a config dataclass as the JSON a ``--config`` flag (or ``xtoken run``) reads;
    returns ``path``."""
    from services.supervise.config import RunConfig, run_config_to_dict

    data = run_config_to_dict(config) if isinstance(config, RunConfig) else to_dict(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ("" once it is gone)."""
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


# ----------------------------------------------------------------------------- run directory


def trained_keys(run_dir: pathlib.Path) -> list[str]:
    """The keys trained by every rank, one entry per time a key was trained."""
    return [k for r in trained_records(run_dir) for k in r["keys"]]


def key_log_lines(run_dir: pathlib.Path) -> dict[str, int]:
    """Lines in each rank's keys log now (to read only what a restarted process appended)."""
    return {
        p.name: len(p.read_text().splitlines())
        for p in sorted((run_dir / "keys").glob("trainer.rank*.jsonl"))
    }


def keys_after(run_dir: pathlib.Path, lines: dict[str, int]) -> list[str]:
    """Keys trained in the records appended after the ``key_log_lines`` snapshot ``lines``."""
    out = []
    for path in sorted((run_dir / "keys").glob("trainer.rank*.jsonl")):
        records = read_jsonl(path)[lines.get(path.name, 0):]
        out += [k for r in records if r.get("event") == "trained" for k in r["keys"]]
    return out


def step_records(run_dir: pathlib.Path, rank: int) -> list[dict]:
    """The ``step`` metrics records of one rank."""
    path = run_dir / "metrics" / f"trainer.rank{rank}.jsonl"
    return [r for r in read_jsonl(path) if r.get("event") == "step"]


def evals(run_dir: pathlib.Path) -> dict[str, float]:
    """Held-out bits/byte of the student by eval tag (``before``, ``after``), from rank 0."""
    path = run_dir / "metrics" / "trainer.rank0.jsonl"
    return {r["tag"]: r["bits_per_byte"] for r in read_jsonl(path) if r.get("event") == "eval"}


def feed_totals(run_dir: pathlib.Path) -> dict[str, int]:
    """The trainers' feed counters (stale, checksum_mismatch, orphans, re_requests) summed over
    ranks and over the processes of a rank (a restarted trainer counts from zero again)."""
    totals: dict[str, int] = {}
    for path in sorted((run_dir / "metrics").glob("trainer.rank*.jsonl")):
        last: dict[str, int] = {}
        for record in read_jsonl(path):
            if record.get("event") != "step":
                continue
            for name, value in record["feed"].items():
                if value < last.get(name, 0):  # a new process: bank what the old one counted
                    totals[name] = totals.get(name, 0) + last[name]
                last[name] = value
        for name, value in last.items():
            totals[name] = totals.get(name, 0) + value
    return totals


def checkpoint_keys(checkpoint: pathlib.Path) -> set[str]:
    """The keys a checkpoint says were trained in its epoch (union over its ranks)."""
    keys: set[str] = set()
    for meta in checkpoint.glob("rank*.json"):
        keys.update(json.loads(meta.read_text())["trained"])
    return keys


def latest_checkpoint(run_dir: pathlib.Path) -> pathlib.Path | None:
    """``checkpoints/<latest>``, or None before the first checkpoint."""
    latest = run_dir / "checkpoints" / "latest"
    return run_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None


def rings_in_flight(teacher: Proc) -> list[list[int]]:
    """Per logit ring a teacher process closed, the slots still published and not released by
    a trainer at that moment (its ``writer closed: ... in flight=[...]`` log lines)."""
    closed = re.finditer(r"writer closed: .* in flight=(\[.*\])", teacher.log())
    return [json.loads(m.group(1)) for m in closed]


def assert_exactly_once(trained: list[str], corpus: list[str]) -> None:
    """Every corpus key trained exactly once: no duplicate, none missing, nothing else."""
    counted = tally(trained, corpus)
    assert not counted.twice, f"trained more than once: {counted.twice}"
    assert not counted.missing, f"never trained: {counted.missing}"
    assert not counted.extra, f"trained but not in the corpus: {counted.extra}"


def tiny_trainer(projection: str | None, **overrides: Any) -> TrainerConfig:
    """The tiny-preset P-KL trainer of the run tests: micro-batches of 4, no checkpoint, eval or
    export, every slot checked; ``overrides`` are its keys, a section as a mapping merged into
    the one here (``feed={"grad_accum": 2}``)."""
    settings = {
        "student": {"model": "tiny"},
        "feed": {"micro_batch": 4},
        "schedule": {"max_steps": 0, "checkpoint_every": 0, "eval_every": 0, "export": False},
        "eval": {"texts": 4, "ctx": CTX},
        "teacher": {"verify_logits": True},
        "loss": {"mode": "pkl", "projection": projection},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
    }
    return build(TrainerConfig, settings, overrides)


def tiny_run_config(run_dir: pathlib.Path, train: pathlib.Path, heldout: str, projection: str,
                    **trainer: Any) -> Any:
    """The run config of ``xtoken run`` tests: two tiny P-KL trainer ranks (4 x 2 samples a step
    each), one shm teacher with checksums, one collator worker; ``trainer`` overrides the
    trainer's settings (no checkpoint, no export by default)."""
    from services.supervise.config import DataConfig, QueueConfig, RunCollatorConfig, RunConfig

    return RunConfig(
        run_dir=str(run_dir), student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER, ctx_student=CTX, ctx_teacher=CTX,
        queue=QueueConfig(capacity_bytes=1 << 30), trainers=2,
        data=DataConfig(train=str(train), heldout=heldout),
        collator=RunCollatorConfig(workers=1, batch=16),
        teacher=TeacherConfig(
            model="tiny", transport="shm", max_batch=4, max_length=CTX, checksum=True
        ),
        trainer=tiny_trainer(projection, **merged({"feed": {"grad_accum": 2}}, trainer)),
    )


# ----------------------------------------------------------------------------- processes


class Proc:
    """One ``python -m services.cli ARGV`` subprocess in its own session.

    Args:
        name: for logs and messages (``queue``, ``collator0``, ``trainer1``...).
        argv: the arguments after ``services.cli``.
        log_dir: ``<log_dir>/<name>.log`` gets stdout and stderr (appended across restarts).
        ready_file: passed as ``--ready-file`` when given.
        env: extra environment variables.
    """

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path,
                 ready_file: pathlib.Path | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.ready_file = ready_file
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            argv = [*argv, "--ready-file", str(ready_file)]
        self.argv = argv
        full_env = {**os.environ, **CHILD_ENV, PARENT_PID_ENV: str(os.getpid()), **(env or {})}
        with open(self.log_path, "ab") as log:
            log.write(f"==== {' '.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv],
                cwd=ROOT,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return self.popen.poll()

    def log(self) -> str:
        """Everything the process wrote."""
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        """The last lines of its log."""
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait for the ready file; fail the test (with the log) if the process exits first."""
        assert self.ready_file is not None, f"{self.name} has no ready file"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = read_ready(self.ready_file)
            if info is not None:
                return info
            if self.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.poll()} before ready:\n{self.tail()}")
            time.sleep(0.05)
        pytest.fail(f"{self.name} not ready within {timeout_s:.0f}s:\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        """Wait for the exit code; fail the test (with the log) after ``timeout_s``."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout_s:.0f}s:\n{self.tail()}")

    def signal(self, signum: int, group: bool = False) -> None:
        """Send ``signum`` to the process, or to its whole session (it and its workers)."""
        try:
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL of the session after ``grace_s``; returns the exit code."""
        if self.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL, group=True)  # workers left by a killed parent, too
        if self.poll() is None:
            self.popen.wait(10)
        return self.poll()

    def kill(self) -> int:
        """SIGKILL the process only; returns its exit code (-9)."""
        self.signal(signal.SIGKILL)
        return self.popen.wait(10)


class Procs:
    """Starts processes and stops every one of them at teardown (reverse start order)."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self.log_dir = log_dir
        self.started: list[Proc] = []

    def start(self, name: str, argv: list[str], *, ready: bool = True,
              env: dict[str, str] | None = None) -> Proc:
        """Start ``python -m services.cli ARGV`` (with ``--ready-file`` when ``ready``)."""
        ready_file = self.log_dir / "ready" / name if ready else None
        proc = Proc(name, argv, self.log_dir, ready_file, env)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        """Stop whatever still runs: trainers first, the queue last."""
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.stop(grace_s=10.0)
        for proc in self.started:  # segments of a SIGKILLed teacher (its ring) or queue
            for path in pathlib.Path("/dev/shm").glob(f"xtk_{proc.pid}_*"):
                path.unlink(missing_ok=True)


@pytest.fixture
def procs(tmp_path):
    """A :class:`Procs` whose processes are all stopped after the test."""
    p = Procs(tmp_path / "logs")
    yield p
    p.stop_all()


# ----------------------------------------------------------------------------- data


@pytest.fixture(scope="session")
def demo():
    """The demo corpus (built from the stdlib once, then reused from the cache)."""
    from xtoken_core.data.corpus import build_demo_corpus

    return build_demo_corpus()


@pytest.fixture(scope="session")
def projection(tmp_path_factory) -> str:
    """The mistral -> smollm2 projection file (top-8), from xtoken's cache or built once."""
    from xtoken_core.data.projection_build import build_projection
    from xtoken_core.tokenizers import load_tokenizer

    cache = pathlib.Path(os.environ.get("XTOKEN_CACHE", pathlib.Path.home() / ".cache" / "xtoken"))
    path = cache / "projections" / f"{STUDENT_TOKENIZER}_{TEACHER_TOKENIZER}_k8.pt"
    if not path.is_file():  # the name `xtoken run` caches it under
        import torch

        path = tmp_path_factory.mktemp("projection") / path.name
        s_tok, t_tok = load_tokenizer(STUDENT_TOKENIZER), load_tokenizer(TEACHER_TOKENIZER)
        torch.save(build_projection(s_tok, t_tok, 8), path)
    return str(path)


def corpus_parts(demo, directory: pathlib.Path, n: int, parts: int,
                 start: int = 0) -> tuple[list[pathlib.Path], list[str]]:
    """Texts ``[start, start + n)`` of the demo corpus split into ``parts`` JSONL files.

    Returns:
        The files and every key the collators will make of them
        (``<12 hex of the file's path>/part<i>.jsonl:<line>``, ``iter_texts``' default).
    """
    from xtoken_core.data.corpus import iter_texts

    texts = []
    for i, (_, text) in enumerate(iter_texts(demo.train_path)):
        if i >= start:
            texts.append(text)
        if len(texts) == n:
            break
    directory.mkdir(parents=True, exist_ok=True)
    paths, keys = [], []
    per = -(-n // parts)
    for p in range(parts):
        path = directory / f"part{p}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[p * per:(p + 1) * per]))
        paths.append(path)
        keys += [k for k, _ in iter_texts(path)]
    return paths, keys


# ----------------------------------------------------------------------------- the pipeline


class Pipeline:
    """The processes of one run, started by their CLIs, sharing one queue and run directory.

    Args:
        procs: the process registry (stops everything at teardown).
        root: test directory; the run directory is ``root/run``.
        projection: the projection file of the trainers' loss.
        heldout: held-out corpus of the trainers' evals.
    """

    def __init__(self, procs: Procs, root: pathlib.Path, projection: str, heldout: str) -> None:
        self.procs = procs
        self.root = root
        self.run_dir = root / "run"
        self.projection = projection
        self.heldout = heldout
        self.queue = ""
        self.master_port = 0

    # ------------------------------------------------------------------ configs

    def teacher_config(self, **overrides: Any) -> TeacherConfig:
        """An shm teacher of the tiny preset with checksums, for this run's queue."""
        values = dict(
            queue=self.queue, partition=PARTITION, model="tiny", tokenizer=TEACHER_TOKENIZER,
            transport="shm", max_batch=4, max_length=CTX, checksum=True,
        )
        return TeacherConfig(**{**values, **overrides})

    def trainer_config(self, **overrides: Any) -> TrainerConfig:
        """:func:`tiny_trainer` for this run's queue, partition and directory."""
        return tiny_trainer(
            self.projection, queue=self.queue, partition=PARTITION, run_dir=str(self.run_dir),
            student_tokenizer=STUDENT_TOKENIZER, teacher_tokenizer=TEACHER_TOKENIZER, **overrides,
        )  # fmt: skip

    # ------------------------------------------------------------------ processes

    def start_queue(self) -> Proc:
        """``xtoken queue serve`` on a free loopback port; ready when it returns."""
        self.queue = f"tcp://127.0.0.1:{free_port()}"
        proc = self.procs.start(
            "queue", ["queue", "serve", "--bind", self.queue, "--capacity", "1GiB"]
        )
        proc.wait_ready(60)
        return proc

    def start_collator(self, name: str, data: pathlib.Path, *, workers: int = 1,
                       batch: int = 8) -> Proc:
        """``xtoken collator`` over one corpus file."""
        return self.procs.start(name, [
            "collator", "--queue", self.queue, "--data", str(data),
            "--student", STUDENT_TOKENIZER, "--teacher", TEACHER_TOKENIZER,
            "--partition", PARTITION, "--workers", str(workers), "--batch", str(batch),
            "--ctx-student", str(CTX), "--ctx-teacher", str(CTX), "--log-every-s", "1",
        ])

    def start_teacher(self, config: TeacherConfig, name: str = "teacher") -> Proc:
        """``xtoken teacher --config`` (metrics under the run directory)."""
        path = write_config(self.root / "config" / f"{name}.json", config)
        return self.procs.start(
            name, ["teacher", "--config", str(path), "--run-dir", str(self.run_dir)]
        )

    def start_trainers(self, config: TrainerConfig, world: int = 2) -> list[Proc]:
        """``world`` ranks of ``xtoken trainer --config`` (gloo, a fresh rendezvous port)."""
        path = write_config(self.root / "config" / "trainer.json", config)
        self.master_port = free_port()
        out = []
        for rank in range(world):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.master_port),
            }
            out.append(self.procs.start(f"trainer{rank}", ["trainer", "--config", str(path)], env=env))
        return out

    def queued_keys(self) -> list[str]:
        """The sample keys the queue holds now."""
        from services.queue.client import QueueClient

        with QueueClient(self.queue, timeout_s=10, name="e2e") as client:
            return list(client.list(PARTITION).get("keys", []))

    def put_eof(self) -> int:
        """Tell the trainers the data is complete (what ``xtoken run`` does when the collators
        are done); returns the sample count written into the marker."""
        from services.protocol import put_eof
        from services.queue.client import QueueClient

        with QueueClient(self.queue, timeout_s=10, name="e2e") as client:
            # every sample put: the ones held and the ones retention dropped once trained
            status = client.status(PARTITION, "e2e")
            n = status["samples"] + status.get("dropped", 0)
            put_eof(client, PARTITION, n)
        return n

    def teacher_requests(self) -> list[dict]:
        """The ``request`` records of the teacher metrics (every teacher process)."""
        path = self.run_dir / "metrics" / "teacher.group0.jsonl"
        return [r for r in read_jsonl(path) if r.get("event") == "request"]


@pytest.fixture
def pipeline(procs, tmp_path, projection, demo) -> Pipeline:
    """A :class:`Pipeline` in this test's directory (nothing started yet)."""
    return Pipeline(procs, tmp_path, projection, str(demo.heldout_path))
