"""The run config (one typed config of a whole distillation run) and ``xtoken run``: prepare,
start queue, collator, teachers and trainers as local subprocesses, watch them, stop them.

Only ``xtoken run``, the demo and the control plane import this module; each process gets only its
own section as a JSON file (``run_dir/config/<process>.json``). Values that must agree across
processes (queue address, partition, tokenizers, context lengths, run directory) are set once at
the top of the run config and written into every section here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

from services.common import config as cfgmod
from services.common.heartbeat import HEARTBEAT_ENV, HEARTBEAT_S_ENV, read_heartbeat, verdict
from services.common.metrics import read_jsonl
from services.control.attach import EXIT_UNKNOWN, identity
from services.control.policy import Decision, RestartPolicy
from services.control.series import Series
from services.launch.local import LocalLauncher, ProcessSpec
from services.teacher.worker import TeacherConfig
from services.trainer.config import LossConfig, TrainerConfig

logger = logging.getLogger(__name__)

# The trainer section's projection until Run.prepare builds (or finds) the run's file.
PENDING_PROJECTION = "<built by xtoken run>"


@dataclasses.dataclass
class DataConfig:
    """Training and held-out text."""

    train: str | None = field(
        default=None, metadata={"help": "training corpus (.jsonl/.txt/.parquet); None: demo corpus"}
    )
    heldout: str | None = field(
        default=None, metadata={"help": "held-out corpus for bits/byte; None: the demo's"}
    )
    limit: int | None = field(default=None, metadata={"help": "use only the first N texts"})
    text_field: str = field(default="text", metadata={"help": "JSON field / parquet column"})

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1, or null for the whole corpus")


@dataclasses.dataclass
class CollatorSection:
    """The collator process."""

    workers: int = field(default=1, metadata={"help": "collator worker processes"})
    batch: int = field(default=16, metadata={"help": "texts per put"})

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batch < 1:
            raise ValueError("collator.workers and collator.batch must be >= 1")


@dataclasses.dataclass
class QueueSection:
    """The run's transfer queue: its own (started with the run) or an external one."""

    address: str | None = field(
        default=None,
        metadata={
            "help": "address of a running queue server (tcp://host:port or ipc://path) the run "
            "uses instead of starting its own; its partitions there are prefixed with the run id"
        },
    )

    def __post_init__(self) -> None:
        a = self.address
        if a is None:
            return
        scheme, sep, rest = a.partition("://")
        ok = bool(sep and rest) and scheme in ("tcp", "ipc")
        if ok and scheme == "tcp":
            host, colon, port = rest.rpartition(":")
            ok = bool(colon and host) and port.isdigit() and 0 < int(port) < 65536
        if not ok:
            raise ValueError(
                f"address={a!r} is not a queue address: use tcp://HOST:PORT or ipc://PATH, or "
                "leave it null for a queue of the run's own"
            )


@dataclasses.dataclass
class RunConfig:
    """A whole distillation run (``xtoken run CONFIG.yaml``)."""

    run_dir: str = field(default="runs/demo", metadata={"help": "run directory"})
    partition: str = field(default="train", metadata={"help": "queue partition of the samples"})
    student_tokenizer: str = field(default="qwen3", metadata={"help": "student tokenizer"})
    teacher_tokenizer: str = field(default="smollm2", metadata={"help": "teacher tokenizer"})
    ctx_student: int = field(default=512, metadata={"help": "student tokens per text"})
    ctx_teacher: int = field(default=512, metadata={"help": "teacher tokens per text"})
    projection_top_k: int = field(
        default=8, metadata={"help": "slots per row of a projection built for the run"}
    )
    queue_capacity: str = field(
        default="4GiB", metadata={"help": "capacity of the run's own queue in bytes"}
    )
    queue: QueueSection = field(default_factory=QueueSection)
    teachers: int = field(default=1, metadata={"help": "teacher processes (groups)"})
    trainers: int = field(default=1, metadata={"help": "trainer ranks"})
    max_restarts: int = field(
        default=2,
        metadata={"help": "restarts per process (per trainer group, per run) before failing"},
    )
    restart_backoff_s: float = field(
        default=1.0, metadata={"help": "wait before a restart; doubles with each further one"}
    )
    ready_timeout_s: float = field(
        default=600.0, metadata={"help": "seconds a process may take to get ready"}
    )
    heartbeat_s: float = field(
        default=1.0, metadata={"help": "seconds between two heartbeats of every process"}
    )
    hang_after_s: float | None = field(
        default=600.0,
        metadata={
            "help": "a process whose main loop made no progress this long (steps, requests; "
            "checkpoints and evals excepted) is hung: killed and restarted per policy; "
            "null: never"
        },
    )
    data: DataConfig = field(default_factory=DataConfig)
    collator: CollatorSection = field(default_factory=CollatorSection)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(loss=LossConfig(projection=PENDING_PROJECTION))
    )

    def __post_init__(self) -> None:
        for name in ("ctx_student", "ctx_teacher", "teachers", "trainers", "projection_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts}: must be >= 0")
        if self.restart_backoff_s < 0:
            raise ValueError(f"restart_backoff_s={self.restart_backoff_s}: must be >= 0")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s={self.heartbeat_s}: must be > 0")
        if self.hang_after_s is not None and not self.hang_after_s > 2 * self.heartbeat_s:
            raise ValueError(
                f"hang_after_s={self.hang_after_s}: must be > 2 * heartbeat_s "
                f"({2 * self.heartbeat_s:g}), or null to never call a process hung"
            )
        t, tr = self.teacher, self.trainer
        if tr.loss.uses_teacher:
            if t.max_batch < tr.micro_batch:
                raise ValueError(
                    f"teacher.max_batch={t.max_batch} < trainer.micro_batch={tr.micro_batch}: a "
                    "micro-batch must fit one teacher slot; raise teacher.max_batch"
                )
            if t.max_length < self.ctx_teacher:
                raise ValueError(
                    f"teacher.max_length={t.max_length} < ctx_teacher={self.ctx_teacher}: raise "
                    "teacher.max_length to at least ctx_teacher"
                )
            if t.transport == "hidden" and not tr.teacher_model:
                # the trainer applies the teacher's output layer: it loads the same model
                tr.teacher_model = t.model
        if tr.teacher_groups != 1 and tr.teacher_groups != self.teachers:
            raise ValueError(
                f"trainer.teacher_groups={tr.teacher_groups} but teachers={self.teachers}; leave "
                "teacher_groups unset (the run sets it)"
            )
        tr.teacher_groups = self.teachers
        if self.teachers > self.trainers:
            raise ValueError(
                f"teachers={self.teachers} > trainers={self.trainers}: a teacher group serves "
                "ranks r with r % teachers == group, so extra teachers would idle"
            )


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read and validate a run config file (YAML or JSON).

    Raises:
        ConfigError: unknown keys, wrong types, impossible combinations (with the key's path).
    """
    return run_config_from_dict(cfgmod.load_file(path))


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a run config given as a mapping (the trainer's projection may be left empty).

    Raises:
        ConfigError: as :func:`services.common.config.from_dict`.
    """
    data = json.loads(json.dumps(data))  # a private copy
    trainer = data.setdefault("trainer", {})
    if isinstance(trainer, dict):
        loss = trainer.setdefault("loss", {})
        if (
            isinstance(loss, dict)
            and loss.get("mode", "pkl") != "ce"
            and not loss.get("projection")
        ):
            loss["projection"] = PENDING_PROJECTION  # Run.prepare builds it
    return cfgmod.from_dict(RunConfig, data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One run: prepare, launch, watch, stop.

    Args:
        config: the run config.
        launcher: a launcher (``start``, ``wait_ready``, ``stop``, ``processes``; default: a
            new LocalLauncher).
        progress: print a progress line to stderr while training.
        on_event: called with ``(kind, data)`` on launches, exits, restarts and failures
            (the control plane records them).
        dead_after_s: a process without a heartbeat this long (or, before its first beat,
            frozen by SIGSTOP this long) is dead: killed and restarted per policy.
        run_id: prefixes the run's partitions on an external queue (``queue.address``);
            default: the run directory's name and a hash of its path.
    """

    def __init__(
        self,
        config: RunConfig,
        launcher: Any = None,
        progress: bool = True,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        dead_after_s: float = 10.0,
        run_id: str | None = None,
    ) -> None:
        if not dead_after_s > 2 * config.heartbeat_s:
            raise ValueError(
                f"dead_after_s={dead_after_s:g} of the supervisor is not above two heartbeats "
                f"(heartbeat_s={config.heartbeat_s:g}): lower the run's heartbeat_s"
            )
        self.config = config
        self.dead_after_s = dead_after_s
        self.heartbeats: dict[str, dict[str, Any]] = {}  # process name -> its last beat
        self._frozen_since: dict[str, float] = {}
        self.launcher = launcher or LocalLauncher()
        self.progress = progress
        self.on_event = on_event
        self.run_dir = Path(config.run_dir).resolve()
        self.run_id = run_id or default_run_id(self.run_dir)
        self.external_queue = config.queue.address
        # on an external queue every partition of the run (samples, teacher requests, end of data)
        # starts with "<run id>.": two runs there never see each other's samples
        self.partition = (
            f"{self.run_id}.{config.partition}" if self.external_queue else config.partition
        )
        self.stop_requested = threading.Event()
        self.policy = RestartPolicy(config.max_restarts, config.restart_backoff_s)
        self.failure: str | None = None
        self.failed_process: str | None = None
        self.exit_code: int | None = None
        self.queue_address = ""
        self.master_port = 0
        self.specs: dict[str, ProcessSpec] = {}
        self.eof_done = False
        self.segment_started = 0.0
        self._finished: set[str] = set()
        # budget key -> (monotonic due time, decision, the exited process)
        self._pending: dict[str, tuple[float, Decision, str]] = {}
        self._series: Series | None = None  # rank 0's step records (progress line)
        self._compiling = False  # rank 0 compiles the student (its start-up step)
        self._recent: list[dict[str, Any]] = []  # the last step records (progress line)

    # ------------------------------------------------------------------ prepare

    def prepare(self) -> None:
        """Corpus, projection and vocab checks, before any process starts.

        Raises:
            ValueError: a missing corpus or tokenizer, a vocab mismatch (names what and the fix).
        """
        from xtoken_core.tokenizers import load_tokenizer

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.data.train is None or cfg.data.heldout is None:
            from xtoken_core.data.corpus import build_demo_corpus

            demo = build_demo_corpus()
            cfg.data.train = cfg.data.train or str(demo.train_path)
            cfg.data.heldout = cfg.data.heldout or str(demo.heldout_path)
        corpora = {
            "data.train": cfg.data.train,
            "data.heldout": cfg.data.heldout,
            "trainer.heldout": cfg.trainer.heldout,
            "teacher.heldout": cfg.teacher.heldout,
        }
        for key, path in corpora.items():
            if path is None:
                continue
            if not Path(path).is_file():
                raise ValueError(f"{key}={path!r} is not a file; point it at a corpus file")
            try:
                _first_text(path, cfg.data.text_field if key == "data.train" else "text")
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        tokenizers = {}
        for key in ("student_tokenizer", "teacher_tokenizer"):
            try:
                tokenizers[key] = load_tokenizer(getattr(cfg, key))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        s_tok, t_tok = tokenizers["student_tokenizer"], tokenizers["teacher_tokenizer"]
        self._check_vocabs(s_tok.vocab_size, t_tok.vocab_size)
        if cfg.trainer.loss.uses_teacher and cfg.trainer.loss.projection in (
            None,
            PENDING_PROJECTION,
        ):
            cfg.trainer.loss.projection = str(self._projection(s_tok, t_tok))
        elif cfg.trainer.loss.uses_teacher:
            self._check_projection(cfg.trainer.loss.projection, s_tok, t_tok)

    def _check_projection(self, path: str, s_tok: Any, t_tok: Any) -> None:
        """A given projection file must fit the run's tokenizers (rows: student, columns: teacher),
        be built for them (the tokenizers it records; a file without that record is accepted
        with a warning) and have usable rows; its coverage is logged.

        Raises:
            ValueError: a missing or unreadable file, one built for other vocabularies or
                tokenizers, or one without a usable row.
        """
        from xtoken_core.data.projection import check_projection_tokenizers, parse_projection_file

        student_vocab, teacher_vocab = s_tok.vocab_size, t_tok.vocab_size

        try:
            _, _, rows, cols = parse_projection_file(path)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"trainer.loss.projection: {e}") from None
        if rows > student_vocab or cols > teacher_vocab:
            raise ValueError(
                f"trainer.loss.projection={path!r} is {rows} x {cols} (student x teacher ids) but "
                f"the run's tokenizers have {student_vocab} and {teacher_vocab} ids: build one for "
                f"{self.config.student_tokenizer} -> {self.config.teacher_tokenizer} with `xtoken "
                "projection build`, or leave it empty and xtoken run builds it"
            )
        try:
            check_projection_tokenizers(path, s_tok, t_tok)
        except ValueError as e:
            raise ValueError(f"trainer.loss.projection: {e}") from None

    def _check_vocabs(self, student_vocab: int, teacher_vocab: int) -> None:
        from xtoken_core.models import check_vocab

        cfg = self.config
        for key, spec, override, tok_vocab in (
            ("trainer.student", cfg.trainer.student, cfg.trainer.vocab_size, student_vocab),
            ("teacher.model", cfg.teacher.model, cfg.teacher.vocab_size, teacher_vocab),
        ):
            if key == "teacher.model" and not cfg.trainer.loss.uses_teacher:
                continue
            try:
                model_vocab = spec_vocab_size(spec, override or tok_vocab)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            check_vocab(f"{key}={spec!r}", model_vocab, tok_vocab)

    def _projection(self, s_tok: Any, t_tok: Any) -> Path:
        from xtoken_core.data.projection_build import (
            build_projection,
            projection_metadata,
            save_projection,
        )

        cache = Path(os.environ.get("XTOKEN_CACHE", Path.home() / ".cache" / "xtoken"))
        k = self.config.projection_top_k
        name = (
            f"{_slug(self.config.student_tokenizer)}_{_slug(self.config.teacher_tokenizer)}_k{k}.pt"
        )
        path = cache / "projections" / name
        if not path.is_file():
            logger.info("[run] building projection %s", path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            save_projection(
                build_projection(s_tok, t_tok, k), tmp, projection_metadata(s_tok, t_tok)
            )
            os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ sections

    def _sections(self, queue: str) -> dict[str, dict[str, Any]]:
        cfg = self.config
        teacher = dataclasses.replace(
            cfg.teacher,
            queue=queue,
            partition=self.partition,
            tokenizer=cfg.teacher_tokenizer,
        )
        trainer = dataclasses.replace(
            cfg.trainer,
            queue=queue,
            partition=self.partition,
            student_tokenizer=cfg.student_tokenizer,
            teacher_tokenizer=cfg.teacher_tokenizer,
            teacher_vocab_size=cfg.trainer.teacher_vocab_size or cfg.teacher.vocab_size,
            teacher_seed=cfg.teacher.seed,
            run_dir=str(self.run_dir),
            heldout=cfg.trainer.heldout or cfg.data.heldout,
            teacher_groups=cfg.teachers,
            max_length=cfg.trainer.max_length or cfg.ctx_student,
        )
        out = {"trainer": cfgmod.to_dict(trainer)}
        for g in range(cfg.teachers):
            device = teacher.device
            if device == "cuda":
                device = f"cuda:{g % max(1, _gpu_count())}"
            out[f"teacher{g}"] = cfgmod.to_dict(
                dataclasses.replace(
                    teacher,
                    group=g,
                    device=device,
                    heldout=(teacher.heldout or cfg.data.heldout) if g == 0 else None,
                    eval_ctx=cfg.trainer.eval_ctx,
                    eval_texts=cfg.trainer.eval_texts,
                )
            )
        return out

    def _specs(self, queue: str, port: int) -> list[ProcessSpec]:
        cfg = self.config
        d = self.run_dir
        (d / "config").mkdir(parents=True, exist_ok=True)
        (d / "logs").mkdir(parents=True, exist_ok=True)
        sections = self._sections(queue)
        for name, section in sections.items():
            (d / "config" / f"{name}.json").write_text(json.dumps(section, indent=1))
        (d / "config" / "run.json").write_text(json.dumps(cfgmod.to_dict(cfg), indent=1))
        specs = []
        if not self.external_queue:
            specs.append(
                ProcessSpec(
                    "queue",
                    "queue",
                    ["queue", "serve", "--bind", queue, "--capacity", cfg.queue_capacity],
                    log_file=str(d / "logs" / "queue.log"),
                    ready_file=str(d / "ready" / "queue"),
                )
            )
        specs += [
            ProcessSpec(
                "collator",
                "collator",
                [
                    "collator",
                    "--queue",
                    queue,
                    "--data",
                    str(cfg.data.train),
                    "--student",
                    cfg.student_tokenizer,
                    "--teacher",
                    cfg.teacher_tokenizer,
                    "--partition",
                    self.partition,
                    "--workers",
                    str(cfg.collator.workers),
                    "--batch",
                    str(cfg.collator.batch),
                    "--ctx-student",
                    str(cfg.ctx_student),
                    "--ctx-teacher",
                    str(cfg.ctx_teacher),
                    "--text-field",
                    cfg.data.text_field,
                ]
                + (["--limit", str(cfg.data.limit)] if cfg.data.limit else []),
                log_file=str(d / "logs" / "collator.log"),
            ),
        ]
        teachers = cfg.teachers if cfg.trainer.loss.uses_teacher else 0
        threads = _cpu_threads(
            teachers if cfg.teacher.device == "cpu" else 0,
            cfg.trainers if cfg.trainer.device == "cpu" else 0,
        )
        for g in range(teachers):
            specs.append(
                ProcessSpec(
                    f"teacher{g}",
                    "teacher",
                    [
                        "teacher",
                        "--config",
                        str(d / "config" / f"teacher{g}.json"),
                        "--run-dir",
                        str(d),
                    ],
                    env=dict(threads) if cfg.teacher.device == "cpu" else {},
                    log_file=str(d / "logs" / f"teacher{g}.log"),
                    ready_file=str(d / "ready" / f"teacher{g}"),
                    resources={"gpu": 1} if cfg.teacher.device.startswith("cuda") else {},
                    group=str(g),
                )
            )
        for r in range(cfg.trainers):
            env = {
                "RANK": str(r),
                "WORLD_SIZE": str(cfg.trainers),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(threads if cfg.trainer.device == "cpu" else {}),
            }
            specs.append(
                ProcessSpec(
                    f"trainer{r}",
                    "trainer",
                    ["trainer", "--config", str(d / "config" / "trainer.json")],
                    env=env,
                    log_file=str(d / "logs" / f"trainer{r}.log"),
                    ready_file=str(d / "ready" / f"trainer{r}"),
                    resources={"gpu": 1} if cfg.trainer.device.startswith("cuda") else {},
                    group=str(r % cfg.teachers),
                )
            )
        for spec in specs:
            spec.env[HEARTBEAT_ENV] = str(d / "heartbeat" / spec.name)
            spec.env[HEARTBEAT_S_ENV] = str(cfg.heartbeat_s)
        return specs

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Prepare, launch and watch the run until it ends or is stopped.

        Returns:
            0 when the trainers finished (or were stopped cleanly), 1 when a process failed
            (``self.failure`` names it).
        """
        self.prepare()
        started = time.monotonic()
        try:
            self.launch()
            while True:
                if self.stop_requested.is_set():
                    logger.info("[run] stopping: trainers checkpoint first")
                    codes = self.stop(grace_s=300)
                    return 0 if all(c in (0, None) for c in codes.values()) else 1
                status = self.poll_once()
                if status == "succeeded":
                    logger.info("[run] trainers finished in %.0fs", time.monotonic() - started)
                    return 0
                if status == "failed":
                    logger.error("[run] %s", self.failure)
                    return 1
                if self.progress:
                    self._show_progress(started)
                time.sleep(0.5)
        finally:
            self.launcher.stop(grace_s=60)
            if self.progress:
                sys.stderr.write("\n")

    def launch(self) -> None:
        """Start the queue (and wait until it is ready), the collator, the teachers and trainers.

        Raises:
            RuntimeError: the queue did not get ready (with its last log lines).
        """
        self.queue_address = self.external_queue or f"tcp://127.0.0.1:{_free_port()}"
        self.master_port = _free_port()
        self.specs = {s.name: s for s in self._specs(self.queue_address, self.master_port)}
        self.eof_done = False
        self._finished = set()
        self.segment_started = time.time()
        L = self.launcher
        if self.external_queue:
            self._clear_partitions()
        else:
            q = L.start(self.specs["queue"])
            L.wait_ready(q, 60)
        for spec in self.specs.values():
            if spec.role != "queue":
                L.start(spec)
        self._emit("launched", queue=self.queue_address)

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

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` needs to watch this run again after a control-plane restart."""
        return {
            "queue": self.queue_address,
            "master_port": self.master_port,
            "eof_done": self.eof_done,
            "finished": sorted(self._finished),
            "restarts": self.policy.restarts(),
            "segment_started": self.segment_started,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Rebuild the specs of a launched run from :meth:`state` (processes are attached by the
        caller into ``launcher.processes``)."""
        self.queue_address = state["queue"]
        self.master_port = int(state["master_port"])
        self.specs = {s.name: s for s in self._specs(self.queue_address, self.master_port)}
        self.eof_done = bool(state.get("eof_done"))
        self._finished = set(state.get("finished", []))
        self.policy.used = dict(state.get("restarts", {}))
        self.segment_started = float(state.get("segment_started", 0.0))

    def poll_once(self) -> str:
        """One look at every process: the end of the data, restarts per policy, the end of the run.

        Returns:
            ``running``, ``recovering`` (a restart waits for its backoff), ``succeeded`` (every
            trainer rank exited 0) or ``failed`` (``self.failure``, ``self.failed_process`` and
            ``self.exit_code`` say why).
        """
        self.check_health()
        now = time.monotonic()
        for key, (due, decision, name) in list(self._pending.items()):
            if now >= due:
                del self._pending[key]
                self._restart_now(decision, name)
        L = self.launcher
        for name, proc in list(L.processes.items()):
            if name in self._finished or name in self._waiting():
                continue
            code = proc.poll()
            if code is None:
                continue
            spec = proc.spec
            if code == EXIT_UNKNOWN:
                code = self._infer_exit(spec)
            finished = code == 0 and spec.role in ("trainer", "collator")
            self._emit("exited", process=name, role=spec.role, code=code)
            decision = self.policy.decide(name, spec.role, code, finished_ok=finished)
            if decision.action == "done":
                self._finished.add(name)
                if spec.role == "collator":
                    self._put_eof()
                continue
            if decision.action == "fail":
                self.failed_process, self.exit_code = name, code
                self.failure = (
                    f"{decision.reason}; last log lines ({spec.log_file}):\n{proc.tail()}"
                )
                self._emit("failed", process=name, code=code, reason=decision.reason)
                return "failed"
            self._schedule(decision, name)
            if decision.scope == "run":
                break
        if self._pending:
            return "recovering"
        trainers = [n for n, s in self.specs.items() if s.role == "trainer"]
        if trainers and all(n in self._finished for n in trainers):
            return "succeeded"
        return "running"

    def check_health(self) -> None:
        """Kill (SIGKILL) every running process that counts as dead though its pid lives: its
        heartbeat stopped for ``dead_after_s`` (frozen) or its main loop made no progress for
        ``hang_after_s`` (hung); without a heartbeat yet, a process stopped (state T) for
        ``dead_after_s``. The next :meth:`poll_once` sees the exit and applies the policy."""
        now, mono = time.time(), time.monotonic()
        waiting = self._waiting()
        for name, proc in list(self.launcher.processes.items()):
            pid = getattr(proc, "pid", None)
            if name in self._finished or name in waiting or not pid or proc.poll() is not None:
                self._frozen_since.pop(name, None)
                continue
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
            self._emit("unresponsive", process=name, pid=pid, reason=why)
            self._frozen_since.pop(name, None)
            proc.signal(signal.SIGKILL)

    def stop(self, grace_s: float = 300.0) -> dict[str, int | None]:
        """Graceful stop: SIGTERM the trainer ranks (they stop at one step boundary and write a
        checkpoint), then every other process.

        Args:
            grace_s: seconds the trainers get before they are killed.

        Returns:
            The trainers' exit codes.
        """
        self._pending.clear()
        trainers = [n for n, s in self.specs.items() if s.role == "trainer"]
        codes = self.launcher.stop(trainers, grace_s=grace_s)
        self.launcher.stop(grace_s=60)
        return codes

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
            ``recovering``, or ``failed`` when the ``run`` budget is spent: ``failure`` says
            why, ``failed_process`` is ``queue``, ``exit_code`` None (nothing was stopped).
        """
        if self.restart_queued("run"):
            return "recovering"
        decision = self.policy.decide_lost("queue", "queue", cause)
        if decision.action == "fail":
            self.failure = decision.reason
            self.failed_process, self.exit_code = "queue", None
            self._emit("failed", process="queue", code=None, reason=decision.reason)
            return "failed"
        assert decision.scope == "run", decision  # the queue's scope (control/policy.py SCOPES)
        self._schedule(decision, "queue")
        return "recovering"

    def restart_queued(self, scope: str | None = None) -> bool:
        """A restart waits for its backoff.

        Args:
            scope: only a restart of this scope counts (``process``, ``group``, ``run``); None:
                any.
        """
        return any(scope in (None, d.scope) for _, d, _ in self._pending.values())

    @property
    def finished(self) -> frozenset[str]:
        """The processes that ended normally (a trainer rank or collator that exited 0)."""
        return frozenset(self._finished)

    def _covered(self, scope: str, name: str) -> set[str]:
        """The processes a restart of ``scope`` after the exit of ``name`` starts."""
        if scope == "process":
            return {name}
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
            "recovering",
            process=name,
            scope=decision.scope,
            attempt=decision.attempt,
            delay_s=decision.delay_s,
            reason=decision.reason,
        )
        L = self.launcher
        if decision.scope == "group":
            # a peer of a dead rank cannot checkpoint alone (the save is collective)
            L.stop([n for n in self.specs if n in covered], grace_s=10)
            self._finished.difference_update(covered)
        elif decision.scope == "run":
            L.stop(grace_s=10)
            self._finished.clear()
        self._pending[decision.key] = (time.monotonic() + decision.delay_s, decision, name)

    def _restart_now(self, decision: Decision, name: str) -> None:
        L = self.launcher
        if decision.scope == "process":
            L.start(self.specs[name])
        elif decision.scope == "group":
            role = self.specs[name].role
            self.master_port = _free_port()
            for spec in self.specs.values():
                if spec.role == role:
                    if role == "trainer":
                        spec.env["MASTER_PORT"] = str(self.master_port)
                    L.start(spec)
        else:
            self.launch()
        self._emit("restarted", process=name, scope=decision.scope, attempt=decision.attempt)

    def _infer_exit(self, spec: ProcessSpec) -> int:
        """The exit code of a re-attached process that ended unseen: a trainer rank finished when
        rank 0's summary of a completed (not stopped) run is newer than this launch."""
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
        from services.queue.client import QueueClient
        from services.trainer.feed import put_eof

        if self.eof_done:
            return
        with QueueClient(self.queue_address, timeout_s=10, name="run") as client:
            # every sample put: the ones held and the ones retention dropped once trained
            status = client.status(self.partition, "run")
            n = status["samples"] + status.get("dropped", 0)
            put_eof(client, self.partition, n)
        logger.info("[run] collator done: %d samples", n)
        self.eof_done = True
        self._emit("data_complete", samples=n)

    def _emit(self, kind: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)

    def _show_progress(self, started: float) -> None:
        if self._series is None:
            self._series = Series(self.run_dir / "metrics" / "trainer.rank0.jsonl")
        polled = self._series.poll()
        for r in polled:
            if r["kind"] == "compile":
                self._compiling = r.get("state") == "start"
        new = [r for r in polled if r["kind"] == "step"]
        self._recent = (self._recent + new)[-5:]
        records = self._recent
        elapsed = time.monotonic() - started
        if not records and self._compiling:
            line = f"[run] compiling the student... {elapsed:.0f}s"
        elif not records:
            line = f"[run] starting... {elapsed:.0f}s"
        else:
            last = records[-1]
            total = self.config.trainer.max_steps
            rate = [r.get("tokens_per_s") or 0 for r in records[-5:]]
            step_s = sum(r["step_s"] for r in records[-5:]) / len(records[-5:])
            eta = f" ETA {step_s * (total - last['step']):.0f}s" if total else ""
            bar = ""
            if total:
                done = int(30 * last["step"] / total)
                bar = "[" + "#" * done + "." * (30 - done) + "] "
            line = (
                f"{bar}step {last['step']}{'/' + str(total) if total else ''} loss "
                f"{last.get('loss', math.nan):.4f} kd {last.get('kl_loss', 0.0):.4f} ce "
                f"{last.get('ce_loss', 0.0):.4f} {sum(rate) / len(rate):.0f} tok/s{eta}"
            )
        sys.stderr.write("\r" + line[:150].ljust(150))
        sys.stderr.flush()


def default_run_id(run_dir: Path) -> str:
    """The id of a run started without one (``xtoken run``): its directory's name and a hash of
    its absolute path (two runs named alike in different places differ)."""
    import hashlib

    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return f"{_slug(run_dir.name)}-{digest}"


def _is_local_process(proc: Any) -> bool:
    """The process runs on this host (its /proc entry is ours to read)."""
    host = getattr(proc, "host", None)
    return host is None or host == socket.gethostname()


def spec_vocab_size(spec: str, preset_vocab: int) -> int:
    """The vocab of a model spec without loading its weights.

    Args:
        spec: a local HF directory, ``smollm2`` or a preset name.
        preset_vocab: the vocab a preset is built with.

    Raises:
        ValueError: a directory that is not a causal LM (no ``config.json``, no safetensors
            weights, another model type) or has no ``vocab_size``; an unknown spec.
    """
    from xtoken_core.models import PRESETS, check_model_dir

    path = Path(spec)
    if path.is_dir():
        config = check_model_dir(path)
        vocab = getattr(config, "vocab_size", None)
        if vocab is None and hasattr(config, "get_text_config"):
            vocab = getattr(config.get_text_config(), "vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError(f"model directory {spec!r}: config.json has no vocab_size")
        return vocab
    if spec == "smollm2":
        return SMOLLM2_VOCAB
    if spec in PRESETS:
        return preset_vocab
    raise ValueError(
        f"model {spec!r} is neither a local directory, smollm2, nor a preset "
        f"({', '.join(sorted(PRESETS))})"
    )


SMOLLM2_VOCAB = 49152


def _first_text(path: str, text_field: str) -> str:
    """The first non-blank text of a corpus file.

    Raises:
        ValueError: the file has no such text or cannot be read as a corpus (names the file).
    """
    from xtoken_core.data.corpus import iter_texts

    for _, text in iter_texts(path, text_field=text_field):
        if text.strip():
            return text
    raise ValueError(f"corpus {path!r} has no usable text; point it at a corpus with text")


def _cpu_threads(cpu_teachers: int, cpu_trainers: int) -> dict[str, str]:
    """Intra-op threads per CPU teacher / trainer process: the cores shared among them (threads
    of several processes fighting over the same cores make each one slower, not faster)."""
    procs = cpu_teachers + cpu_trainers
    if not procs or "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // procs))}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in Path(name).name or name)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover
        return 0


def report(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's held-out bits/byte: teacher, student before and after (from its metrics)."""
    run_dir = Path(run_dir)
    out: dict[str, Any] = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        summary = {}
    for tag in ("before", "after"):
        if f"student_{tag}" in summary:
            out[f"student_{tag}"] = summary[f"student_{tag}"]["bits_per_byte"]
    for path in sorted((run_dir / "metrics").glob("teacher.group*.jsonl")):
        for r in read_jsonl(path):
            if r.get("event") == "eval":
                out["teacher"] = r["bits_per_byte"]
    out["steps"] = summary.get("step")
    return out


def install_stop(run: Run) -> None:
    """SIGTERM / SIGINT on ``xtoken run``: checkpoint and stop cleanly."""

    def _stop(signum: int, frame: Any) -> None:
        if run.stop_requested.is_set():
            raise KeyboardInterrupt
        logger.info(
            "[run] %s: stopping the run (Ctrl-C again to kill)", signal.Signals(signum).name
        )
        run.stop_requested.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
