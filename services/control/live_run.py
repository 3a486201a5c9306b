"""The live side of one run: the thread that drives it, its process rows and metrics tails.

The thread drives a :class:`services.supervise.driver.Driver` through the run states
(:mod:`services.control.states`) and keeps, in memory and in the store, what it sees as it goes:
process rows, rank 0's metrics and every process's memory figure, the run's runtime record (what a
new control plane needs to re-attach it), the latest figures of its queue.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.series import LatestMemory, LatestRecord, Series
from services.control.journal import Journal
from services.control.queue_history import QueueHistory, history_path
from services.control.states import (
    ACTIVE,
    FAILED,
    RECOVERING,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    SUCCEEDED,
)
from services.supervise.attach import EXIT_UNKNOWN, identity
from services.supervise.events import Event

if TYPE_CHECKING:
    from services.control.queue_monitor import QueueMonitor

logger = logging.getLogger(__name__)


class LiveRun:
    """One run while this control plane watches it: its driver (whose events come here), the thread
    that drives it, rank 0's metrics series, the latest queue figures and process rows.

    Args:
        run_id: the run's id.
        run: its :class:`services.supervise.driver.Driver` (launched, or restored with its
            processes attached).
        journal: records the run's states and events.
        monitor: the queue monitor (figures of the run's queue, news of a shared one).
        closing: set when the control plane shuts down (the thread ends, the processes go on).
        tick_s: seconds between two looks at the run's processes.
        host: this host's name (the process rows' ``host``).

    Attributes:
        stop_grace: set by a stop request: the trainers' grace in seconds.
        series: rank 0's step and eval records.
        queue_stats, queue_stats_at: the latest stats of the run's queue and their time (written
            by the monitor).
        queue_history: the bounded history of those stats (kept in the run directory).
        restored_epoch, queue_news, queue_down_reported, launches: the run's view of a shared
            queue (the monitor's; see :class:`services.control.queue_monitor.QueueMonitor`).
    """

    def __init__(
        self,
        run_id: str,
        run: Any,
        *,
        journal: Journal,
        monitor: QueueMonitor,
        closing: threading.Event,
        tick_s: float,
        host: str,
    ) -> None:
        self.run_id = run_id
        self.run = run
        run.on_event = self._on_run_event
        self.journal = journal
        self.monitor = monitor
        self._closing = closing
        self.tick_s = tick_s
        self.host = host
        self.thread: threading.Thread | None = None
        self.stop_grace: float | None = None
        self.series = Series(Path(run.run_dir) / "metrics" / "trainer.rank0.jsonl")
        self.series.poll()  # what is on disk already is history (GET .../metrics), not live events
        self.queue_stats: dict[str, Any] | None = None
        self.queue_stats_at: float | None = None
        self.queue_history = QueueHistory(history_path(run.run_dir))
        self.known: dict[str, tuple] = {}  # process name -> last stored row (changes only)
        self.runtime: dict[str, Any] | None = None
        # (role, teacher, rank or group or worker) -> the latest memory_mb of that process's
        # metrics file and whether it is GPU memory (teacher: the teacher's index, 0 for the rest)
        self.memory: dict[tuple[str, int, int], tuple[LatestMemory, bool]] = {}
        # rollout worker -> its latest batch (generated tokens/s, samples/s, weights' version)
        self.rollouts: dict[int, LatestRecord] = {}
        # a shared queue: the instance a re-attached run started on (from its record), what the
        # watch saw for the run thread to act on, whether its outage was reported
        self.restored_epoch: str | None = None
        self.queue_news: list[tuple] = []
        self.queue_down_reported = False
        self.launches = 0  # launches on the shared queue: news older than the latest are moot

    def start(self, launch: bool) -> None:
        """Start the run's thread.

        Args:
            launch: prepare and launch the run first (False: a re-attached run goes on).
        """
        self.thread = threading.Thread(
            target=self._drive, args=(launch,), name=f"run-{self.run_id}", daemon=True
        )
        self.thread.start()

    def alive(self) -> bool:
        """The run's thread runs."""
        return self.thread is not None and self.thread.is_alive()

    def memory_rows(self) -> list[dict[str, Any]]:
        """The latest memory figure of each trainer rank, teacher group (of every teacher of the
        run: ``teacher`` is its index) and rollout worker: ``role``, ``rank`` (the trainer rank,
        teacher group or worker), ``mb`` and ``memory`` (``gpu``: allocated on its CUDA device,
        ``host``: its RSS)."""
        rows = []
        for (role, teacher, i), (m, gpu) in sorted(self.memory.items()):
            if m.mb is None:
                continue
            who = {"role": role, "teacher": teacher} if role == "teacher" else {"role": role}
            rows.append({**who, "rank": i, "mb": m.mb, "memory": "gpu" if gpu else "host"})
        return rows

    def rollout_rows(self) -> list[dict[str, Any]]:
        """Each rollout worker's latest batch: generated tokens/s and samples/s (while it
        sampled), the weights' version, the samples no trainer took yet."""
        keep = ("time", "version", "tokens_per_s", "samples_per_s", "pending", "wait_s")
        return [
            {"worker": i, **{k: r.record.get(k) for k in keep}}
            for i, r in sorted(self.rollouts.items())
            if r.record is not None
        ]

    # ------------------------------------------------------------------ the thread

    def _drive(self, launch: bool) -> None:
        run, j, rid = self.run, self.journal, self.run_id
        try:
            if launch:
                j.set_state(rid, STARTING)
                run.prepare()
                if self.stop_grace is not None:
                    j.set_state(rid, STOPPED, reason="stopped before it started")
                    return
                run.launch()
                self.sync()
                j.set_state(rid, RUNNING)
            outcome = run.watch(
                interval_s=self.tick_s,
                stop_grace=lambda: self.stop_grace,
                closing=self._closing,
                check=lambda: self.monitor.act(self),
                on_tick=self._on_tick,
            )
            if outcome == "stop":
                j.set_state(rid, STOPPING)
                codes = run.stop(grace_s=self.stop_grace)
                self.sync()
                self.poll_series()  # the steps up to the stop's checkpoint
                bad = {n: c for n, c in codes.items() if c not in (0, None)}
                reason = (
                    "stopped on request; trainers checkpointed"
                    if not bad
                    else (f"stopped on request; trainers exited with {bad}")
                )
                j.set_state(rid, STOPPED, reason=reason)
            elif outcome == "succeeded":
                run.launcher.stop(grace_s=60)
                self.sync()
                self.poll_series()
                j.set_state(rid, SUCCEEDED, reason="every trainer rank finished")
            elif outcome == "failed":
                run.launcher.stop(grace_s=30)
                self.sync()
                failure = run.failed
                j.set_state(
                    rid,
                    FAILED,
                    reason=failure.reason if failure else "failed",
                    failed_process=failure.process if failure else None,
                    exit_code=failure.exit_code if failure else None,
                    log_tail=failure.log_tail if failure else "",
                )
        except Exception as e:
            logger.exception("[control] run %s failed", rid)
            try:
                run.launcher.stop(grace_s=30)
                self.sync()
            except Exception:  # pragma: no cover - best effort
                logger.exception("[control] run %s: stopping its processes failed", rid)
            j.set_state(rid, FAILED, reason=str(e))
        finally:
            self.queue_history.save()
            if j.record(rid)["state"] not in ACTIVE:
                _release(run.launcher)
                run.release()
                self.monitor.forget(self)

    def _on_tick(self, status: str) -> None:
        """After each poll of the run: process rows and metrics; a run that runs again after a
        restart is RUNNING; the runtime record."""
        self.sync()
        self.poll_series()
        if status in ("succeeded", "failed"):
            return
        if status == "running" and self.journal.record(self.run_id)["state"] == RECOVERING:
            self.journal.set_state(self.run_id, RUNNING)
        self._save_runtime()

    def _save_runtime(self) -> None:
        """The run's runtime record (what a new control plane needs to re-attach it), written
        when it changed."""
        run = self.run
        runtime = run.state()
        if run.external_queue:
            epoch = self.monitor.baseline(self)
            if epoch or self.restored_epoch:  # a re-attached run keeps its instance
                runtime["queue_epoch"] = epoch or self.restored_epoch
        if runtime != self.runtime:
            self.journal.store.update_run(self.run_id, runtime=runtime)
            self.runtime = runtime

    def _on_run_event(self, event: Event) -> None:
        """An event of the run (its launches, exits, restarts, failures): recorded."""
        kind, data = event.kind, event.data()
        if kind == "recovering":
            self.journal.set_state(
                self.run_id, RECOVERING, reason=data.get("reason"), attempt=data.get("attempt", 0)
            )
        self.journal.event(self.run_id, kind, data)
        if kind == "launched" and self.run.external_queue:
            self.monitor.note_instance(self)
        if kind in ("launched", "restarted"):
            self.sync()

    def sync(self) -> None:
        """Process rows in the store from the launcher (written only when something changed)."""
        now = time.time()
        used = self.run.policy.restarts()
        for name, proc in list(self.run.launcher.processes.items()):
            spec = proc.spec
            code = proc.poll()
            pid = getattr(proc, "pid", None) or None
            if code is None:
                state = "running"
            elif code == 0:
                state = "exited"
            else:
                state = "failed"
            key = (
                name
                if spec.role in ("collator", "teacher", "rollout")
                else (f"{spec.role}s" if spec.role == "trainer" else "run")
            )
            row = (pid, state, code, used.get(key, 0) + (used.get("run", 0) if key != "run" else 0))
            if self.known.get(name) == row:
                continue
            start_ticks = None
            if pid and code is None:
                ident = identity(pid)
                start_ticks = ident["start_ticks"] if ident else None
            prev = self.known.get(name)
            fields: dict[str, Any] = {
                "role": spec.role,
                "host": self.host,
                "pid": pid,
                "state": state,
                "restarts": row[3],
                "exit_code": None if code == EXIT_UNKNOWN else code,
                "last_heartbeat": (self.run.heartbeats.get(name) or {}).get("time"),
                "log_file": spec.log_file,
                "gpu": str(spec.resources.get("gpu")) if spec.resources.get("gpu") else None,
            }
            if start_ticks is not None:
                fields["start_ticks"] = start_ticks
            if prev is None or prev[0] != pid:
                fields["started"] = now
            self.journal.store.put_process(self.run_id, name, **fields)
            self.known[name] = row

    def poll_series(self) -> None:
        """New step and eval records of rank 0 (live ``metrics`` events), the latest memory
        figure of every trainer rank, group of each teacher and rollout worker, and each
        rollout worker's latest batch."""
        for record in self.series.poll():
            self.journal.publish(
                self.run_id, {"kind": "metrics", "time": time.time(), "data": record}
            )
        cfg = self.run.config
        metrics = Path(self.run.run_dir) / "metrics"
        for key, name, gpu in metrics_files(cfg):
            if key not in self.memory:
                self.memory[key] = (LatestMemory(metrics / name), gpu)
            self.memory[key][0].poll()
        rollouts = cfg.rollouts if cfg.on_policy else 0
        for i in range(rollouts):
            if i not in self.rollouts:
                self.rollouts[i] = LatestRecord(metrics / f"rollout{i}.jsonl", "rollout")
            self.rollouts[i].poll()


def metrics_files(config: Any) -> list[tuple[tuple[str, int, int], str, bool]]:
    """The metrics files whose ``memory_mb`` the control plane follows for a run config.

    Returns:
        ``((role, teacher, index), file name, on a GPU)`` of each trainer rank, each group of
        every teacher (teacher j >= 1 writes ``t<j>.teacher.group<g>.jsonl``, as
        ``services.teacher.main.metrics_name`` names it) and each rollout worker; ``teacher`` is
        the teacher's index for a teacher group, 0 for the rest.
    """
    out = [
        (("trainer", 0, r), f"trainer.rank{r}.jsonl", _gpu(config.trainer.compute.device))
        for r in range(config.trainers)
    ]
    for view in config.teacher_list() if config.trainer.loss.uses_teacher else []:
        prefix = f"t{view.index}." if view.index else ""
        out += [
            (("teacher", view.index, g), f"{prefix}teacher.group{g}.jsonl",
             _gpu(view.section.device))
            for g in range(view.groups)
        ]  # fmt: skip
    out += [
        (("rollout", 0, i), f"rollout{i}.jsonl", _gpu(config.rollout.device))
        for i in range(config.rollouts if config.on_policy else 0)
    ]
    return out


def _gpu(device: Any) -> bool:
    return str(device).startswith("cuda")


def _release(launcher: Any) -> None:
    """Give back what a launcher holds for a run that ended (Ray: its placement groups)."""
    close = getattr(launcher, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # best effort: the run's state is already recorded
            logger.exception("[control] closing a launcher failed")
