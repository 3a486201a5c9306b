"""The driver of a run: launch its processes, watch them (exits, heartbeats, /proc), restart them
per policy, draw the progress line, stop them; what happens is reported as typed events
(:mod:`services.supervise.events`) and a failure as a structured :class:`Failure`.

``xtoken run`` and the control plane drive a run through the same loop (:meth:`Driver.watch`).

A group restart names its first cause. When a trainer rank dies, its peers fail a moment later
(their next collective): the driver records every rank's exit, and at a group's first exit waits
briefly for the others' before it decides; the cause is the rank that died first by the exit time
its launcher stamped, not the exit a poll happened to find first (:mod:`services.supervise.exits`).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.context import CONTEXT_FILE
from services.common.heartbeat import HEARTBEAT_ENV, read_heartbeat, verdict
from services.common.lifecycle import EXIT_FILE_ENV, read_exit_code
from services.launch.spec import ProcessSpec
from services.supervise.attach import EXIT_UNKNOWN, identity
from services.supervise.config import RunConfig
from services.supervise.events import (
    DataComplete,
    Event,
    Exited,
    Failed,
    Failure,
    Launched,
    Recovering,
    Restarted,
    Unresponsive,
)
from services.supervise.exits import GroupExits, error_line, exit_time
from services.supervise.mps import MpsDaemon
from services.supervise.plan import Plan, RunPlace, make_plan
from services.supervise.policy import DETERMINISTIC_CODES, Decision, RestartPolicy
from services.supervise.preflight import Inputs, preflight
from services.supervise.progress import RunProgress, count_texts, estimated_steps

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """One run: prepare, launch, watch, stop.

    Args:
        config: the run config.
        launcher: a launcher (``start``, ``wait_ready``, ``stop``, ``processes``; default: a
            new LocalLauncher).
        progress: draw the run's progress on stderr while :meth:`run` trains (a bar on a
            terminal, plain lines elsewhere: :class:`~services.supervise.progress.RunProgress`).
        on_event: called with each :class:`~services.supervise.events.Event` (launches, exits,
            restarts, failures; the control plane records them).
        dead_after_s: a process without a heartbeat this long (or, before its first beat,
            frozen by SIGSTOP this long) is dead: killed and restarted per policy.
        run_id: prefixes the run's partitions on an external queue (``queue.address``);
            default: the run directory's name and a hash of its path.
        inputs: the run's settled inputs (default: :meth:`prepare` settles them; a config that
            names all its inputs needs none).

    Attributes:
        failed: the :class:`Failure` that ended the run, or None.
        heartbeats: process name -> its last heartbeat record.
        plan: the current launch's :class:`~services.supervise.plan.Plan` (None before one).
        group_exits: the exits of a group (the trainer ranks) held until its restart is
            decided (:class:`~services.supervise.exits.GroupExits`).
    """

    def __init__(
        self,
        config: RunConfig,
        launcher: Any = None,
        progress: bool = True,
        on_event: Callable[[Event], None] | None = None,
        dead_after_s: float = 10.0,
        run_id: str | None = None,
        inputs: Inputs | None = None,
    ) -> None:
        if not dead_after_s > 2 * config.heartbeat_s:
            raise ValueError(
                f"dead_after_s={dead_after_s:g} of the supervisor is not above two heartbeats "
                f"(heartbeat_s={config.heartbeat_s:g}): lower the run's heartbeat_s"
            )
        from services.launch.local import LocalLauncher

        if launcher is None:
            launcher = LocalLauncher()
        if config.mps and not isinstance(launcher, LocalLauncher):
            raise ValueError(
                f"mps: true needs the run's processes on this machine, but they are launched by "
                f"{type(launcher).__name__}: set mps: false (or start an MPS daemon on each node)"
            )
        self.config = config
        self.dead_after_s = dead_after_s
        self.heartbeats: dict[str, dict[str, Any]] = {}
        self._frozen_since: dict[str, float] = {}
        # process name -> the pid SIGKILLed as unresponsive: its exit is on its way (a process
        # takes a moment to die), so it is neither reported nor killed again meanwhile
        self._killed: dict[str, int] = {}
        self.launcher = launcher
        self.progress = progress
        self.on_event = on_event
        self.place = RunPlace.of(config, run_id)
        self.inputs = inputs
        self.stop_requested = threading.Event()
        self.policy = RestartPolicy(config.max_restarts, config.restart_backoff_s)
        self.failed: Failure | None = None
        self.plan: Plan | None = None
        self.queue_address = ""
        self.master_port = 0
        self.specs: dict[str, ProcessSpec] = {}
        self.eof_done = False
        self.segment_started = 0.0
        self._finished: set[str] = set()
        # budget key -> (monotonic due time, decision, the exited process)
        self._pending: dict[str, tuple[float, Decision, str]] = {}
        self.group_exits = GroupExits()
        self._progress_line: RunProgress | None = None
        self._started = time.monotonic()
        # the run's MPS daemon (``mps: true``): started by launch, stopped by release
        self.mps = MpsDaemon(self.run_dir / "mps") if config.mps else None

    # ------------------------------------------------------------------ the run's place

    @property
    def run_dir(self) -> Path:
        """The run directory (absolute)."""
        return self.place.run_dir

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.place.run_id

    @property
    def external_queue(self) -> str | None:
        """The address of the running queue the run uses, or None for a queue of its own."""
        return self.place.external_queue

    @property
    def partition(self) -> str:
        """The samples' partition (prefixed with the run id on an external queue)."""
        return self.place.partition

    @property
    def failure(self) -> str | None:
        """The failure as one message (reason and the last log lines), or None."""
        return self.failed.message() if self.failed is not None else None

    @property
    def failed_process(self) -> str | None:
        """The process whose exit (or loss) failed the run, or None."""
        return self.failed.process if self.failed is not None else None

    @property
    def exit_code(self) -> int | None:
        """The failed process's exit code (None: nothing exited, or no failure)."""
        return self.failed.exit_code if self.failed is not None else None

    @property
    def finished(self) -> frozenset[str]:
        """The processes that ended normally (a trainer rank or collator that exited 0)."""
        return frozenset(self._finished)

    # ------------------------------------------------------------------ prepare and launch

    def prepare(self) -> None:
        """Corpus, tokenizer, vocab and projection checks before any process starts
        (:func:`~services.supervise.preflight.preflight`); settles :attr:`inputs`.

        Raises:
            ValueError: a missing corpus or tokenizer, a vocab mismatch (names what and the fix).
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.inputs = preflight(self.config)

    def make_plan(self, queue: str, master_port: int) -> Plan:
        """The plan of a launch on ``queue`` (no file written).

        Raises:
            ValueError: a section that does not build (a projection to build before
                :meth:`prepare`).
        """
        inputs = self.inputs or Inputs.given(self.config)
        return make_plan(self.config, inputs, self.place, queue=queue, master_port=master_port)

    def launch(self) -> None:
        """Start the queue (and wait until it is ready), the collator, the teachers and trainers.

        Raises:
            RuntimeError: the queue did not get ready (with its last log lines).
        """
        queue = self.external_queue or f"tcp://127.0.0.1:{free_port()}"
        self._use(self.make_plan(queue, free_port()))
        write_sections(self.plan)
        self.eof_done = False
        self._finished = set()
        self.segment_started = time.time()
        L = self.launcher
        if self.external_queue:
            self._clear_partitions()
        else:
            q = self._start(self.specs["queue"])
            L.wait_ready(q, 60)
        if self.mps is not None:
            self.mps.start()  # before its clients (a relaunch finds it up)
        for spec in self.specs.values():
            if spec.role != "queue":
                self._start(spec)
        self._emit(Launched(queue=self.queue_address))

    def _use(self, plan: Plan) -> None:
        self.plan = plan
        self.queue_address = plan.queue
        self.master_port = plan.master_port
        self.specs = {s.name: s for s in plan.specs}
        for spec in plan.specs:
            # every process writes its exit code here as it exits: a driver re-attached after a
            # restart of the control plane learns how a process it did not start ended
            spec.env[EXIT_FILE_ENV] = str(self.exit_file(spec.name))

    def exit_file(self, name: str) -> Path:
        """Where process ``name`` writes its exit code (``RUN_DIR/exit/<name>.code``)."""
        return self.run_dir / "exit" / f"{name}.code"

    def _start(self, spec: ProcessSpec) -> Any:
        """Start one process; the exit code of its predecessor goes first (a code found later
        is this process's)."""
        self.exit_file(spec.name).unlink(missing_ok=True)
        if spec.unit is not None and spec.env.get("RANK") == "0":
            # a unit's first rank starts first: the unit's rendezvous on a fresh port
            port = str(free_port())
            for peer in self.specs.values():
                if peer.unit == spec.unit:
                    peer.env["MASTER_PORT"] = port
        return self.launcher.start(spec)

    def _clear_partitions(self) -> None:
        """Start a launch on an external queue as on a queue of its own: clear what an earlier
        launch of this run left in its partitions there (samples, teacher requests, end of
        data, registrations); the collator puts the corpus again, the trainers skip what their
        checkpoint trained.

        Raises:
            RuntimeError: the queue does not answer (names the address and the setting).
        """
        from services.queue.client import QueueClient
        from services.queue.errors import QueueError

        prefix = f"{self.run_id}."
        try:
            with QueueClient(self.queue_address, timeout_s=10, name="run") as client:
                names = client.list().get("partitions", {})
                mine = [p for p in names if p.startswith(prefix)]
                for partition in mine:
                    client.clear(partition)
        except QueueError as e:
            raise RuntimeError(
                f"the queue at queue.address={self.queue_address!r} does not answer ({e}); start "
                "it, or leave queue.address null for a queue of the run's own"
            ) from None
        if mine:
            logger.info("[run] cleared %d partitions of an earlier launch: %s", len(mine), mine)

    # ------------------------------------------------------------------ re-attach

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs to watch this run again after a control-plane restart."""
        return {
            "queue": self.queue_address,
            "master_port": self.master_port,
            "eof_done": self.eof_done,
            "finished": sorted(self._finished),
            "restarts": self.policy.restarts(),
            "segment_started": self.segment_started,
            "inputs": (self.inputs or Inputs.given(self.config)).to_dict(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Rebuild the plan of a launched run from :meth:`state` (processes are attached by the
        caller into ``launcher.processes``). The section files stay as the launch wrote them: a
        process restarted later reads exactly the section it was launched with."""
        if "inputs" in state:
            self.inputs = Inputs.from_dict(state["inputs"])
        else:  # a record of an older version: the launch's settled inputs are in run.json
            self.inputs = _inputs_written(self.run_dir) or self.inputs
        self._use(self.make_plan(state["queue"], int(state["master_port"])))
        self.eof_done = bool(state.get("eof_done"))
        self._finished = set(state.get("finished", []))
        self.policy.used = dict(state.get("restarts", {}))
        self.segment_started = float(state.get("segment_started", 0.0))

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Prepare, launch and watch the run until it ends or is stopped (``xtoken run``).

        Returns:
            0 when the trainers finished (or were stopped cleanly), 1 when a process failed
            (:attr:`failed` says why).
        """
        self.prepare()
        self._started = started = time.monotonic()
        try:
            self.launch()
            outcome = self.watch(
                interval_s=0.5,
                stop_grace=lambda: 300.0 if self.stop_requested.is_set() else None,
            )
            if outcome == "stop":
                logger.info("[run] stopping: trainers checkpoint first")
                if self.progress:
                    self._progress().note("stopping: the trainers checkpoint")
                codes = self.stop(grace_s=300)
                return 0 if all(c in (0, None) for c in codes.values()) else 1
            if outcome == "succeeded":
                logger.info("[run] trainers finished in %.0fs", time.monotonic() - started)
                return 0
            logger.error("[run] %s", self.failure)
            return 1
        finally:
            self.launcher.stop(grace_s=60)
            self.release()
            if self._progress_line is not None:
                self._progress_line.close()

    def release(self) -> None:
        """What the run holds beside its processes, once they ended: its MPS daemon quits."""
        if self.mps is not None:
            self.mps.stop()

    def watch(
        self,
        *,
        interval_s: float,
        stop_grace: Callable[[], float | None],
        closing: threading.Event | None = None,
        check: Callable[[], str | None] | None = None,
        on_tick: Callable[[str], None] | None = None,
    ) -> str:
        """Poll the launched run every ``interval_s`` until it ends, a stop is asked or the
        watcher closes (the processes go on).

        Args:
            interval_s: seconds between two polls.
            stop_grace: a stop was asked when it returns a grace (seconds), else None.
            closing: set when the watcher goes away (the loop ends, the processes go on);
                None: the loop waits on :attr:`stop_requested`.
            check: called before each poll; a status it returns (``failed``) stands for the
                poll's (the control plane's view of a shared queue).
            on_tick: called with each poll's status.

        Returns:
            ``succeeded``, ``failed`` (:attr:`failed` says why), ``stop`` (the caller stops the
            run with the grace) or ``detached`` (``closing`` was set).
        """
        waiter = closing if closing is not None else self.stop_requested
        while closing is None or not closing.is_set():
            if stop_grace() is not None:
                return "stop"
            status = (check() if check is not None else None) or self.poll_once()
            if on_tick is not None:
                on_tick(status)
            if status in ("succeeded", "failed"):
                return status
            if self.progress:
                self._progress().update()
            waiter.wait(interval_s)
        return "detached"

    def poll_once(self) -> str:
        """One look at every process: the end of the data, restarts per policy, the end of the run.

        Returns:
            ``running``, ``recovering`` (a restart waits for its backoff, or a group's exits for
            their decision), ``succeeded`` (every trainer rank exited 0) or ``failed``
            (:attr:`failed` says why).
        """
        self.check_health()
        now = time.monotonic()
        for key, (due, decision, name) in list(self._pending.items()):
            if now >= due:
                del self._pending[key]
                self._restart_now(decision, name)
        L = self.launcher
        for name, proc in list(L.processes.items()):
            if name in self._finished or name in self.group_exits or name in self._waiting():
                continue
            code = proc.poll()
            if code is None:
                continue
            spec = proc.spec
            if code == EXIT_UNKNOWN:
                code = self._infer_exit(spec, getattr(proc, "pid", 0))
            finished = code == 0 and spec.role in ("trainer", "collator")
            self._emit(Exited(process=name, role=spec.role, code=code))
            if not finished and self.policy.scopes.get(spec.role) == "group":
                # its peers fail a moment after it: the decision waits for their exits
                self.group_exits.hold(name, spec.role, code, exit_time(proc))
                continue
            decision = self.policy.decide(name, spec.role, code, finished_ok=finished)
            if decision.action == "done":
                self._finished.add(name)
                if spec.role == "collator":
                    self._put_eof()
                continue
            if decision.action == "fail":
                self._fail(self._failure(name, code, decision))
                return "failed"
            self._schedule(decision, name)
            if decision.scope == "run":
                break
        if self._decide_groups() == "failed":
            return "failed"
        if self._pending or self.group_exits:
            return "recovering"
        trainers = [n for n, s in self.specs.items() if s.role == "trainer"]
        if trainers and all(n in self._finished for n in trainers):
            return "succeeded"
        return "running"

    def _decide_groups(self) -> str | None:
        """Decide the restart of each group whose exits are in (:meth:`GroupExits.due`): the
        cause is the process that died first.

        Returns:
            ``failed`` when a decision failed the run (:attr:`failed` says why), else None.
        """
        L = self.launcher

        def running(name: str) -> bool:
            proc = L.processes.get(name)
            return name not in self._finished and proc is not None and proc.poll() is None

        def members(role: str) -> list[str]:
            return [n for n, s in self.specs.items() if s.role == role]

        for role, name, code, cause in self.group_exits.due(members, running):
            logger.info("[run] %s", cause)
            decision = self.policy.decide(name, role, code, cause=cause)
            if decision.action == "fail":
                self._fail(self._failure(name, code, decision))
                return "failed"
            self._schedule(decision, name)
        return None

    def _failure(self, name: str, code: int, decision: Decision) -> Failure:
        """The failure of the run after the exit of ``name``: the policy's reason, and for bad
        settings or data the process's own one-line error (its cause and fix) after it."""
        proc = self.launcher.processes[name]
        spec = proc.spec
        tail = proc.tail()
        reason = decision.reason
        if code in DETERMINISTIC_CODES:
            error = error_line(tail)
            if error:
                reason = f"{reason}: {error}"
        return Failure(
            process=name,
            role=spec.role,
            exit_code=code,
            reason=reason,
            log_file=spec.log_file,
            log_tail=tail,
        )

    def check_health(self) -> None:
        """Kill (SIGKILL) every running process that counts as dead though its pid lives: its
        heartbeat stopped for ``dead_after_s`` (frozen) or its main loop made no progress for
        ``hang_after_s`` (hung); without a heartbeat yet, a process stopped (state T) for
        ``dead_after_s``. Each is killed and reported once: the next :meth:`poll_once` that sees
        its exit applies the policy."""
        now, mono = time.time(), time.monotonic()
        waiting = self._waiting()
        for name, proc in list(self.launcher.processes.items()):
            pid = getattr(proc, "pid", None)
            if name in self._finished or name in waiting or not pid or proc.poll() is not None:
                self._frozen_since.pop(name, None)
                self._killed.pop(name, None)
                continue
            if self._killed.get(name) == pid:
                continue  # killed, not yet gone
            path = proc.spec.env.get(HEARTBEAT_ENV)
            record = read_heartbeat(path) if path else None
            if record is not None and record.get("pid") != pid:
                record = None  # its predecessor's last beat
            why = None
            if record is not None:
                self.heartbeats[name] = record
                self._frozen_since.pop(name, None)
                why = verdict(
                    record,
                    now=now,
                    dead_after_s=self.dead_after_s,
                    hang_after_s=self.config.hang_after_s,
                )
            else:
                ident = identity(pid) if _is_local_process(proc) else None
                if ident is None or ident["state"] not in ("T", "t"):
                    self._frozen_since.pop(name, None)
                else:
                    since = self._frozen_since.setdefault(name, mono)
                    if mono - since >= self.dead_after_s:
                        why = f"stopped (state T) for {mono - since:.1f}s: frozen"
            if why is None:
                continue
            logger.warning("[run] %s (pid %d) is unresponsive, %s: killing it", name, pid, why)
            self._emit(Unresponsive(process=name, pid=pid, reason=why))
            self._frozen_since.pop(name, None)
            self._killed[name] = pid
            proc.signal(signal.SIGKILL)

    def stop(self, grace_s: float = 300.0) -> dict[str, int | None]:
        """Graceful stop: SIGTERM the trainer ranks (they stop at one step boundary and write a
        checkpoint), then every other process, the queue last (services/launch/base.py).

        Args:
            grace_s: seconds the trainers get before they are killed.

        Returns:
            The trainers' exit codes.
        """
        self._pending.clear()
        self.group_exits.clear()
        trainers = [n for n, s in self.specs.items() if s.role == "trainer"]
        codes = self.launcher.stop(trainers, grace_s=grace_s)
        self.launcher.stop(grace_s=60)
        return codes

    def fail(self, failure: Failure) -> str:
        """Fail the run for a reason seen outside its processes (a shared queue unreachable):
        recorded in :attr:`failed`, no event (the caller reports what it saw).

        Returns:
            ``failed``.
        """
        self.failed = failure
        return "failed"

    # ------------------------------------------------------------------ restarts

    def restart_all(self, cause: str) -> str:
        """Restart every process of the run because its queue lost the run's samples while no
        process exited (a shared queue that restarted without ``--data-dir``), as after the exit
        of a queue of its own: one restart of the ``run`` budget; every process stops now and
        :meth:`poll_once` starts them all again after the backoff, the trainers from their
        checkpoint. Restarts queued before are cancelled (the relaunch starts their processes);
        a run-wide restart already queued covers this one (nothing more is counted).

        Args:
            cause: what happened, the start of the restart's reason
                (``"queue restarted: epoch X -> Y"``).

        Returns:
            ``recovering``, or ``failed`` when the ``run`` budget is spent: :attr:`failed` names
            the ``queue``, its exit code None (nothing was stopped).
        """
        if self.restart_queued("run"):
            return "recovering"
        decision = self.policy.decide_lost("queue", "queue", cause)
        if decision.action == "fail":
            self._fail(
                Failure(process="queue", role="queue", exit_code=None, reason=decision.reason)
            )
            return "failed"
        assert decision.scope == "run", decision  # the queue's scope (policy.SCOPES)
        self._schedule(decision, "queue")
        return "recovering"

    def restart_queued(self, scope: str | None = None) -> bool:
        """A restart waits for its backoff.

        Args:
            scope: only a restart of this scope counts (``process``, ``group``, ``run``); None:
                any.
        """
        return any(scope in (None, d.scope) for _, d, _ in self._pending.values())

    def _covered(self, scope: str, name: str) -> set[str]:
        """The processes a restart of ``scope`` after the exit of ``name`` starts."""
        if scope == "process":  # with the rest of its unit (a tensor-parallel group)
            unit = self.specs[name].unit
            return {n for n, s in self.specs.items() if unit is not None and s.unit == unit} | {
                name
            }
        if scope == "group":
            role = self.specs[name].role
            return {n for n, s in self.specs.items() if s.role == role}
        return set(self.specs)

    def _waiting(self) -> set[str]:
        """Processes a scheduled restart will start again (their exit is already handled)."""
        out: set[str] = set()
        for _, decision, name in self._pending.values():
            out |= self._covered(decision.scope, name)
        return out

    def _schedule(self, decision: Decision, name: str) -> None:
        """Queue the restart ``decision`` after the exit (or loss) of ``name``: a group or the
        run stops now; :meth:`poll_once` starts the processes when the backoff is over."""
        logger.warning("[run] %s", decision.reason)
        covered = self._covered(decision.scope, name)
        self.group_exits.forget(covered)  # their exits are this restart's to handle
        for key, (_, queued, queued_name) in list(self._pending.items()):
            # this restart starts the queued one's processes too: both would start them twice
            if self._covered(queued.scope, queued_name) <= covered:
                del self._pending[key]
                logger.info(
                    "[run] the queued restart of %s is cancelled: the %s restart starts it",
                    key,
                    decision.scope,
                )
        self._emit(
            Recovering(
                process=name,
                scope=decision.scope,
                attempt=decision.attempt,
                delay_s=decision.delay_s,
                reason=decision.reason,
                code=decision.code,
                max_restarts=decision.max_restarts,
            )
        )
        L = self.launcher
        if decision.scope == "group" or len(covered) > 1:
            # a peer of a dead rank cannot checkpoint alone (the save is collective), nor can a
            # tensor-parallel rank compute without its unit
            L.stop([n for n in self.specs if n in covered], grace_s=10)
            self._finished.difference_update(covered)
        elif decision.scope == "run":
            L.stop(grace_s=10)
            self._finished.clear()
        self._pending[decision.key] = (time.monotonic() + decision.delay_s, decision, name)

    def _restart_now(self, decision: Decision, name: str) -> None:
        if decision.scope == "process":
            covered = self._covered("process", name)
            for spec in self.specs.values():  # in start order: a unit's first rank first
                if spec.name in covered:
                    self._start(spec)
        elif decision.scope == "group":
            role = self.specs[name].role
            self.master_port = free_port()
            for spec in self.specs.values():
                if spec.role == role:
                    if role == "trainer":
                        spec.env["MASTER_PORT"] = str(self.master_port)
                    self._start(spec)
        else:
            self.launch()
        self._emit(
            Restarted(
                process=name,
                scope=decision.scope,
                attempt=decision.attempt,
                code=decision.code,
                max_restarts=decision.max_restarts,
            )
        )

    def _infer_exit(self, spec: ProcessSpec, pid: int = 0) -> int:
        """The exit code of a re-attached process that ended unseen: the code it wrote as it
        exited (:func:`services.common.lifecycle.read_exit_code`, of pid ``pid`` when known);
        without one (killed by a signal), a trainer rank finished when rank 0's summary of a
        completed (not stopped) run is newer than this launch."""
        code = read_exit_code(self.exit_file(spec.name), pid or None)
        if code is not None:
            return code
        if spec.role == "trainer":
            path = self.run_dir / "summary.json"
            try:
                summary = json.loads(path.read_text())
                if path.stat().st_mtime >= self.segment_started and not summary.get("stopped"):
                    return 0
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        return EXIT_UNKNOWN

    def _put_eof(self) -> None:
        """After the collator's normal end: tell the trainers how many samples the epoch has."""
        from services.protocol import put_eof
        from services.queue.client import QueueClient

        if self.eof_done:
            return
        with QueueClient(self.queue_address, timeout_s=10, name="run") as client:
            # every sample put: the ones held and the ones retention dropped once trained
            status = client.status(self.partition, "run")
            n = status["samples"] + status.get("dropped", 0)
            put_eof(client, self.partition, n)
        logger.info("[run] collator done: %d samples", n)
        self.eof_done = True
        if self._progress_line is not None and not self.config.trainer.schedule.max_steps:
            tr = self.config.trainer
            share = tr.on_policy.share(tr.feed.step_samples)
            self._progress_line.set_total(
                estimated_steps(
                    n,
                    tr.feed.micro_batch,
                    tr.feed.grad_accum,
                    self.config.trainers,
                    tr.schedule.epochs,
                    share,
                ),
                final=True,
            )
        self._emit(DataComplete(samples=n))

    def _fail(self, failure: Failure) -> None:
        self.failed = failure
        self._emit(Failed(failure=failure))

    def _emit(self, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _progress(self) -> RunProgress:
        """The run's progress, made at its first use (after :meth:`prepare`: a run that ends with
        its data counts the texts of its corpus in a thread for its total)."""
        if self._progress_line is not None:
            return self._progress_line
        config, tr = self.config, self.config.trainer
        ready = {s.name: s.ready_file for s in self.specs.values() if s.ready_file}
        teachers = [ready[n] for n, s in self.specs.items() if s.role == "teacher" and n in ready]
        dequantizes = False
        if teachers and config.teacher.model == "smollm2":
            from xtoken_core.models.smollm2 import smollm2_cached

            dequantizes = not smollm2_cached()
        progress = self._progress_line = RunProgress(
            self.run_dir / "metrics" / "trainer.rank0.jsonl",
            tr.schedule.max_steps or None,
            teacher_ready=teachers,
            student_ready=ready.get("trainer0"),
            dequantizes=dequantizes,
            total_is_exact=bool(tr.schedule.max_steps),
            since=self.segment_started or None,
        )
        train = self.inputs.train if self.inputs is not None else config.data.train
        if not tr.schedule.max_steps and train is not None:
            limit = self.inputs.train_limit if self.inputs is not None else config.data.limit

            def count() -> None:
                try:
                    texts = count_texts(
                        train,
                        text_field=config.data.text_field,
                        txt_split=config.data.txt_split,
                        limit=limit,
                    )
                except (OSError, ValueError):
                    return  # no total: the collator reports the corpus's problem
                share = tr.on_policy.share(tr.feed.step_samples)
                steps = estimated_steps(
                    texts,
                    tr.feed.micro_batch,
                    tr.feed.grad_accum,
                    config.trainers,
                    tr.schedule.epochs,
                    share,
                )
                progress.set_total(steps)  # unless the collator's count came first

            threading.Thread(target=count, name="corpus-steps", daemon=True).start()
        return progress


def write_sections(plan: Plan) -> None:
    """Write a launch's section files (``config/<process>.json``, the shared
    ``config/context.json``, ``config/run.json``) and make its log directory."""
    d = plan.place.run_dir
    (d / "config").mkdir(parents=True, exist_ok=True)
    (d / "logs").mkdir(parents=True, exist_ok=True)
    for name, section in plan.sections.items():
        (d / "config" / f"{name}.json").write_text(json.dumps(section, indent=1))
    (d / "config" / CONTEXT_FILE).write_text(json.dumps(plan.shared, indent=1))
    (d / "config" / "run.json").write_text(json.dumps(plan.run_section, indent=1))


def _inputs_written(run_dir: Path) -> Inputs | None:
    """The settled inputs a launch wrote into ``config/run.json``, or None without one."""
    try:
        run = json.loads((run_dir / "config" / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    data = run.get("data") or {}
    projection = ((run.get("trainer") or {}).get("loss") or {}).get("projection")
    extra = tuple(e.get("projection") for e in run.get("extra_teachers") or ())
    return Inputs(data.get("train"), data.get("heldout"), projection, None, extra)


def _is_local_process(proc: Any) -> bool:
    """The process runs on this host (its /proc entry is ours to read)."""
    host = getattr(proc, "host", None)
    return host is None or host == socket.gethostname()
