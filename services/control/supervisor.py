"""The Supervisor: every run's state machine, processes, restarts, heartbeats and metrics; no HTTP.

Each active run is driven by its own thread around a :class:`services.run.Run` (the same
launch / restart-policy / stop logic as ``xtoken run``):

    PENDING -> STARTING (prepare, launch) -> RUNNING <-> RECOVERING (cause, attempt)
    RUNNING -> SUCCEEDED | FAILED (process, exit code, last log lines)
    any active state -> STOPPING (trainers checkpoint) -> STOPPED
    STOPPED | FAILED | INTERRUPTED -> resume -> PENDING ...

State, processes (pid + start time) and events live in SQLite (:class:`Store`). Processes are
started without the dead-parent sentinel, so they outlive the control plane; a new Supervisor
re-attaches live ones by pid (guarded by the start time and command line) and the run goes on;
a run none of whose processes survived is INTERRUPTED and resumable. Under the Ray launcher the
run's actors belong to the control plane's Ray job: Ray ends them (and removes their placement
groups) when the control plane goes, their workers stop with them, and the run is INTERRUPTED.

A process is dead when its pid is gone (a zombie counts as gone) or when its heartbeat says so
(:mod:`services.common.heartbeat`, checked by :meth:`services.run.Run.check_health`): no beat for
``dead_after_s`` (frozen), or beats but no main-loop progress for the run's ``hang_after_s``
(hung: a deadlock, a stuck collective). Such a process is killed and handled as a crash by the
restart policy; ``last_heartbeat`` of its row is the time of its last beat.

A run on a shared queue (``queue.address``) has no queue process: the supervisor says hello to
each such address every ``queue_stats_s`` (:class:`QueueWatch`). A server that answers as another
instance (``epoch``) than the run's processes started on restarted: event ``queue_restarted``;
unless its hello says ``durable`` (``--data-dir``) it lost the run's samples, and the run restarts
as after a loss of its own queue (RECOVERING, every process again on the new instance, the trainers
from their checkpoint, one restart of the ``run`` budget). A shared queue that answers nothing for
longer than the run's ``hang_after_s`` fails the run (event ``queue_unreachable``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.control.attach import EXIT_UNKNOWN, AttachedProcess, attach, identity
from services.control.paths import confine
from services.control.queue_watch import QueueWatch
from services.control.series import LatestMemory, Series
from services.control.store import Store

logger = logging.getLogger(__name__)

PENDING, STARTING, RUNNING, RECOVERING = "PENDING", "STARTING", "RUNNING", "RECOVERING"
STOPPING, STOPPED, SUCCEEDED, FAILED = "STOPPING", "STOPPED", "SUCCEEDED", "FAILED"
INTERRUPTED = "INTERRUPTED"
STATES = (
    PENDING,
    STARTING,
    RUNNING,
    STOPPING,
    STOPPED,
    SUCCEEDED,
    FAILED,
    RECOVERING,
    INTERRUPTED,
)
ACTIVE = frozenset({PENDING, STARTING, RUNNING, RECOVERING, STOPPING})
RESUMABLE = frozenset({STOPPED, FAILED, INTERRUPTED})


class RunNotFound(KeyError):
    """No run of that id (HTTP 404)."""


class Conflict(ValueError):
    """The call does not fit the run's state (HTTP 409); the message says which states do."""


class _Handle:
    """The live side of one run: its Run, thread, series, queue stats and subscribers."""

    def __init__(self, run_id: str, run: Any) -> None:
        self.run_id = run_id
        self.run = run
        self.thread: threading.Thread | None = None
        self.stop_grace: float | None = None
        self.series = Series(Path(run.run_dir) / "metrics" / "trainer.rank0.jsonl")
        self.queue_stats: dict[str, Any] | None = None
        self.queue_stats_at: float | None = None
        self.known: dict[str, tuple] = {}  # process name -> last stored row (changes only)
        self.runtime: dict[str, Any] | None = None
        # (role, rank or teacher group) -> the latest memory_mb of that process's metrics file
        self.memory: dict[tuple[str, int], LatestMemory] = {}
        # a shared queue: the instance a re-attached run started on (from its record), what the
        # watch saw for the run thread to act on, whether its outage was reported
        self.restored_epoch: str | None = None
        self.queue_news: list[tuple] = []
        self.queue_down_reported = False
        self.launches = 0  # launches on the shared queue: news older than the latest are moot


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
    ) -> None:
        self.store = store
        self.runs_root = Path(runs_root).resolve()
        self.data_roots = [Path(r).resolve() for r in data_roots]
        self.launcher_factory = launcher_factory or _local_launcher
        self.tick_s = tick_s
        self.queue_stats_s = queue_stats_s
        self.dead_after_s = dead_after_s
        self.default_queue = default_queue
        self.host = socket.gethostname()
        self._handles: dict[str, _Handle] = {}
        self._watches: dict[str, QueueWatch] = {}  # shared queue address -> its watch
        self._subscribers: dict[str, list[Callable[[dict[str, Any]], None]]] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self.started = time.time()
        self._stats_thread = threading.Thread(
            target=self._stats_loop, name="queue-stats", daemon=True
        )
        self._stats_thread.start()

    # ------------------------------------------------------------------ lifecycle

    def recover(self) -> None:
        """After a (re)start: re-attach the live processes of every active run from the store;
        a run with none left becomes INTERRUPTED (resumable)."""
        for rec in self.store.list_runs():
            if rec["state"] not in ACTIVE:
                continue
            try:
                self._recover_one(rec)
            except Exception as e:  # one broken record must not keep the others down
                logger.exception("[control] run %s cannot be recovered", rec["id"])
                self._set_state(rec["id"], INTERRUPTED, reason=f"recovery failed: {e}")

    def _recover_one(self, rec: dict[str, Any]) -> None:
        run_id = rec["id"]
        if rec["state"] == PENDING:
            self._spawn(run_id, rec["config"], launch=True)
            return
        run = self._make_run(run_id, rec["config"])
        runtime = rec.get("runtime")
        procs = self.store.processes(run_id)
        attached: dict[str, AttachedProcess] = {}
        if runtime and _is_local(run.launcher):
            run.restore(runtime)
            for p in procs:
                spec = run.specs.get(p["name"])
                if spec is None or not p["pid"] or p["start_ticks"] is None:
                    continue
                a = attach(spec, p["pid"], p["start_ticks"])
                if a is not None:
                    attached[p["name"]] = a
        if not attached:
            for p in procs:  # anything left of a half-started run, by pid + start time
                if p["pid"] and p["start_ticks"] is not None and p["state"] == "running":
                    _kill_if_same(p["pid"], p["start_ticks"])
            for p in procs:
                if p["state"] == "running":
                    self.store.put_process(run_id, p["name"], state="gone")
            self._set_state(
                run_id,
                INTERRUPTED,
                reason="the control plane restarted and no process of the run was left; "
                "resume it (POST /v1/runs/{id}/resume) to go on from its latest checkpoint",
            )
            return
        for name, spec in run.specs.items():
            if name in attached:
                run.launcher.processes[name] = attached[name]
            elif name not in run.finished:
                gone = AttachedProcess(spec, 0, 0)
                gone._code = EXIT_UNKNOWN  # ended unseen: the restart policy decides
                run.launcher.processes[name] = gone
        logger.info(
            "[control] run %s re-attached %d processes: %s",
            run_id,
            len(attached),
            ", ".join(f"{n} (pid {a.pid})" for n, a in sorted(attached.items())),
        )
        handle = self._new_handle(run_id, run)
        handle.runtime = runtime
        handle.restored_epoch = (runtime or {}).get("queue_epoch")
        if rec["state"] == STOPPING:
            handle.stop_grace = 60.0
        self._event(run_id, "reattached", {"processes": sorted(attached)})
        self._start_thread(handle, launch=False)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the run threads; the runs' processes go on (a new Supervisor re-attaches them)."""
        self._closing.set()
        for h in list(self._handles.values()):
            if h.thread is not None:
                h.thread.join(timeout_s)
        self._stats_thread.join(timeout_s)

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
        from services.run import run_config_from_dict

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
        with self._lock:
            for rec in self.store.list_runs():
                if rec["state"] in ACTIVE and rec["run_dir"] == config["run_dir"]:
                    raise Conflict(
                        f"run_dir={config['run_dir']!r} is used by run {rec['id']} "
                        f"({rec['state']}); pick another run_dir or stop that run"
                    )
            self.store.create_run(run_id, name or run_id, config, config["run_dir"])
        self._event(run_id, "state", {"state": PENDING})
        logger.info("[control] run %s submitted (run_dir %s)", run_id, config["run_dir"])
        self._spawn(run_id, config, launch=True)
        return self.get(run_id)

    def stop(self, run_id: str, grace_s: float = 300.0) -> dict[str, Any]:
        """Ask an active run to stop: trainers checkpoint at one step boundary, then all exit
        (killed after ``grace_s``).

        Raises:
            RunNotFound: no such run.
            Conflict: the run is not active.
        """
        rec = self._record(run_id)
        with self._lock:
            h = self._handles.get(run_id)
            if rec["state"] not in ACTIVE or h is None:
                raise Conflict(
                    f"run {run_id} is {rec['state']}; only a run in "
                    f"{', '.join(sorted(ACTIVE))} can be stopped"
                )
            h.stop_grace = float(grace_s)
        self._event(run_id, "stop_requested", {"grace_s": grace_s})
        return self.get(run_id)

    def resume(self, run_id: str) -> dict[str, Any]:
        """Start a stopped, failed or interrupted run again from its latest checkpoint.

        Raises:
            RunNotFound: no such run.
            Conflict: the run is active or succeeded.
        """
        rec = self._record(run_id)
        with self._lock:
            h = self._handles.get(run_id)
            if rec["state"] not in RESUMABLE or (
                h is not None and h.thread and h.thread.is_alive()
            ):
                raise Conflict(
                    f"run {run_id} is {rec['state']}; only a run in "
                    f"{', '.join(sorted(RESUMABLE))} can be resumed"
                )
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
        self._event(run_id, "state", {"state": PENDING, "resume": True})
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
        return self._view(self._record(run_id))

    def processes(self, run_id: str) -> list[dict[str, Any]]:
        """The run's processes: role, host, pid, GPU, state, restarts, heartbeat, exit code.

        Raises:
            RunNotFound: no such run.
        """
        self._record(run_id)
        rows = self.store.processes(run_id)
        h = self._handles.get(run_id)
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
        rec = self._record(run_id)
        h = self._handles.get(run_id)
        series = h.series if h is not None else None
        if series is None:  # a finished run: read its file once
            series = Series(Path(rec["run_dir"]) / "metrics" / "trainer.rank0.jsonl")
            series.poll()
        steps = [s for s in series.steps if s.get("step", 0) > after_step]
        return {"run_id": run_id, "steps": steps, "evals": list(series.evals)}

    def queue(self, run_id: str) -> dict[str, Any]:
        """The run's queue: its address and its latest stats (samples and bytes per partition,
        leases, capacity, rates), from memory: asked every ``queue_stats_s`` while the run is
        active, the last figures kept after it ends (None before the first answer).

        Raises:
            RunNotFound: no such run.
        """
        self._record(run_id)
        h = self._handles.get(run_id)
        return {
            "run_id": run_id,
            "address": (h.run.queue_address or None) if h is not None else None,
            "stats": h.queue_stats if h is not None else None,
            "updated": h.queue_stats_at if h is not None else None,
        }

    def events(self, run_id: str, after: int = 0) -> list[dict[str, Any]]:
        """Recorded events (states, process exits, restarts) after event id ``after``.

        Raises:
            RunNotFound: no such run.
        """
        self._record(run_id)
        return self.store.events(run_id, after=after)

    def subscribe(
        self, run_id: str, callback: Callable[[dict[str, Any]], None]
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every new event of the run (states, processes, metrics),
        from the run's thread; returns the function that unsubscribes.

        Raises:
            RunNotFound: no such run.
        """
        self._record(run_id)
        with self._lock:
            self._subscribers.setdefault(run_id, []).append(callback)

        def unsubscribe() -> None:
            with self._lock:
                subs = self._subscribers.get(run_id, [])
                if callback in subs:
                    subs.remove(callback)

        return unsubscribe

    def log_path(self, run_id: str, process: str) -> Path:
        """The log file of a process of the run.

        Raises:
            RunNotFound: no such run.
            ValueError: no such process (names the processes there are).
        """
        rec = self._record(run_id)
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
            h = self._handles.get(rec["id"])
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
                    "memory": self._memory(h, rec) if h else [],
                }
            )
        return {"runs": runs, "started": self.started}

    # ------------------------------------------------------------------ the run threads

    def _make_run(self, run_id: str, config: dict[str, Any]) -> Any:
        from services.run import Run, run_config_from_dict

        run_config = run_config_from_dict(config)
        return Run(
            run_config,
            launcher=self.launcher_factory(),
            progress=False,
            on_event=lambda kind, data: self._on_run_event(run_id, kind, data),
            dead_after_s=self.dead_after_s,
            run_id=run_id,
        )

    def _new_handle(self, run_id: str, run: Any) -> _Handle:
        h = _Handle(run_id, run)
        h.series.poll()  # what is on disk already is history (GET .../metrics), not live events
        with self._lock:
            self._handles[run_id] = h
        return h

    def _spawn(self, run_id: str, config: dict[str, Any], launch: bool) -> None:
        try:
            run = self._make_run(run_id, config)
        except ValueError as e:
            self._set_state(run_id, FAILED, reason=str(e))
            return
        self._start_thread(self._new_handle(run_id, run), launch=launch)

    def _start_thread(self, h: _Handle, launch: bool) -> None:
        h.thread = threading.Thread(
            target=self._drive, args=(h, launch), name=f"run-{h.run_id}", daemon=True
        )
        h.thread.start()

    def _drive(self, h: _Handle, launch: bool) -> None:
        run = h.run
        try:
            if launch:
                self._set_state(h.run_id, STARTING)
                run.prepare()
                if h.stop_grace is not None:
                    self._set_state(h.run_id, STOPPED, reason="stopped before it started")
                    return
                run.launch()
                self._sync(h)
                self._set_state(h.run_id, RUNNING)
            while not self._closing.is_set():
                if h.stop_grace is not None:
                    self._set_state(h.run_id, STOPPING)
                    codes = run.stop(grace_s=h.stop_grace)
                    self._sync(h)
                    self._poll_series(h)  # the steps up to the stop's checkpoint
                    bad = {n: c for n, c in codes.items() if c not in (0, None)}
                    reason = (
                        "stopped on request; trainers checkpointed"
                        if not bad
                        else (f"stopped on request; trainers exited with {bad}")
                    )
                    self._set_state(h.run_id, STOPPED, reason=reason)
                    return
                status = self._queue_news(h) or run.poll_once()
                self._sync(h)
                self._poll_series(h)
                if status == "succeeded":
                    run.launcher.stop(grace_s=60)
                    self._sync(h)
                    self._poll_series(h)
                    self._set_state(h.run_id, SUCCEEDED, reason="every trainer rank finished")
                    return
                if status == "failed":
                    run.launcher.stop(grace_s=30)
                    self._sync(h)
                    tail = run.failure.split(":\n", 1)[1] if ":\n" in (run.failure or "") else ""
                    self._set_state(
                        h.run_id,
                        FAILED,
                        reason=(run.failure or "failed").split("; last log lines")[0],
                        failed_process=run.failed_process,
                        exit_code=run.exit_code,
                        log_tail=tail,
                    )
                    return
                if status == "running" and self._record(h.run_id)["state"] == RECOVERING:
                    self._set_state(h.run_id, RUNNING)
                runtime = run.state()
                if run.external_queue:
                    with self._lock:
                        watch = self._watches.get(run.queue_address)
                        epoch = watch.baseline(h.run_id) if watch is not None else None
                    if epoch or h.restored_epoch:  # a re-attached run keeps its instance
                        runtime["queue_epoch"] = epoch or h.restored_epoch
                if runtime != h.runtime:
                    self.store.update_run(h.run_id, runtime=runtime)
                    h.runtime = runtime
                self._closing.wait(self.tick_s)
        except Exception as e:
            logger.exception("[control] run %s failed", h.run_id)
            try:
                run.launcher.stop(grace_s=30)
                self._sync(h)
            except Exception:  # pragma: no cover - best effort
                logger.exception("[control] run %s: stopping its processes failed", h.run_id)
            self._set_state(h.run_id, FAILED, reason=str(e))
        finally:
            if self._record(h.run_id)["state"] not in ACTIVE:
                _release(run.launcher)
                with self._lock:
                    watch = self._watches.get(run.queue_address)
                    if watch is not None:
                        watch.forget(h.run_id)

    def _on_run_event(self, run_id: str, kind: str, data: dict[str, Any]) -> None:
        if kind == "recovering":
            self._set_state(
                run_id, RECOVERING, reason=data.get("reason"), attempt=data.get("attempt", 0)
            )
        self._event(run_id, kind, data)
        if kind == "launched":
            h = self._handles.get(run_id)
            if h is not None and h.run.external_queue:
                self._note_instance(h)
        if kind in ("launched", "restarted"):
            h = self._handles.get(run_id)
            if h is not None:
                self._sync(h)

    def _sync(self, h: _Handle) -> None:
        """Process rows in the store from the launcher (written only when something changed)."""
        now = time.time()
        used = h.run.policy.restarts()
        for name, proc in list(h.run.launcher.processes.items()):
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
                if spec.role in ("collator", "teacher")
                else (f"{spec.role}s" if spec.role == "trainer" else "run")
            )
            row = (pid, state, code, used.get(key, 0) + (used.get("run", 0) if key != "run" else 0))
            if h.known.get(name) == row:
                continue
            start_ticks = None
            if pid and code is None:
                ident = identity(pid)
                start_ticks = ident["start_ticks"] if ident else None
            prev = h.known.get(name)
            fields: dict[str, Any] = {
                "role": spec.role,
                "host": self.host,
                "pid": pid,
                "state": state,
                "restarts": row[3],
                "exit_code": None if code == EXIT_UNKNOWN else code,
                "last_heartbeat": (h.run.heartbeats.get(name) or {}).get("time"),
                "log_file": spec.log_file,
                "gpu": str(spec.resources.get("gpu")) if spec.resources.get("gpu") else None,
            }
            if start_ticks is not None:
                fields["start_ticks"] = start_ticks
            if prev is None or prev[0] != pid:
                fields["started"] = now
            self.store.put_process(h.run_id, name, **fields)
            h.known[name] = row

    def _poll_series(self, h: _Handle) -> None:
        for record in h.series.poll():
            self._publish(h.run_id, {"kind": "metrics", "time": time.time(), "data": record})
        cfg = h.run.config
        metrics = Path(h.run.run_dir) / "metrics"
        groups = cfg.teachers if cfg.trainer.loss.uses_teacher else 0
        for role, n, name in (
            ("trainer", cfg.trainers, "trainer.rank"),
            ("teacher", groups, "teacher.group"),
        ):
            for i in range(n):
                if (role, i) not in h.memory:
                    h.memory[role, i] = LatestMemory(metrics / f"{name}{i}.jsonl")
                h.memory[role, i].poll()

    def _memory(self, h: _Handle, rec: dict[str, Any]) -> list[dict[str, Any]]:
        """The latest memory figure of each trainer rank and teacher group of a run."""
        config = rec["config"]
        devices = {
            role: str((config.get(role) or {}).get("device", "cpu"))
            for role in ("trainer", "teacher")
        }
        return [
            {
                "role": role,
                "rank": i,
                "mb": m.mb,
                "memory": "gpu" if devices[role].startswith("cuda") else "host",
            }
            for (role, i), m in sorted(h.memory.items())
            if m.mb is not None
        ]

    def _stats_loop(self) -> None:
        """One thread says hello to every shared queue of an active run (:meth:`_watch_shared`)
        and asks every active run's queue for its stats (a slow or dead queue delays only these
        figures and looks, never a run's supervision)."""
        from services.queue.client import QueueClient

        clients: dict[str, Any] = {}
        hellos: dict[str, Any] = {}  # shared queue address -> its watch's client
        while not self._closing.wait(self.queue_stats_s):
            with self._lock:
                handles = list(self._handles.values())
            live = [h for h in handles if h.thread is not None and h.thread.is_alive()]
            down = self._watch_shared(live, hellos)
            for h in handles:
                address = h.run.queue_address
                alive = h in live
                client = clients.get(h.run_id)
                if client is not None and (not alive or client.address != address):
                    clients.pop(h.run_id).close()
                    client = None
                if not alive or not address or address in down:
                    continue
                try:
                    if client is None:
                        client = clients[h.run_id] = QueueClient(
                            address, timeout_s=1.0, retries=0, name="control", shm="never"
                        )
                    stats = client.stats()
                    if h.run.external_queue:
                        stats = own_stats(stats, f"{h.run.run_id}.")
                    h.queue_stats = stats
                    h.queue_stats_at = time.time()
                except Exception as e:  # restarting or gone: keep the last figures
                    logger.debug("[control] run %s: queue stats: %s", h.run_id, e)
                    clients.pop(h.run_id, None)
                    if client is not None:
                        client.close()
        for client in [*clients.values(), *hellos.values()]:
            client.close()

    def _watch_shared(self, handles: list[_Handle], clients: dict[str, Any]) -> set[str]:
        """Say hello to each shared queue of the active runs ``handles``, and hand each run's
        thread what changed (``queue_news``): its server answers as another instance than the
        run started on, or has answered nothing for longer than the run's ``hang_after_s``.

        Args:
            handles: the active runs.
            clients: address -> its QueueClient, kept across calls (a connection per address).

        Returns:
            The addresses that did not answer.
        """
        from services.queue.client import QueueClient

        by_address: dict[str, list[_Handle]] = {}
        for h in handles:
            if h.run.external_queue and h.run.queue_address:
                by_address.setdefault(h.run.queue_address, []).append(h)
        for address in set(clients) - set(by_address):
            clients.pop(address).close()
        down: set[str] = set()
        for address, group in by_address.items():
            client = clients.get(address)
            if client is None:
                client = clients[address] = QueueClient(
                    address, timeout_s=1.0, retries=0, name="control-watch", shm="never"
                )
            hello: dict[str, Any] | None = None
            try:
                hello = client.hello()
            except Exception as e:  # dead, hung or restarting: the outage clock runs
                client.close()  # the next hello opens a new connection
                error = str(e)
                down.add(address)
            now = time.monotonic()
            with self._lock:
                watch = self._watches.setdefault(address, QueueWatch(address, now))
                if hello is not None:
                    watch.answered(hello, now)
                else:
                    watch.failed(error, now)
                for h in group:
                    self._look(h, watch, now)
        return down

    def _look(self, h: _Handle, watch: QueueWatch, now: float) -> None:
        """What ``watch`` says of the run's shared queue, queued for its thread (under the lock)."""
        change = watch.change(h.run_id, h.restored_epoch)
        if watch.baseline(h.run_id) is not None:
            h.restored_epoch = None
        if change is not None:
            h.queue_news.append(("restarted", h.launches, *change, watch.durable))
        limit = h.run.config.hang_after_s
        down_s = watch.down_s(now)
        if down_s == 0.0:
            h.queue_down_reported = False
        elif limit is not None and down_s > limit and not h.queue_down_reported:
            h.queue_down_reported = True
            h.queue_news.append(("unreachable", h.launches, down_s, watch.error))

    def _note_instance(self, h: _Handle) -> None:
        """At each launch of a run on a shared queue (run thread): the instance its processes
        start on, the baseline of :meth:`_look`."""
        from services.queue.client import QueueClient

        address = h.run.queue_address
        hello: dict[str, Any] | None = None
        try:
            with QueueClient(
                address, timeout_s=2.0, retries=0, name="control", shm="never"
            ) as client:
                hello = client.hello()
        except Exception as e:
            logger.warning(
                "[control] run %s: queue %s gave no hello after the launch (%s); its next "
                "answer names the run's instance",
                h.run_id,
                address,
                e,
            )
        now = time.monotonic()
        with self._lock:
            watch = self._watches.setdefault(address, QueueWatch(address, now))
            if hello is not None:
                watch.answered(hello, now)
            watch.launched(h.run_id, hello.get("epoch") if hello is not None else None)
            h.restored_epoch = None
            h.queue_down_reported = False
            h.launches += 1

    def _queue_news(self, h: _Handle) -> str | None:
        """Act on what the watch saw of the run's shared queue (run thread: a Run is driven by
        one thread only). A restart of a durable server is recorded; one of a server without
        ``--data-dir`` lost the run's samples: the run restarts as after the loss of a queue of
        its own (RECOVERING, budget ``run``). An outage past ``hang_after_s`` fails the run.

        Returns:
            ``failed`` when the run cannot go on (``run.failure`` says why), else None.
        """
        with self._lock:
            news, h.queue_news = h.queue_news, []
        run = h.run
        for kind, launches, *rest in news:
            if launches != h.launches:
                continue  # seen before the latest launch, which started on the new instance
            if kind == "unreachable":
                down_s, error = rest
                self._event(
                    h.run_id,
                    "queue_unreachable",
                    {"address": run.queue_address, "down_s": round(down_s, 1), "error": error},
                )
                run.failure = (
                    f"queue {run.queue_address} unreachable for {down_s:.1f}s, more than the "
                    f"run's hang_after_s={run.config.hang_after_s:g}: start the queue again on "
                    "that address, then resume the run"
                )
                run.failed_process, run.exit_code = "queue", None
                return "failed"
            old, new, durable = rest
            data = {
                "address": run.queue_address,
                "old_epoch": old,
                "new_epoch": new,
                "durable": durable,
            }
            if durable:
                data["action"] = (
                    "none: the queue is durable (--data-dir) and kept its samples; the run goes on"
                )
            elif run.restart_queued("run"):
                data["action"] = "none: a restart of the run is due; it starts on the new instance"
            else:
                data["action"] = "restart the run: the queue lost its samples" + (
                    ""
                    if durable is False
                    else " (its hello does not say whether it keeps them: treated as not durable)"
                )
            self._event(h.run_id, "queue_restarted", data)
            logger.warning(
                "[control] run %s: queue %s restarted (instance %s -> %s); %s",
                h.run_id,
                run.queue_address,
                old,
                new,
                data["action"],
            )
            if not data["action"].startswith("restart"):
                continue
            # stops every process (a restart already queued is cancelled: the relaunch starts
            # its processes); poll_once relaunches them after the backoff
            if run.restart_all(f"queue restarted: epoch {old} -> {new}") == "failed":
                return "failed"
        return None

    # ------------------------------------------------------------------ records and events

    def _record(self, run_id: str) -> dict[str, Any]:
        rec = self.store.get_run(run_id)
        if rec is None:
            raise RunNotFound(run_id)
        return rec

    def _set_state(self, run_id: str, state: str, **fields: Any) -> None:
        if state in (RUNNING, STARTING):
            fields.setdefault("reason", None)  # a recovery's cause is over
        self.store.update_run(run_id, state=state, **fields)
        logger.info(
            "[control] run %s: %s%s",
            run_id,
            state,
            f" ({fields['reason']})" if fields.get("reason") else "",
        )
        data = {"state": state, **{k: v for k, v in fields.items() if k != "log_tail"}}
        self._event(run_id, "state", data)

    def _event(self, run_id: str, kind: str, data: dict[str, Any]) -> None:
        self._publish(run_id, self.store.add_event(run_id, kind, data))

    def _publish(self, run_id: str, event: dict[str, Any]) -> None:
        with self._lock:
            subs = list(self._subscribers.get(run_id, []))
        for callback in subs:
            try:
                callback(event)
            except Exception:  # a broken subscriber must not stop the run's thread
                logger.exception("[control] run %s: an event subscriber failed", run_id)

    def _view(self, rec: dict[str, Any]) -> dict[str, Any]:
        h = self._handles.get(rec["id"])
        latest = h.series.latest() if h is not None else None
        checkpoint = _latest_checkpoint(rec["run_dir"])
        return {
            "id": rec["id"],
            "name": rec["name"],
            "state": rec["state"],
            "run_dir": rec["run_dir"],
            "created": rec["created"],
            "updated": rec["updated"],
            "step": latest.get("step") if latest else (checkpoint or {}).get("step"),
            "latest_metrics": latest,
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


def own_stats(stats: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A shared queue's stats as one run sees them: its partitions only (names starting with
    ``prefix``), samples, bytes and leases summed over them; the server's own totals under
    ``server`` (capacity and parked claims are the server's).

    Args:
        stats: the ``stats`` reply of the queue server.
        prefix: the run's partition prefix (``"<run id>."``).
    """
    parts = {k: v for k, v in (stats.get("partitions") or {}).items() if k.startswith(prefix)}
    leased = 0
    for part in parts.values():
        for task in (part.get("tasks") or {}).values():
            leased += int(task.get("leased") or 0)
    return {
        **stats,
        "partitions": parts,
        "samples": sum(int(p.get("samples") or 0) for p in parts.values()),
        "bytes_used": sum(int(p.get("bytes") or 0) for p in parts.values()),
        "leases": leased,
        "shared": True,
        "server": {k: stats.get(k) for k in ("samples", "bytes_used", "leases")},
    }


def _check_files(config: dict[str, Any]) -> None:
    """Data files and the projection a config names must exist (a clear 422 at submit time, not
    a FAILED run later).

    Raises:
        ConfigError: a missing file (names the key).
    """
    from services.common.config import ConfigError
    from services.control.paths import DATA_KEYS

    for key, kind in DATA_KEYS.items():
        if kind:
            continue
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and not Path(node).is_file():
            raise ConfigError(
                f"{key}={node!r} is not a file; put it under a data root and give its path "
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


def _release(launcher: Any) -> None:
    """Give back what a launcher holds for a run that ended (Ray: its placement groups)."""
    close = getattr(launcher, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # best effort: the run's state is already recorded
            logger.exception("[control] closing a launcher failed")


def _local_launcher() -> Any:
    from services.launch.local import LocalLauncher

    return LocalLauncher(parent_sentinel=False)


def _is_local(launcher: Any) -> bool:
    from services.launch.local import LocalLauncher

    return isinstance(launcher, LocalLauncher)


def _kill_if_same(pid: int, start_ticks: int) -> None:
    ident = identity(pid)
    if ident is not None and ident["start_ticks"] == start_ticks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
