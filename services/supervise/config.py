"""The run config: one typed config of a whole distillation run (``xtoken run CONFIG.yaml``).

Its top-level keys are the run's own (processes, restarts, heartbeats) and the settings several
processes share (:class:`~services.common.context.Shared`: the queue partition, tokenizers,
context lengths, packing, run directory); each process's section is that process's own config
class (``queue``, ``collator``, ``teacher``, ``trainer``, ``rollout``) and ``data`` the
collator's corpus with the run's held-out corpus and sample mix. A section's fields that the
run sets (marked ``context`` or ``derived``) are no keys of a run config: a value given there
is refused, naming the key to set instead. :mod:`services.supervise.plan` writes every process
only its own section and the shared context.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any, ClassVar, Literal

from services.collator.config import CollatorConfig, CorpusConfig
from services.common import config as cfgmod
from services.common.context import Shared
from services.common.overrides import Override, apply_overrides
from services.queue.config import ServerConfig
from services.rollout.config import RolloutConfig
from services.supervise.teachers import (
    RunExtraTeacherConfig,
    RunTeacher,
    RunTeacherConfig,
    check_extra_teachers,
    check_gpus,
    check_resources,
    entry_mapping,
    extra_teacher_entry,
    gpus_field,
    resources_field,
    teacher_list,
)
from services.trainer.config import TrainerConfig
from services.trainer.sections import ExtraTeacherLinkConfig

# the longest context a run may ask for (tokens per text); beyond it no model here fits
MAX_CONTEXT = 1 << 20
# the largest queue a run may ask for
MAX_QUEUE_BYTES = 1 << 50


def check_finite(obj: object, *names: str) -> None:
    """Every named float field of ``obj`` is a finite number (``1e999`` reads as inf).

    Raises:
        ValueError: names the field, its value and the fix.
    """
    for name in names:
        value = getattr(obj, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name}={value}: must be a finite number")


def _with_default(cls: type, name: str, default: Any, shown: str | None = None) -> Any:
    """The field ``name`` of ``cls`` with another default (its metadata kept)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    metadata = dict(f.metadata)
    if shown is not None:
        metadata["default_text"] = shown
    return field(default=default, metadata=metadata)


@dataclasses.dataclass
class DataConfig(CorpusConfig):
    """The training corpus (the collator's, and the rollouts' prompts unless they name their
    own), the held-out corpus, and where each step's samples come from."""

    heldout: str | None = field(
        default=None,
        metadata={
            "help": "held-out corpus for bits/byte; None: the last trainer.eval.texts texts of "
            "data.train (not trained on), or the demo's with the demo corpus",
            "path": "file",
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

    teacher_cache: str | list[str | None] | None = field(
        default=None,
        metadata={
            "help": "a teacher cache folder (xtoken cache build) to train from instead of "
            "running the teacher: no teacher process starts, each sample carries its cached "
            "top-K targets; a list gives one per teacher (teacher, then extra_teachers), null "
            "for a teacher that stays live",
            "path": "file",
            "trained": True,
        },
    )
    teacher_cache_missing: Literal["error", "online"] = field(
        default="error",
        metadata={
            "help": "a corpus sample the teacher cache lacks: error (refused before the run "
            "starts, naming how many and their builder shards); online (the run also starts "
            "that teacher's groups, which the trainer asks for the samples the cache lacks)",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.on_policy_fraction) and 0 <= self.on_policy_fraction <= 1):
            raise ValueError(f"on_policy_fraction={self.on_policy_fraction}: must be in [0, 1]")
        caches = self.teacher_cache if isinstance(self.teacher_cache, list) else []
        if caches and all(c is None for c in caches):
            self.teacher_cache = None


@dataclasses.dataclass
class QueueConfig(ServerConfig):
    """The run's transfer queue: the settings of its own server (started with the run), or the
    address of an external one."""

    capacity_bytes: int = _with_default(ServerConfig, "capacity_bytes", 4 << 30, "4GiB")
    address: str | None = field(
        default=None,
        metadata={
            "help": "address of a running queue server (tcp://host:port or ipc://path) the run "
            "uses instead of starting its own; its partitions there are prefixed with the run id",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity_bytes > MAX_QUEUE_BYTES:
            raise ValueError(
                f"capacity_bytes={self.capacity_bytes}: at most {MAX_QUEUE_BYTES} bytes (1PiB)"
            )
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
class RunCollatorConfig(CollatorConfig):
    """The collator section of a run config: a :class:`CollatorConfig` that puts smaller batches
    by default (the run's first steps wait for them)."""

    batch: int = _with_default(CollatorConfig, "batch", 16)


@dataclasses.dataclass
class RunRolloutConfig(RolloutConfig):
    """The rollout section of a run config: the run checks that a sample fits ``ctx_student``
    (the rollouts' context length comes from the run's)."""

    def check_fits(self) -> None:
        """Checked by the run (:meth:`RunConfig.check_on_policy`) against its ``ctx_student``."""


@dataclasses.dataclass
class RunTrainerConfig(TrainerConfig):
    """The trainer section of a run config: a :class:`TrainerConfig` whose ``loss.projection``
    may be left empty when the loss needs one; the run then builds it (or finds it in the cache),
    and the plan checks the trainer's section again with that file. Its on-policy settings are
    checked by the run, with the run's keys (the fraction is ``data.on_policy_fraction``)."""

    gpus: list[int] | None = gpus_field("GPU of each trainer rank: rank r on gpus[r] (null: GPU r)")

    resources: dict[str, float] | None = resources_field("trainer")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gpus("gpus", self.gpus)
        check_resources("resources", self.resources)

    def check_projection(self) -> None:
        """A projection left empty is the run's to build (:attr:`projection_to_build`)."""

    def check_on_policy(self, names: dict[str, str] | None = None) -> None:
        """Checked by the run (:meth:`RunConfig.check_on_policy`), naming the run's keys."""
        if names is not None:
            super().check_on_policy(names)

    def check_deterministic(self) -> None:
        """Checked by the run, against ``data.ordered`` (the trainer's ``feed.ordered`` is set
        from it)."""

    @property
    def projection_to_build(self) -> bool:
        """The loss needs a projection and the config names none: the run builds it."""
        return self.loss.uses_teacher and not self.loss.projection


@dataclasses.dataclass
class RunConfig(Shared):
    """A whole distillation run (``xtoken run CONFIG.yaml``)."""

    #: keys of older run configs under their new names (services.common.config)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "queue_capacity": "queue.capacity_bytes",
        "collator.pack": "pack",
        "collator.kd_where_agrees": "kd_where_agrees",
    }

    projection_top_k: int = field(
        default=8,
        metadata={"help": "slots per row of a projection built for the run", "trained": True},
    )
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
    queue: QueueConfig = field(default_factory=QueueConfig)
    collator: RunCollatorConfig = field(default_factory=RunCollatorConfig)
    teacher: RunTeacherConfig = field(default_factory=RunTeacherConfig)
    extra_teachers: list[RunExtraTeacherConfig] = field(
        default_factory=list,
        metadata={
            "help": "further teachers (teacher 1, 2, ...), each of a tokenizer family of its "
            "own: its tokenizer and model (required), weight, projection and groups; every "
            "other key not given takes the teacher section's value",
            "trained": True,
        },
    )
    trainer: RunTrainerConfig = field(default_factory=RunTrainerConfig)
    rollout: RunRolloutConfig = field(default_factory=RunRolloutConfig)

    def __post_init__(self) -> None:
        # a section given as its process's own class (``teacher=TeacherConfig(...)``, the
        # library's way) becomes the run's class of it, the run's keys at their defaults
        for name, cls in (
            ("collator", RunCollatorConfig),
            ("teacher", RunTeacherConfig),
            ("trainer", RunTrainerConfig),
            ("rollout", RunRolloutConfig),
        ):
            section = getattr(self, name)
            if not isinstance(section, cls):
                setattr(self, name, cfgmod.from_dict(cls, cfgmod.to_dict(section)))
        # an entry given as a mapping takes the teacher section's keys it does not give
        self.extra_teachers = [
            e
            if isinstance(e, RunExtraTeacherConfig)
            else cfgmod.from_dict(
                RunExtraTeacherConfig,
                extra_teacher_entry(self.teacher, entry_mapping(e, i), f"extra_teachers[{i}]"),
                path=f"extra_teachers[{i}]",
            )
            for i, e in enumerate(self.extra_teachers)
        ]
        for name in ("ctx_student", "ctx_teacher", "teachers", "trainers", "projection_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("ctx_student", "ctx_teacher"):
            if getattr(self, name) > MAX_CONTEXT:
                raise ValueError(
                    f"{name}={getattr(self, name)}: at most {MAX_CONTEXT} tokens per text"
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
            if t.max_batch < tr.feed.micro_batch:
                raise ValueError(
                    f"teacher.max_batch={t.max_batch} < trainer.feed.micro_batch="
                    f"{tr.feed.micro_batch}: a micro-batch must fit one teacher slot; raise "
                    "teacher.max_batch"
                )
            if t.max_length < self.ctx_teacher:
                raise ValueError(
                    f"teacher.max_length={t.max_length} < ctx_teacher={self.ctx_teacher}: raise "
                    "teacher.max_length to at least ctx_teacher"
                )
        if self.teachers_apart and t.transport in ("shm", "cuda_ipc"):
            raise ValueError(
                f"teacher.transport={t.transport}: a ring cannot reach trainer ranks on other "
                "nodes (teacher.resources differ from trainer.resources); use teacher.transport "
                "auto, topk or hidden"
            )
        check_extra_teachers(self)
        self.check_teacher_cache()
        if tr.compute.deterministic and not self.data.ordered:
            raise ValueError(
                "trainer.compute.deterministic needs data.ordered: true and collator.workers: 1 "
                "(otherwise which samples share a micro-batch depends on timing); set both, or "
                "trainer.compute.deterministic: false"
            )
        if self.data.ordered and self.collator.workers > 1:
            raise ValueError(
                f"data.ordered needs one collator worker (collator.workers="
                f"{self.collator.workers}): several put in the order they finish; set "
                "collator.workers: 1, or data.ordered: false"
            )
        if self.teachers > self.trainers:
            raise ValueError(
                f"teachers={self.teachers} > trainers={self.trainers}: a teacher group serves "
                "ranks r with r % teachers == group, so extra teachers would idle"
            )
        self.check_on_policy()
        if not self.trainer.eval.texts and self.data.heldout is not None:
            raise ValueError(
                f"data.heldout={self.data.heldout!r} names a held-out corpus, but "
                "trainer.eval.texts: 0 turns the held-out eval off; drop one of them"
            )
        if self.mps and not any(d.startswith("cuda") for _, d in self.devices()):
            raise ValueError(
                "mps: true but no process of the run is on a CUDA device ("
                + ", ".join(f"{k}={d}" for k, d in self.devices())
                + "): set mps: false, or put them on cuda"
            )

    def teacher_list(self) -> list[RunTeacher]:
        """Every teacher of the run in the loss's order (:func:`teacher_list`)."""
        return teacher_list(self)

    def check_teacher_cache(self) -> None:
        """``data.teacher_cache`` fits the run: one entry per teacher, a loss that reads
        teachers, unpacked samples (the cache is keyed by text), no on-policy samples (their
        continuations need a live teacher). Its fingerprint and the samples it holds are checked
        by the pre-flight (``services.cache.check``).

        Raises:
            ValueError: names the key that conflicts and the fix.
        """
        cached = [v.key for v in self.teacher_list() if v.cache is not None]
        if not cached:
            return
        given = f"data.teacher_cache serves {', '.join(cached)}"
        if not self.trainer.loss.uses_teacher:
            raise ValueError(
                f"{given}, but trainer.loss.mode={self.trainer.loss.mode} reads no teacher: "
                "remove data.teacher_cache"
            )
        if self.pack:
            raise ValueError(
                f"{given}: a cache holds the targets of each text, and pack: true joins texts "
                "into rows; set pack: false"
            )
        if self.on_policy:
            raise ValueError(
                f"{given}: on-policy samples (data.on_policy_fraction="
                f"{self.data.on_policy_fraction:g}) need a live teacher to score them; set "
                "data.on_policy_fraction: 0, or leave that teacher's entry null"
            )

    def check_on_policy(self) -> None:
        """The trainer can take ``data.on_policy_fraction`` of its steps from rollout workers,
        and the rollout workers fit the run.

        Raises:
            ValueError: names the key that conflicts and the fix.
        """
        fraction = self.data.on_policy_fraction
        tr = self.trainer
        if not fraction:
            if tr.on_policy.start_step:
                raise ValueError(
                    f"trainer.on_policy.start_step={tr.on_policy.start_step} with "
                    "data.on_policy_fraction=0: there is no on-policy share to start; set the "
                    "fraction above 0, or delete start_step"
                )
            return
        # the trainer as the run hands it its fraction, order and further teachers (checked,
        # not kept)
        on_policy = dataclasses.replace(tr.on_policy, fraction=fraction)
        feed = dataclasses.replace(tr.feed, ordered=self.data.ordered)
        extra = [ExtraTeacherLinkConfig(tokenizer=e.tokenizer) for e in self.extra_teachers]
        dataclasses.replace(
            tr, on_policy=on_policy, feed=feed, extra_teachers=extra
        ).check_on_policy(
            {
                "fraction": "data.on_policy_fraction",
                "loss.mode": "trainer.loss.mode",
                "ordered": "data.ordered",
                "max_steps": "trainer.schedule.max_steps",
                "start_step": "trainer.on_policy.start_step",
            }
        )
        r = self.rollout
        if self.trainers > 1 and tr.compute.parallel == "fsdp":
            raise ValueError(
                f"data.on_policy_fraction={fraction:g} with trainer.compute.parallel=fsdp: the "
                "rollout workers need the whole student, which no FSDP rank holds; use parallel "
                "ddp, or fraction 0"
            )
        if self.rollouts < 1:
            raise ValueError(f"rollouts={self.rollouts}: must be >= 1 with on-policy samples")
        if r.prompt_tokens + r.max_new_tokens > self.ctx_student:
            raise ValueError(
                f"rollout.prompt_tokens={r.prompt_tokens} + rollout.max_new_tokens="
                f"{r.max_new_tokens} > ctx_student={self.ctx_student}: an on-policy sample must "
                "fit the student's context; lower them or raise ctx_student"
            )
        weights = tr.on_policy.weights
        gpu_weights = weights == "cuda_ipc" or (
            weights == "auto" and str(tr.compute.device).startswith("cuda")
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
        when every sample is on-policy), a teacher per group (when the loss uses one; none for a
        teacher a cache serves alone), a trainer per rank and the rollout workers (with on-policy
        samples)."""
        uses = self.trainer.loss.uses_teacher
        teachers = sum(t.groups for t in self.teacher_list() if t.live) if uses else 0
        own_queue = 0 if self.queue.address else 1
        rollouts = self.rollouts if self.on_policy else 0
        collators = 0 if self.data.on_policy_fraction == 1.0 else self.collator.workers
        return own_queue + collators + teachers + self.trainers + rollouts

    def devices(self) -> list[tuple[str, str]]:
        """``(key, device)`` of each kind of process that runs a model: the trainer, each live
        teacher when the loss uses one, the rollout workers with on-policy samples."""
        out = [("trainer.compute.device", str(self.trainer.compute.device))]
        if self.trainer.loss.uses_teacher:
            out += [
                (f"{t.key}.device", str(t.section.device)) for t in self.teacher_list() if t.live
            ]
        if self.on_policy:
            out.append(("rollout.device", str(self.rollout.device)))
        return out

    @property
    def teachers_apart(self) -> bool:
        """The teacher groups and the trainer ranks ask for different Ray resources: they are
        placed apart (other nodes), not pinned together, and the logits cannot take a ring."""
        return self.apart(self.teacher)

    def apart(self, teacher: RunTeacherConfig) -> bool:
        """The groups of ``teacher`` (the teacher section or an entry of ``extra_teachers``) and
        the trainer ranks ask for different Ray resources (:attr:`teachers_apart`)."""
        uses = self.trainer.loss.uses_teacher
        return uses and (teacher.resources or {}) != (self.trainer.resources or {})

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
        elif isinstance(value, list) and all(dataclasses.is_dataclass(v) for v in value):
            for i, v in enumerate(value):
                _check_tree(v, f"{key}[{i}].")
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


def run_config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Validate a run config given as a mapping (the trainer's projection may be left empty:
    the run builds it).

    Raises:
        ConfigError: as :func:`services.common.config.from_dict`, or a key of a section that
            the run sets (marked ``context`` or ``derived``; names the key to set instead).
    """
    for key, shared in cfgmod.marks(RunConfig, "context").items():
        if cfgmod.has_key(data, key):
            raise cfgmod.ConfigError(_set_by_context(key, shared))
    derived = cfgmod.marks(RunConfig, "derived")
    for key, source in derived.items():
        if cfgmod.has_key(data, key) and not is_run_key(source):
            raise cfgmod.ConfigError(f"{key} is set by the run ({source}); remove it")
    extra = data.get("extra_teachers")
    if isinstance(extra, list | tuple):
        data = {
            **data,
            "extra_teachers": [
                extra_teacher_entry(data.get("teacher"), e, f"extra_teachers[{i}]")
                if isinstance(e, Mapping)
                else e
                for i, e in enumerate(extra)
            ],
        }
    config = cfgmod.from_dict(RunConfig, data)
    for key, source in derived.items():
        if not (is_run_key(source) and cfgmod.has_key(data, key)):
            continue
        value, wanted = value_at(config, key), value_at(config, source)
        if dataclasses.is_dataclass(value):
            raise cfgmod.ConfigError(f"{key} is set by the run from {source}; set {source} only")
        if value != wanted:
            raise cfgmod.ConfigError(
                f"{key}={value!r} but {source}={wanted!r}; set {source} only (the run sets "
                f"{key} from it)"
            )
    return config


def run_config_to_dict(config: RunConfig) -> dict[str, Any]:
    """The JSON form of a run config as :func:`run_config_from_dict` reads it back: its own keys,
    without the fields of its sections that the run sets (marked ``context`` or ``derived``),
    every key of each ``extra_teachers`` entry given."""
    out = cfgmod.section(config, without=("context", "derived"))
    out["extra_teachers"] = [
        cfgmod.section(e, without=("context", "derived")) for e in config.extra_teachers
    ]
    return out


def value_at(config: Any, key: str) -> Any:
    """The value of a dotted key of a config (``trainer.optim.lr``)."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def is_run_key(source: str | None) -> bool:
    """A ``derived`` mark names a key of the run config, a setting or a section (else it says
    in words what the run makes the value of)."""
    keys = cfgmod.leaf_paths(RunConfig)
    return source is not None and any(k == source or k.startswith(f"{source}.") for k in keys)


def _set_by_context(key: str, shared: str) -> str:
    if shared == "queue":
        return (
            f"{key} is set by the run: its queue's address (queue.address, or the queue it "
            "starts); remove it"
        )
    return f"{key} is set by the run from {shared}; set {shared} only"
