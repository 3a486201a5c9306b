"""The run config: one typed config of a whole distillation run (``xtoken run CONFIG.yaml``).

Values that must agree across processes (queue address, partition, tokenizers, context lengths,
run directory) are set once at the top; each process's own section is nested below it
(:mod:`services.supervise.plan` writes every process only its own).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import field
from typing import Any, Literal

from services.common import config as cfgmod
from services.common.overrides import Override, apply_overrides
from services.rollout.config import RolloutConfig
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig

# the longest context a run may ask for (tokens per text); beyond it no model here fits
MAX_CONTEXT = 1 << 20
# the largest queue a run may ask for
MAX_QUEUE_BYTES = 1 << 50


def parse_size(text: object) -> int:
    """A byte size from ``512MiB``, ``8GiB``, ``2GB``, ``1e9`` or ``1048576``.

    Raises:
        ValueError: not a size, not positive, or not finite (names the value and the forms).
    """
    from services.queue.cli import parse_size as parse

    try:
        return parse(str(text))
    except OverflowError:  # 1e999: an infinite float
        raise ValueError(f"size {text!r} is not finite; write e.g. 512MiB or 8GiB") from None


def check_finite(obj: object, *names: str) -> None:
    """Every named float field of ``obj`` is a finite number (``1e999`` reads as inf).

    Raises:
        ValueError: names the field, its value and the fix.
    """
    for name in names:
        value = getattr(obj, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name}={value}: must be a finite number")


@dataclasses.dataclass
class DataConfig:
    """Training and held-out text."""

    train: str | None = field(
        default=None,
        metadata={
            "help": "training corpus: a .jsonl/.txt/.parquet file, a folder of them or a glob "
            "(as the collator's --data); None: the demo corpus",
            "path": "file",
            "trained": True,
        },
    )
    heldout: str | None = field(
        default=None,
        metadata={
            "help": "held-out corpus for bits/byte; None: the last trainer.eval_texts texts of "
            "data.train (not trained on), or the demo's with the demo corpus",
            "path": "file",
            "trained": True,
        },
    )
    limit: int | None = field(
        default=None, metadata={"help": "use only the first N texts", "trained": True}
    )
    text_field: str = field(
        default="text",
        metadata={"help": "JSON field / parquet or Hugging Face dataset column", "trained": True},
    )
    txt_split: Literal["blank_line", "line"] = field(
        default="blank_line",
        metadata={
            "help": "how a .txt file is cut into texts: blank_line (a text is a run of non-blank "
            "lines; blank lines separate texts) or line (every non-blank line is a text)",
            "trained": True,
        },
    )
    skip_bad_lines: bool = field(
        default=False,
        metadata={
            "help": "skip (log and count) corpus lines without usable text instead of stopping "
            "the run at the first (the collator's --skip-bad-lines)",
            "trained": True,
        },
    )

    seed: int | None = field(
        default=None,
        metadata={
            "help": "shuffle the training texts with this seed before they are put (the "
            "collator holds them in memory); null: corpus order",
            "trained": True,
        },
    )
    ordered: bool = field(
        default=False,
        metadata={
            "help": "every run of one config trains the same micro-batches in the same steps, "
            "with or without a teacher: one collator worker puts in order and the trainer "
            "claims whole steps (micro_batch x grad_accum samples), sorted only within a step; "
            "needs collator.workers 1 and trainers 1",
            "trained": True,
        },
    )

    on_policy_fraction: float = field(
        default=0.0,
        metadata={
            "help": "share of each step's samples the student samples itself (on-policy, GKD's "
            "lambda): rollout workers continue prompts of the corpus with the trainer's "
            "weights, the teacher scores them with the same loss; 0: off-policy only",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1, or null for the whole corpus")
        if not (math.isfinite(self.on_policy_fraction) and 0 <= self.on_policy_fraction <= 1):
            raise ValueError(f"on_policy_fraction={self.on_policy_fraction}: must be in [0, 1]")


@dataclasses.dataclass
class CollatorSection:
    """The collator process."""

    workers: int = field(
        default=1, metadata={"help": "collator worker processes", "trained": False}
    )
    batch: int = field(
        default=16,
        metadata={
            "help": "texts per put (with pack: the texts packed together; hundreds)",
            "trained": True,
        },
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "pack whole documents into rows of ctx_student / ctx_teacher tokens instead "
            "of one text per sample: positions restart per document, attention, chunks and "
            "next-token targets stay within a document (docs/design.md, Packing); the run sets "
            "trainer.pack and teacher.pack",
            "trained": True,
        },
    )
    kd_where_agrees: str | None = field(
        default=None,
        metadata={
            "help": "a third tokenizer name or path: the KD loss only on chunks whose student "
            "tokens are each also one token of it, covering the same bytes (e.g. KD from a "
            "same-tokenizer parent where another teacher's tokenizer would also align 1:1); "
            "the rollouts' samples too. None: every chunk",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        if self.workers < 1 or self.batch < 1:
            raise ValueError("collator.workers and collator.batch must be >= 1")
        if self.batch > 1 << 20:
            raise ValueError(f"batch={self.batch}: at most {1 << 20} texts per put")


@dataclasses.dataclass
class QueueSection:
    """The run's transfer queue: its own (started with the run) or an external one."""

    address: str | None = field(
        default=None,
        metadata={
            "help": "address of a running queue server (tcp://host:port or ipc://path) the run "
            "uses instead of starting its own; its partitions there are prefixed with the run id",
            "trained": False,
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
class RunTrainerConfig(TrainerConfig):
    """The trainer section of a run config: a :class:`TrainerConfig` whose ``loss.projection``
    may be left empty when the loss needs one; the run then builds it (or finds it in the cache),
    and the plan checks the trainer's section again with that file."""

    def check_projection(self) -> None:
        """A projection left empty is the run's to build (:attr:`projection_to_build`)."""

    @property
    def projection_to_build(self) -> bool:
        """The loss needs a projection and the config names none: the run builds it."""
        return self.loss.uses_teacher and not self.loss.projection


@dataclasses.dataclass
class RunConfig:
    """A whole distillation run (``xtoken run CONFIG.yaml``)."""

    run_dir: str = field(
        default="runs/default",
        metadata={
            "help": "run directory (the demo has its own, runs/demo)",
            "path": "run",
            "trained": False,
        },
    )
    partition: str = field(
        default="train", metadata={"help": "queue partition of the samples", "trained": False}
    )
    student_tokenizer: str = field(
        default="qwen3",
        metadata={"help": "student tokenizer", "path": "tokenizer", "trained": True},
    )
    teacher_tokenizer: str = field(
        default="smollm2",
        metadata={"help": "teacher tokenizer", "path": "tokenizer", "trained": True},
    )
    ctx_student: int = field(
        default=512, metadata={"help": "student tokens per text", "trained": True}
    )
    ctx_teacher: int = field(
        default=512, metadata={"help": "teacher tokens per text", "trained": True}
    )
    projection_top_k: int = field(
        default=8,
        metadata={"help": "slots per row of a projection built for the run", "trained": True},
    )
    queue_capacity: str = field(
        default="4GiB",
        metadata={"help": "capacity of the run's own queue in bytes", "trained": False},
    )
    queue: QueueSection = field(default_factory=QueueSection)
    teachers: int = field(
        default=1, metadata={"help": "teacher processes (groups)", "trained": False}
    )
    trainers: int = field(default=1, metadata={"help": "trainer ranks", "trained": True})
    rollouts: int = field(
        default=1,
        metadata={
            "help": "rollout processes (started when data.on_policy_fraction > 0)",
            "trained": False,
        },
    )
    max_restarts: int = field(
        default=2,
        metadata={
            "help": "restarts per process (per trainer group, per run) before failing",
            "trained": False,
        },
    )
    restart_backoff_s: float = field(
        default=1.0,
        metadata={"help": "wait before a restart; doubles with each further one", "trained": False},
    )
    ready_timeout_s: float = field(
        default=600.0,
        metadata={"help": "seconds a process may take to get ready", "trained": False},
    )
    heartbeat_s: float = field(
        default=1.0,
        metadata={"help": "seconds between two heartbeats of every process", "trained": False},
    )
    hang_after_s: float | None = field(
        default=600.0,
        metadata={
            "help": "a process whose main loop made no progress this long (steps, requests; "
            "checkpoints and evals excepted) is hung: killed and restarted per policy; "
            "null: never",
            "trained": False,
        },
    )
    mps: bool = field(
        default=False,
        metadata={
            "help": "run the GPU processes as clients of an MPS daemon of the run's own, so the "
            "teacher's, trainer's and rollouts' kernels on one GPU run side by side instead of "
            "taking turns (needs nvidia-cuda-mps-control; the processes on this machine)",
            "trained": False,
        },
    )
    data: DataConfig = field(default_factory=DataConfig)
    collator: CollatorSection = field(default_factory=CollatorSection)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    trainer: RunTrainerConfig = field(default_factory=RunTrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        for name in ("ctx_student", "ctx_teacher", "teachers", "trainers", "projection_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("ctx_student", "ctx_teacher"):
            if getattr(self, name) > MAX_CONTEXT:
                raise ValueError(
                    f"{name}={getattr(self, name)}: at most {MAX_CONTEXT} tokens per text"
                )
        try:
            size = parse_size(self.queue_capacity)
        except ValueError as e:
            raise ValueError(f"queue_capacity={self.queue_capacity!r}: {e}") from None
        if size > MAX_QUEUE_BYTES:
            raise ValueError(
                f"queue_capacity={self.queue_capacity!r}: at most {MAX_QUEUE_BYTES} bytes (1PiB)"
            )
        check_finite(self, "restart_backoff_s", "ready_timeout_s", "heartbeat_s", "hang_after_s")
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s={self.ready_timeout_s}: must be > 0")
        _check_tree(self)
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
        if self.data.ordered and self.collator.workers > 1:
            raise ValueError(
                f"data.ordered needs one collator worker (collator.workers="
                f"{self.collator.workers}): several put in the order they finish; set "
                "collator.workers: 1, or data.ordered: false"
            )
        tr.ordered = tr.ordered or self.data.ordered
        for section, value in (("trainer", tr.pack), ("teacher", t.pack)):
            if value and not self.collator.pack:
                raise ValueError(
                    f"{section}.pack: true but collator.pack is false; set collator.pack: true "
                    f"(the run sets {section}.pack from it)"
                )
        tr.pack = t.pack = self.collator.pack
        agree = self.rollout.kd_where_agrees
        if agree is not None and agree != self.collator.kd_where_agrees:
            raise ValueError(
                f"rollout.kd_where_agrees={agree!r} but collator.kd_where_agrees="
                f"{self.collator.kd_where_agrees!r}; set collator.kd_where_agrees only (the run "
                "gives the rollouts the same)"
            )
        self.rollout.kd_where_agrees = self.collator.kd_where_agrees
        if self.teachers > self.trainers:
            raise ValueError(
                f"teachers={self.teachers} > trainers={self.trainers}: a teacher group serves "
                "ranks r with r % teachers == group, so extra teachers would idle"
            )
        self._check_on_policy()
        if self.mps and not any(d.startswith("cuda") for _, d in self.devices()):
            raise ValueError(
                "mps: true but no process of the run is on a CUDA device ("
                + ", ".join(f"{k}={d}" for k, d in self.devices())
                + "): set mps: false, or put them on cuda"
            )

    def _check_on_policy(self) -> None:
        """``data.on_policy_fraction`` reaches the trainer (``trainer.on_policy.fraction``), and
        the rollout workers fit the run.

        Raises:
            ValueError: names the key that conflicts and the fix.
        """
        fraction, op = self.data.on_policy_fraction, self.trainer.on_policy
        if op.fraction not in (0.0, fraction):
            raise ValueError(
                f"trainer.on_policy.fraction={op.fraction:g} but data.on_policy_fraction="
                f"{fraction:g}; set data.on_policy_fraction only (the run sets the trainer's)"
            )
        op.fraction = fraction
        if not op.enabled:
            return
        self.trainer.check_on_policy(
            {
                "fraction": "data.on_policy_fraction",
                "loss.mode": "trainer.loss.mode",
                "ordered": "data.ordered",
                "max_steps": "trainer.max_steps",
            }
        )
        r = self.rollout
        if self.trainers > 1 and self.trainer.parallel == "fsdp":
            raise ValueError(
                f"data.on_policy_fraction={fraction:g} with trainer.parallel=fsdp: the rollout "
                "workers need the whole student, which no FSDP rank holds; use parallel ddp, "
                "or fraction 0"
            )
        if self.rollouts < 1:
            raise ValueError(f"rollouts={self.rollouts}: must be >= 1 with on-policy samples")
        if r.prompt_tokens + r.max_new_tokens > self.ctx_student:
            raise ValueError(
                f"rollout.prompt_tokens={r.prompt_tokens} + rollout.max_new_tokens="
                f"{r.max_new_tokens} > ctx_student={self.ctx_student}: an on-policy sample must "
                "fit the student's context; lower them or raise ctx_student"
            )
        gpu_weights = op.weights == "cuda_ipc" or (
            op.weights == "auto" and str(self.trainer.device).startswith("cuda")
        )
        if gpu_weights and not str(r.device).startswith("cuda"):
            raise ValueError(
                f"rollout.device={r.device!r} cannot map the trainer's weights on its GPU "
                "(cuda_ipc): put the rollout workers on a GPU (rollout.device: cuda), or set "
                "trainer.on_policy.weights: file"
            )

    @property
    def process_count(self) -> int:
        """Processes the run starts: its queue (unless external), the collator's workers (none
        when every sample is on-policy), a teacher per group (when the loss uses one), a
        trainer per rank and the rollout workers (with on-policy samples)."""
        teachers = self.teachers if self.trainer.loss.uses_teacher else 0
        own_queue = 0 if self.queue.address else 1
        rollouts = self.rollouts if self.on_policy else 0
        collators = 0 if self.data.on_policy_fraction == 1.0 else self.collator.workers
        return own_queue + collators + teachers + self.trainers + rollouts

    def devices(self) -> list[tuple[str, str]]:
        """``(key, device)`` of each kind of process that runs a model: the trainer, the teacher
        when the loss uses one, the rollout workers with on-policy samples."""
        out = [("trainer.device", str(self.trainer.device))]
        if self.trainer.loss.uses_teacher:
            out.append(("teacher.device", str(self.teacher.device)))
        if self.on_policy:
            out.append(("rollout.device", str(self.rollout.device)))
        return out

    @property
    def on_policy(self) -> bool:
        """Part of each step is sampled by the student (rollout workers run)."""
        return self.data.on_policy_fraction > 0


def _check_tree(config: object, prefix: str = "") -> None:
    """Every float of a config tree is finite (``1e999`` reads as inf) and every context length
    is at most :data:`MAX_CONTEXT`: a value no process could use is refused at submit time.

    Raises:
        ValueError: names the dotted key, its value and the bound.
    """
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_tree(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}={value}: must be a finite number")
        elif isinstance(value, int) and ("ctx" in f.name or f.name == "max_length"):
            if value > MAX_CONTEXT:
                raise ValueError(f"{key}={value}: at most {MAX_CONTEXT} tokens per text")


def load_run_config(path: str | os.PathLike, overrides: Iterable[Override] = ()) -> RunConfig:
    """Read and validate a run config file (YAML or JSON), with ``--set`` overrides applied
    before the validation (an override is checked exactly like the file).

    Args:
        path: the config file.
        overrides: parsed ``--set KEY=VALUE`` arguments (a later one wins).

    Raises:
        ConfigError: unknown keys, wrong types, impossible combinations (with the key's path).
    """
    return run_config_from_dict(apply_overrides(cfgmod.load_file(path), overrides))


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a run config given as a mapping (the trainer's projection may be left empty:
    the run builds it).

    Raises:
        ConfigError: as :func:`services.common.config.from_dict`.
    """
    return cfgmod.from_dict(RunConfig, data)
