"""Lanes: jobs of the scaled healing experiment spread over the visible GPUs, one job per GPU at a
time (each sees its GPU alone through ``CUDA_VISIBLE_DEVICES``), each job a list of commands run
in order on its lane, stopped (its whole process group) past a per-job timeout.

Jobs are asked for whenever a lane is free, so what runs next can depend on what has finished
(the grid extends a learning rate, a final run waits for its arm's choice). Several lanes may
name one GPU (runs sharing it): each job takes ``slots`` of them (a large run counts as two or
three small ones), and an ``exclusive`` job has its GPU to itself. A job that takes more than
one waits until its slots are free, and no new job starts on the GPU it waits for meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path

logger = logging.getLogger("kd_quality.scale")

#: the exit code of a job stopped by its timeout (as ``timeout(1)`` reports one)
TIMED_OUT = 124
#: what a job's log says when a process of it ran out of GPU memory (PyTorch's error, the
#: trainer's start-up check)
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError|StartupOutOfMemory")


@dataclasses.dataclass
class Job:
    """Commands run one after another on one lane (the first that fails ends the job), their
    output appended to ``log``; ``command_s`` gets each ended command's wall seconds;
    ``slots``: how many of its GPU's lanes it takes (at most all of them); ``exclusive``: it
    takes all of them, the GPU to itself; ``log_start``: the log's size when the job started
    (what it wrote is the log from there)."""

    key: Hashable
    commands: list[list[str]]
    log: Path
    command_s: list[float] = dataclasses.field(default_factory=list)
    exclusive: bool = False
    log_start: int = 0
    slots: int = 1


@dataclasses.dataclass
class _Running:
    job: Job
    lane: str | None
    proc: subprocess.Popen
    step: int
    t0: float
    log: object
    step_t0: float


class Lanes:
    """Runs jobs on lanes.

    Args:
        lanes: one ``CUDA_VISIBLE_DEVICES`` value per lane, or None for a lane that sees what this
            process sees (CPU runs).
        timeout_s: most seconds one job may take (all its commands); past it its process group
            gets SIGTERM, then SIGKILL 15 s later, and the job ends with :data:`TIMED_OUT`.
        cwd: where the commands run.
        env: their environment (default: this process's).
        name: the tag of its log lines.
        stagger_s: at most one job starts on a GPU in this many seconds, so that runs sharing
            it reach their start-up (processes, compile: the host's work) at different times,
            each beside the others' steps, instead of leaving the GPU idle together (0: free
            lanes fill at once).
    """

    def __init__(
        self,
        lanes: list[str | None],
        timeout_s: float,
        cwd: Path,
        env: dict[str, str] | None = None,
        name: str = "scale",
        stagger_s: float = 0.0,
    ) -> None:
        if not lanes:
            raise ValueError("no lanes: give --gpus or --lanes >= 1")
        if not timeout_s > 0:
            raise ValueError(f"--run-timeout-s {timeout_s}: must be > 0 seconds")
        if not stagger_s >= 0:
            raise ValueError(f"--stagger-s {stagger_s}: must be >= 0 seconds")
        self.lanes, self.timeout_s, self.cwd = list(lanes), timeout_s, cwd
        self.env = dict(os.environ if env is None else env)
        self.name = name
        self.stagger_s = stagger_s
        self._started_at: dict[str | None, float] = {}  # a GPU's latest job start

    def run(
        self,
        next_jobs: Callable[[int], list[Job]],
        on_done: Callable[[Job, int, float, str | None], bool | None],
        poll_s: float = 0.5,
        deadline: float | None = None,
    ) -> None:
        """Run jobs until ``next_jobs`` gives none and none runs.

        Args:
            next_jobs: ``next_jobs(n)``: at most ``n`` jobs ready to start (asked again after
                every finished job; each job it gives is started, once per key in this call,
                unless ``on_done`` asks for that key again).
            on_done: ``on_done(job, exit code, wall seconds, lane)`` as each job ends; a true
                return lets ``next_jobs`` give the job's key again (to run it another way).
            poll_s: seconds between looks at the running jobs.
            deadline: ``time.monotonic()`` past which no job starts (those running finish).
        """
        running: dict[int, _Running] = {}  # by lane index (CPU lanes all see None)
        try:
            self._loop(running, next_jobs, on_done, poll_s, deadline)
        finally:  # interrupted (Ctrl-C, SIGTERM as SystemExit): no job outlives this call
            if running:
                logger.warning("[%s] stopping %d running jobs", self.name, len(running))
                _stop_all([r.proc for r in running.values()])
                for r in running.values():
                    r.log.close()

    def _loop(self, running, next_jobs, on_done, poll_s, deadline) -> None:
        """:meth:`run`'s loop; ``running`` (by lane) is the caller's, to stop what is left."""
        started: set[Hashable] = set()
        held: list[Job] = []  # jobs given but not started (waiting for a GPU of their own)
        ask = True
        staggered = False  # free lanes wait out their GPU's stagger
        while True:
            late = deadline is not None and time.monotonic() > deadline
            if (ask or staggered) and not late:
                held, staggered = self._start_ready(running, held, next_jobs, started)
                ask = False
            if not running:
                break
            time.sleep(poll_s)
            for i, r in list(running.items()):
                code = r.proc.poll()
                wall = time.monotonic() - r.t0
                if code is None and wall > self.timeout_s:
                    logger.warning(
                        "[%s] %s timed out after %.0fs: stopping it", self.name, r.job.key, wall
                    )
                    _stop_all([r.proc])
                    code = TIMED_OUT
                if code is None:
                    continue
                r.job.command_s.append(round(time.monotonic() - r.step_t0, 1))
                if code == 0 and r.step + 1 < len(r.job.commands):
                    running[i] = self._start(r.job, r.lane, r.step + 1, r.t0, r.log)
                    continue
                r.log.close()
                del running[i]
                logger.info("[%s] %s exited %d after %.0fs", self.name, r.job.key, code, wall)
                if on_done(r.job, code, wall, r.lane):
                    started.discard(r.job.key)
                ask = True

    def _cooling(self) -> set[str | None]:
        """The GPUs on which a job started less than ``stagger_s`` ago."""
        now = time.monotonic()
        return {g for g, t in self._started_at.items() if now - t < self.stagger_s}

    def _slots_used(self, running) -> Counter:
        """The slots the running jobs take on each GPU (an exclusive one takes them all)."""
        capacity, used = Counter(self.lanes), Counter()
        for r in running.values():
            used[r.lane] += (
                capacity[r.lane] if r.job.exclusive else min(r.job.slots, capacity[r.lane])
            )
        return used

    def _start_ready(self, running, held, next_jobs, started) -> tuple[list[Job], bool]:
        """Start on the free lanes what may start: the jobs held before first, then new ones.

        A job starts on the first free lane (in lane order, so the first jobs spread over the
        GPUs) whose GPU has its slots free and had no job start within ``stagger_s``. A job of
        more than one slot that fits nowhere holds a GPU (the one of the fewest slots taken, not
        held by another): no new job starts there until it does. Returns the jobs given but not
        started, and whether free lanes wait out a stagger.
        """
        reserved: set[str | None] = set()
        capacity = Counter(self.lanes)

        def place(job: Job) -> int | None:
            used, cooling = self._slots_used(running), self._cooling()
            for i, gpu in enumerate(self.lanes):
                need = capacity[gpu] if job.exclusive else min(job.slots, capacity[gpu])
                if (
                    i not in running
                    and gpu not in reserved | cooling
                    and used[gpu] + need <= capacity[gpu]
                ):
                    return i
            if job.exclusive or job.slots > 1:
                open_gpus = [g for g in capacity if g not in reserved]
                if open_gpus:
                    reserved.add(min(open_gpus, key=lambda g: used[g]))
                what = "a GPU of its own" if job.exclusive else f"{job.slots} slots of a GPU"
                logger.info("[%s] %s waits for %s", self.name, job.key, what)
            return None

        waiting: list[Job] = []
        for job in held:
            if (lane := place(job)) is None:
                waiting.append(job)
            else:
                self._launch(job, lane, running, started)
        used, shut = self._slots_used(running), reserved | self._cooling()
        n_open = sum(max(0, capacity[g] - used[g]) for g in capacity if g not in shut)
        if n_open:
            for job in next_jobs(n_open):
                if job.key in started:
                    continue
                if (lane := place(job)) is None:
                    waiting.append(job)
                else:
                    self._launch(job, lane, running, started)
        cooling = self._cooling()
        free = [i for i in range(len(self.lanes)) if i not in running]
        return waiting, any(self.lanes[i] in cooling for i in free)

    def _launch(self, job: Job, lane: int, running: dict, started: set) -> None:
        started.add(job.key)
        running[lane] = self._start(job, self.lanes[lane], 0, time.monotonic(), None)
        if self.stagger_s:
            self._started_at[self.lanes[lane]] = time.monotonic()

    def _start(self, job: Job, lane: str | None, step: int, t0: float, log) -> _Running:
        if log is None:
            job.log.parent.mkdir(parents=True, exist_ok=True)
            log = open(job.log, "a", encoding="utf-8")
            job.log_start = log.tell()
        env = self.env if lane is None else {**self.env, "CUDA_VISIBLE_DEVICES": lane}
        log.write(f"$ {' '.join(job.commands[step])}\n")
        log.flush()
        proc = subprocess.Popen(
            job.commands[step],
            cwd=self.cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops its children too
        )
        where = "" if lane is None else f" on GPU {lane}"
        logger.info("[%s] %s step %d%s (pid %d)", self.name, job.key, step, where, proc.pid)
        return _Running(job, lane, proc, step, t0, log, time.monotonic())


def ran_out_of_gpu_memory(job: Job) -> bool:
    """Whether the job's own part of its log (from ``job.log_start``) says that it ran out of GPU
    memory."""
    try:
        with open(job.log, "rb") as f:
            f.seek(job.log_start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return OUT_OF_MEMORY.search(text) is not None


def _stop_all(procs: list[subprocess.Popen], wait_s: float = 15.0) -> None:
    """SIGTERM to every job's process group at once, SIGKILL to those still there ``wait_s``
    later."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    end = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
