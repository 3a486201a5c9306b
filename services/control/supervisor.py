"""The Supervisor: the runs as the routes see them (submit, stop, resume, views), and recovery.

A plain object, no HTTP; recovery re-attaches the runs of the store after a control-plane restart.

Each active run is driven by its own thread around a :class:`services.supervise.driver.Driver`
(the run engine of ``xtoken run``: the same launch / restart-policy / stop logic) through the run
states of :mod:`services.control.states`. Where the rest lives:

* :mod:`services.control.live_run`: the thread of one run, its process rows and metrics tails;
* :mod:`services.control.queue_monitor`: the queue-stats thread and the watch on shared queues
  (their restarts and outages);
* :mod:`services.control.journal`: states and events into the store and to the event streams;
* :mod:`services.supervise.attach` (the engine's): the processes of a run found again by pid.

State, processes (pid + start time) and events live in SQLite (:class:`Store`). Processes are
started without the dead-parent sentinel, so they outlive the control plane; a new Supervisor
re-attaches live ones by pid (guarded by the start time and command line) and the run goes on;
a run none of whose processes survived is INTERRUPTED and resumable. Under the Ray launcher the
run's actors belong to the control plane's Ray job: Ray ends them (and removes their placement
groups) when the control plane goes, their workers stop with them, and the run is INTERRUPTED.

A process is dead when its pid is gone (a zombie counts as gone) or when its heartbeat says so
(:mod:`services.common.heartbeat`, checked by
:meth:`services.supervise.driver.Driver.check_health`): no beat for ``dead_after_s`` (frozen), or
beats but no main-loop progress for the run's ``hang_after_s`` (hung: a deadlock, a stuck
collective). Such a process is killed and handled as a crash by the restart policy;
``last_heartbeat`` of its row is the time of its last beat.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.series import LastSteps, Series
from services.control import compare as comparing
from services.control.event_text import describe
from services.control.journal import Journal
from services.control.live_run import LiveRun
from services.control.paths import confine
from services.control.queue_history import FIELDS as QUEUE_FIELDS
from services.control.queue_history import QueueHistory, history_path
from services.control.queue_monitor import QueueMonitor
from services.control.states import (
    ACTIVE,
    FAILED,
    INTERRUPTED,
    PENDING,
    RESUMABLE,
    STARTING,
    STOPPING,
    Conflict,
)
from services.control.store import Store
from services.supervise.attach import attach_run, kill_leftovers

logger = logging.getLogger(__name__)


class Supervisor:
    """Runs of the control plane.

    Args:
        store: the SQLite store.
        runs_root: run directories go here (and must stay inside).
        data_roots: roots of data, models, tokenizers and projections a config may name.
        launcher_factory: makes a new launcher per run (default: a LocalLauncher without the
            dead-parent sentinel).
        tick_s: seconds between two looks at a run's processes.
        queue_stats_s: seconds between two stats calls to a run's queue, and between two
            hellos to each shared queue (its restarts and outages).
        dead_after_s: a process without a heartbeat this long is treated as dead.
        default_queue: the address of a running queue server that runs use when their config
            names none (``queue.address`` absent; null keeps a queue of the run's own); None:
            every run starts its own queue.
        max_run_processes: most processes of one run (:attr:`RunConfig.process_count`).
        max_processes: most processes of all active runs together.
    """

    def __init__(
        self,
        store: Store,
        *,
        runs_root: str | os.PathLike,
        data_roots: list[str | os.PathLike],
        launcher_factory: Callable[[], Any] | None = None,
        tick_s: float = 0.2,
        queue_stats_s: float = 2.0,
        dead_after_s: float = 5.0,
        default_queue: str | None = None,
        max_run_processes: int = 64,
        max_processes: int = 256,
    ) -> None:
        self.store = store
        self.runs_root = Path(runs_root).resolve()
        self.data_roots = [Path(r).resolve() for r in data_roots]
        self.launcher_factory = launcher_factory or _local_launcher
        self.tick_s = tick_s
        self.queue_stats_s = queue_stats_s
        self.dead_after_s = dead_after_s
        self.default_queue = default_queue
        self.max_run_processes = max_run_processes
        self.max_processes = max_processes
        self.host = socket.gethostname()
        self._live: dict[str, LiveRun] = {}  # run id -> its live side (kept after it ends)
        self._sizes: dict[str, int] = {}  # run id -> its process count (the caps)
        # of the runs this control plane does not watch: their last step ("updated", "step") and
        # their compared curves, each read again only when its metrics file changed
        self._last_step = LastSteps()
        self._compared_kept = comparing.KeptCurves()
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self.journal = Journal(store, self._lock)
        self.started = time.time()
        self.monitor = QueueMonitor(
            lambda: list(self._live.values()),
            journal=self.journal,
            lock=self._lock,
            closing=self._closing,
            interval_s=queue_stats_s,
        )
        self.monitor.start()

    # ------------------------------------------------------------------ lifecycle

    def recover(self) -> None:
        """After a (re)start: re-attach the live processes of every active run from the store; a
        run it was starting (PENDING, or STARTING with no process to attach) starts again; a run
        that was running with none left becomes INTERRUPTED (resumable)."""
        for rec in self.store.list_runs():
            if rec["state"] not in ACTIVE:
                continue
            try:
                self._recover_one(rec)
            except Exception as e:  # one broken record must not keep the others down
                logger.exception("[control] run %s cannot be recovered", rec["id"])
                self.journal.set_state(rec["id"], INTERRUPTED, reason=f"recovery failed: {e}")

    def _recover_one(self, rec: dict[str, Any]) -> None:
        run_id = rec["id"]
        if rec["state"] == PENDING:
            self._spawn(run_id, rec["config"], launch=True)
            return
        run = self._make_run(run_id, rec["config"])
        runtime = rec.get("runtime")
        procs = self.store.processes(run_id)
        attached = {}
        if runtime and _is_local(run.launcher):
            run.restore(runtime)
            attached = attach_run(run, procs)
        if not attached:
            kill_leftovers(procs)  # anything left of a half-started run, by pid + start time
            for p in procs:
                if p["state"] == "running":
                    self.store.put_process(run_id, p["name"], state="gone")
            if rec["state"] == STARTING:  # it died while starting the run: start it again
                self.store.update_run(run_id, state=PENDING, runtime=None)
                self.journal.event(
                    run_id,
                    "relaunched",
                    {"reason": "the control plane restarted while it was starting the run"},
                )
                self._spawn(run_id, rec["config"], launch=True)
                return
            self.journal.set_state(
                run_id,
                INTERRUPTED,
                reason="the control plane restarted and no process of the run was left; "
                "resume it (POST /v1/runs/{id}/resume) to go on from its latest checkpoint",
            )
            return
        logger.info(
            "[control] run %s re-attached %d processes: %s",
            run_id,
            len(attached),
            ", ".join(f"{n} (pid {a.pid})" for n, a in sorted(attached.items())),
        )
        live = self._new_live(run_id, run)
        live.runtime = runtime
        live.restored_epoch = (runtime or {}).get("queue_epoch")
        if rec["state"] == STOPPING:
            live.stop_grace = 60.0
        self.journal.event(run_id, "reattached", {"processes": sorted(attached)})
        live.start(launch=False)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the run threads; the runs' processes go on (a new Supervisor re-attaches them)."""
        self._closing.set()
        for live in list(self._live.values()):
            if live.thread is not None:
                live.thread.join(timeout_s)
        self.monitor.join(timeout_s)
        for live in list(self._live.values()):
            live.queue_history.save()

    # ------------------------------------------------------------------ API

    def submit(self, raw: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        """Validate a run config and start the run.

        Args:
            raw: the run config mapping as submitted (paths relative to the roots allowed).
            name: a display name (default: the run id).

        Returns:
            The run's record (:meth:`get`).

        Raises:
            ConfigError: unknown keys, wrong types, impossible combinations (names the key).
            PathNotAllowed: a path outside the runs / data roots (names the key).
            Conflict: another active run uses the same run directory.
        """
        from services.supervise.config import run_config_from_dict

        if not isinstance(raw, dict):
            from services.common.config import ConfigError

            raise ConfigError(f"a run config is a mapping of keys, got {type(raw).__name__}")
        run_id = uuid.uuid4().hex[:12]
        run_dir = raw.get("run_dir") or run_id
        if not isinstance(run_dir, str):
            from services.common.config import ConfigError

            raise ConfigError(f"run_dir: expected str, got {run_dir!r}")
        config = confine(raw, run_dir=run_dir, runs_root=self.runs_root, data_roots=self.data_roots)
        queue = config.get("queue")
        if self.default_queue and (
            queue is None or (isinstance(queue, dict) and "address" not in queue)
        ):
            config["queue"] = {**(queue or {}), "address": self.default_queue}
        run_config = run_config_from_dict(config)  # every config error before anything is recorded
        if not self.dead_after_s > 2 * run_config.heartbeat_s:
            from services.common.config import ConfigError

            raise ConfigError(
                f"heartbeat_s={run_config.heartbeat_s:g}: must be below half the control plane's "
                f"dead_after_s ({self.dead_after_s:g}); lower heartbeat_s"
            )
        _check_files(config)
        self._check_run_size(run_config)
        # one lock from the checks to the record: a run counts against the cap and owns its
        # directory from the moment it is recorded, so concurrent submissions see each other
        with self._lock:
            self._check_run_dir(Path(config["run_dir"]))
            self._check_capacity(run_config.process_count)
            self._plan_start(run_config)
            self.store.create_run(run_id, name or run_id, config, config["run_dir"])
            self._sizes[run_id] = run_config.process_count
        self.journal.event(run_id, "state", {"state": PENDING})
        logger.info("[control] run %s submitted (run_dir %s)", run_id, config["run_dir"])
        self._spawn(run_id, config, launch=True)
        return self.get(run_id)

    def _check_run_size(self, run_config: Any) -> None:
        """The run's processes fit the cap of one run.

        Raises:
            ConfigError: over the cap (names the setting).
        """
        from services.common.config import ConfigError

        n = run_config.process_count
        if n > self.max_run_processes:
            raise ConfigError(
                f"trainers={run_config.trainers}, teachers={run_config.teachers}, "
                f"collator.workers={run_config.collator.workers}: the run would start {n} "
                f"processes, more than {self.max_run_processes} (XTOKEN_CONTROL_MAX_RUN_PROCESSES)"
                "; use fewer, or raise the setting"
            )

    def _check_capacity(self, n: int) -> None:
        """``n`` more processes fit the cap of the control plane beside every active run's.
        Called under the lock, in the same hold as the record that makes the run active.

        Raises:
            ConfigError: over the cap (names the setting; retry once a run ended).
        """
        from services.common.config import ConfigError

        active = sum(self._size(rec) for rec in self.store.list_runs() if rec["state"] in ACTIVE)
        if active + n > self.max_processes:
            raise ConfigError(
                f"the run would start {n} processes and active runs hold {active}: more than "
                f"{self.max_processes} (XTOKEN_CONTROL_MAX_PROCESSES); wait for a run to end, "
                "stop one, or raise the setting"
            )

    def _size(self, rec: dict[str, Any]) -> int:
        """The processes of a recorded run (0 for a config that no longer builds: it fails at
        its launch); kept per run, as a record's config never changes."""
        n = self._sizes.get(rec["id"])
        if n is None:
            try:
                n = _run_config(rec["config"]).process_count
            except ValueError:
                n = 0
            self._sizes[rec["id"]] = n
        return n

    def _check_run_dir(self, run_dir: Path) -> None:
        """No run record and not the control database own ``run_dir`` (the same directory, one
        inside the other, or the database's files). A record owns its directory for good: its
        metrics, checkpoints and queue history are read from there, so a second run in it would
        mix into them; a resume goes on in it under the same record.

        Raises:
            Conflict: names the owner and what to do.
        """
        db = Path(self.store.path).resolve() if self.store.path != ":memory:" else None
        if db is not None and (
            _nested(run_dir, db)
            or (run_dir.parent == db.parent and run_dir.name.startswith(db.name))  # -wal, -shm
        ):
            raise Conflict(
                f"run_dir={str(run_dir)!r} is the control plane's database ({db}); pick another "
                "run_dir, or leave it out (the control plane picks one)"
            )
        if run_dir.exists() and not run_dir.is_dir():
            raise Conflict(
                f"run_dir={str(run_dir)!r} is a file, not a directory; pick another run_dir"
            )
        for rec in self.store.list_runs():
            if not _nested(run_dir, Path(rec["run_dir"])):
                continue
            owner = f"run_dir={str(run_dir)!r} overlaps {rec['run_dir']!r} of run {rec['id']} "
            state = rec["state"]
            if state in RESUMABLE:
                raise Conflict(
                    f"{owner}({state}); go on with that run (POST /v1/runs/{rec['id']}/resume), "
                    "or pick another run_dir"
                )
            raise Conflict(f"{owner}({state}), which keeps its records there; pick another run_dir")

    def _plan_start(self, run_config: Any) -> None:
        """A run directory holding the checkpoint of another run (another fingerprint) or of a
        finished run is refused; a fresh one records the run's fingerprint
        (:func:`services.supervise.resume.plan_start`, as ``xtoken run`` does).

        Raises:
            Conflict: names the differences and what to do.
        """
        from services.supervise.resume import plan_start

        try:
            plan = plan_start(run_config)
        except ValueError as e:
            message = str(e).split("; pass --resume")[0]
            raise Conflict(
                f"{message}; pick another run_dir, or move that directory away"
            ) from None
        if plan.action == "complete":
            raise Conflict(f"{plan.message}; pick another run_dir to train again")

    def stop(self, run_id: str, grace_s: float = 300.0) -> dict[str, Any]:
        """Ask an active run to stop: trainers checkpoint at one step boundary, then all exit
        (killed after ``grace_s``).

        Raises:
            RunNotFound: no such run.
            Conflict: the run is not active.
        """
        rec = self.journal.record(run_id)
        with self._lock:
            h = self._live.get(run_id)
            if rec["state"] not in ACTIVE or h is None:
                raise Conflict(
                    f"run {run_id} is {rec['state']}; only a run in "
                    f"{', '.join(sorted(ACTIVE))} can be stopped"
                )
            h.stop_grace = float(grace_s)
        self.journal.event(run_id, "stop_requested", {"grace_s": grace_s})
        return self.get(run_id)

    def resume(self, run_id: str) -> dict[str, Any]:
        """Start a stopped, failed or interrupted run again from its latest checkpoint, under
        the same record and in the same directory; recorded as event ``resumed`` (the state it
        left, the checkpoint it goes on from).

        Raises:
            RunNotFound: no such run.
            Conflict: the run is active or succeeded.
            ConfigError: its processes do not fit the control plane's cap now (names the
                setting; retry once a run ended).
        """
        with self._lock:  # the state, the cap and the new state in one hold (as submit)
            rec = self.journal.record(run_id)
            h = self._live.get(run_id)
            if rec["state"] not in RESUMABLE or (h is not None and h.alive()):
                raise Conflict(
                    f"run {run_id} is {rec['state']}; only a run in "
                    f"{', '.join(sorted(RESUMABLE))} can be resumed"
                )
            self._check_capacity(self._size(rec))
            checkpoint = _latest_checkpoint(rec["run_dir"]) or {}
            self.store.update_run(
                run_id,
                state=PENDING,
                reason=None,
                attempt=0,
                failed_process=None,
                exit_code=None,
                log_tail=None,
                runtime=None,
            )
        self.journal.event(
            run_id,
            "resumed",
            {
                "from_state": rec["state"],
                "step": checkpoint.get("step"),
                "checkpoint": checkpoint.get("path"),
            },
        )
        logger.info("[control] run %s resumed from %s", run_id, checkpoint.get("path") or "scratch")
        self.journal.event(run_id, "state", {"state": PENDING, "resume": True})
        self._spawn(run_id, rec["config"], launch=True)
        return self.get(run_id)

    def list(self) -> list[dict[str, Any]]:
        """Every run (records as :meth:`get`, without the config)."""
        out = []
        for rec in self.store.list_runs():
            item = self._view(rec)
            item.pop("config", None)
            out.append(item)
        return out

    def get(self, run_id: str) -> dict[str, Any]:
        """A run: state, config, step, latest metrics, checkpoint, failure reason.

        Raises:
            RunNotFound: no such run.
        """
        return self._view(self.journal.record(run_id))

    def processes(self, run_id: str) -> list[dict[str, Any]]:
        """The run's processes: role, host, pid, GPU, state, restarts, heartbeat, exit code.

        Raises:
            RunNotFound: no such run.
        """
        self.journal.record(run_id)
        rows = self.store.processes(run_id)
        h = self._live.get(run_id)
        for row in rows:
            row.pop("run_id", None)
            row.pop("start_ticks", None)
            beat = h.run.heartbeats.get(row["name"]) if h is not None else None
            if beat is not None and row["state"] == "running":
                row["last_heartbeat"] = beat["time"]
        return rows

    def metrics(self, run_id: str, after_step: int = -1) -> dict[str, Any]:
        """Series for curves: step records after ``after_step`` and every eval.

        Raises:
            RunNotFound: no such run.
        """
        series = self._series(self.journal.record(run_id))
        steps = [s for s in series.steps if s.get("step", 0) > after_step]
        return {"run_id": run_id, "steps": steps, "evals": list(series.evals)}

    def _series(self, rec: dict[str, Any]) -> Series:
        """Rank 0's series of a run: the live one, or (a run this control plane does not watch)
        its file read once."""
        h = self._live.get(rec["id"])
        if h is not None:
            return h.series
        series = Series(_metrics_file(rec["run_dir"]))
        series.poll()
        return series

    def compare(
        self, run_ids: list[str], max_points: int = comparing.DEFAULT_POINTS
    ) -> dict[str, Any]:
        """Runs side by side: each one's curves (loss parts, tokens/s, memory, held-out bits per
        byte) on three x axes (step, tokens seen, seconds since its first record), and the
        config keys whose values differ (:mod:`services.control.compare`).

        Args:
            run_ids: the runs, in the order to show them (a repeated id counts once).
            max_points: the most steps per run (thinned evenly).

        Returns:
            ``{"runs": [{"id", "name", "state", "steps", "evals", "origin"}], "config_diff":
            [{"key", "values": {run id: value}}]}``.

        Raises:
            RunNotFound: one of the runs does not exist.
            ValueError: no run, or more than :data:`services.control.compare.MAX_RUNS`.
        """
        ids = list(dict.fromkeys(run_ids))
        if not ids or len(ids) > comparing.MAX_RUNS:
            raise ValueError(
                f"run: {len(ids)} runs given; compare 1 to {comparing.MAX_RUNS} runs "
                "(?run=ID&run=ID...)"
            )
        records = [self.journal.record(run_id) for run_id in ids]
        runs = [
            {
                "id": rec["id"],
                "name": rec["name"],
                "state": rec["state"],
                **self._compared(rec, max_points),
            }
            for rec in records
        ]
        diff = comparing.config_diff({rec["id"]: rec["config"] for rec in records})
        return {"runs": runs, "config_diff": diff}

    def _compared(self, rec: dict[str, Any], max_points: int) -> dict[str, Any]:
        """A run's curves for :meth:`compare`: from its live series, or kept from its file."""
        h = self._live.get(rec["id"])
        if h is not None:
            return comparing.run_series(h.series.steps, h.series.evals, max_points)
        return self._compared_kept.get(
            _metrics_file(rec["run_dir"]), max_points, lambda: self._series(rec)
        )

    def queue(self, run_id: str) -> dict[str, Any]:
        """The run's queue: its address and its latest stats (samples and bytes per partition,
        leases, capacity, rates), from memory: asked every ``queue_stats_s`` while the run is
        active, the last figures kept after it ends (None before the first answer).

        Raises:
            RunNotFound: no such run.
        """
        self.journal.record(run_id)
        h = self._live.get(run_id)
        return {
            "run_id": run_id,
            "address": (h.run.queue_address or None) if h is not None else None,
            "stats": h.queue_stats if h is not None else None,
            "updated": h.queue_stats_at if h is not None else None,
        }

    def queue_history(self, run_id: str, after: float | None = None) -> dict[str, Any]:
        """The run's queue-depth history (:mod:`services.control.queue_history`): from memory
        while this control plane watches the run, else from its run directory.

        Args:
            run_id: the run.
            after: only samples taken after this unix time.

        Returns:
            ``{"run_id", "fields", "points": [[time, samples, ...]], "max_points", "stride"}``
            (``points`` empty: no sample was recorded).

        Raises:
            RunNotFound: no such run.
        """
        rec = self.journal.record(run_id)
        h = self._live.get(run_id)
        history = h.queue_history if h is not None else QueueHistory(history_path(rec["run_dir"]))
        return {
            "run_id": run_id,
            "fields": list(QUEUE_FIELDS),
            "points": history.points(after),
            "max_points": history.max_points,
            "stride": history.stride,
        }

    def events(self, run_id: str, after: int = 0) -> list[dict[str, Any]]:
        """Recorded events (states, process exits, restarts) after event id ``after``, each
        with its sentence (``text``, :func:`services.control.event_text.describe`).

        Raises:
            RunNotFound: no such run.
        """
        self.journal.record(run_id)
        return [
            {**e, "text": describe(e["kind"], e["data"])}
            for e in self.store.events(run_id, after=after)
        ]

    def subscribe(
        self, run_id: str, callback: Callable[[dict[str, Any]], None]
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every new event of the run (states, processes, metrics),
        from the run's thread; returns the function that unsubscribes.

        Raises:
            RunNotFound: no such run.
        """
        self.journal.record(run_id)
        return self.journal.subscribe(run_id, callback)

    def log_path(self, run_id: str, process: str) -> Path:
        """The log file of a process of the run.

        Raises:
            RunNotFound: no such run.
            ValueError: no such process (names the processes there are).
        """
        rec = self.journal.record(run_id)
        names = [p["name"] for p in self.store.processes(run_id)]
        if process not in names:
            raise ValueError(
                f"run {run_id} has no process {process!r}; its processes: "
                f"{', '.join(names) or 'none yet'}"
            )
        return Path(rec["run_dir"]) / "logs" / f"{process}.log"

    def snapshot(self) -> dict[str, Any]:
        """Everything GET /metrics exposes, from memory (no file or socket I/O)."""
        runs = []
        for rec in self.store.list_runs():
            h = self._live.get(rec["id"])
            runs.append(
                {
                    "id": rec["id"],
                    "state": rec["state"],
                    "latest": h.series.latest() if h else None,
                    "evals": h.series.evals[-1:] if h else [],
                    "tokens_total": h.series.tokens_total if h else 0.0,
                    "steps_total": h.series.steps_total if h else 0,
                    "queue": h.queue_stats if h else None,
                    "processes": self.processes(rec["id"]) if h else [],
                    "memory": h.memory_rows() if h else [],
                    "rollouts": h.rollout_rows() if h else [],
                }
            )
        return {"runs": runs, "started": self.started}

    # ------------------------------------------------------------------ the runs' live sides

    def _make_run(self, run_id: str, config: dict[str, Any]) -> Any:
        from services.supervise.config import run_config_from_dict
        from services.supervise.driver import Driver

        run_config = run_config_from_dict(config)
        return Driver(
            run_config,
            launcher=self.launcher_factory(),
            progress=False,
            dead_after_s=self.dead_after_s,
            run_id=run_id,
        )

    def _new_live(self, run_id: str, run: Any) -> LiveRun:
        live = LiveRun(
            run_id,
            run,
            journal=self.journal,
            monitor=self.monitor,
            closing=self._closing,
            tick_s=self.tick_s,
            host=self.host,
        )
        with self._lock:
            self._live[run_id] = live
        return live

    def _spawn(self, run_id: str, config: dict[str, Any], launch: bool) -> None:
        try:
            run = self._make_run(run_id, config)
        except ValueError as e:
            self.journal.set_state(run_id, FAILED, reason=str(e))
            return
        self._new_live(run_id, run).start(launch=launch)

    def _view(self, rec: dict[str, Any]) -> dict[str, Any]:
        h = self._live.get(rec["id"])
        latest = h.series.latest() if h is not None else None
        checkpoint = _latest_checkpoint(rec["run_dir"])
        if h is None:  # a run this control plane does not watch: its file's last step
            latest_step = self._last_step.get(_metrics_file(rec["run_dir"]))
        else:
            latest_step = latest
        last_step = _time(latest_step)
        return {
            "id": rec["id"],
            "name": rec["name"],
            "state": rec["state"],
            "run_dir": rec["run_dir"],
            "created": rec["created"],
            "updated": last_step if last_step is not None else rec["updated"],
            "state_changed": rec["updated"],
            "step": latest_step.get("step") if latest_step else (checkpoint or {}).get("step"),
            "latest_metrics": latest,
            "rollouts": h.rollout_rows() if h is not None else [],
            "checkpoint": checkpoint,
            "reason": rec["reason"],
            "attempt": rec["attempt"],
            "failed_process": rec["failed_process"],
            "exit_code": rec["exit_code"],
            "log_tail": rec["log_tail"],
            "queue": (h.run.queue_address or None)
            if h is not None
            else ((rec["config"].get("queue") or {}).get("address")),
            "config": rec["config"],
        }


def _metrics_file(run_dir: str) -> Path:
    """Trainer rank 0's metrics file of a run."""
    return Path(run_dir) / "metrics" / "trainer.rank0.jsonl"


def _time(record: dict[str, Any] | None) -> float | None:
    t = (record or {}).get("time")
    return float(t) if isinstance(t, int | float) else None


def _run_config(config: dict[str, Any]) -> Any:
    from services.supervise.config import run_config_from_dict

    return run_config_from_dict(config)


def _nested(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are the same path or one lies inside the other."""
    return a == b or a in b.parents or b in a.parents


def _check_files(config: dict[str, Any]) -> None:
    """Data files and the projection a config names must exist (a clear 422 at submit time, not
    a FAILED run later).

    Raises:
        ConfigError: a missing file (names the key).
    """
    from services.common.config import ConfigError
    from services.control.paths import data_keys, find

    for pattern, kind in data_keys().items():
        if kind != "file":
            continue
        for node, leaf, key in find(config, pattern):
            value = node[leaf]
            if isinstance(value, str) and not Path(value).is_file():
                raise ConfigError(
                    f"{key}={value!r} is not a file; put it under a data root and give its path "
                    "relative to that root"
                )


def _latest_checkpoint(run_dir: str) -> dict[str, Any] | None:
    """``{"path", "step"}`` of the run's latest complete checkpoint (``checkpoints/latest``)."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "latest").read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    step = name.rsplit("_", 1)[-1]
    return {"path": str(root / name), "step": int(step) if step.isdigit() else None}


def _local_launcher() -> Any:
    from services.launch.local import LocalLauncher

    return LocalLauncher(parent_sentinel=False)


def _is_local(launcher: Any) -> bool:
    from services.launch.local import LocalLauncher

    return isinstance(launcher, LocalLauncher)
