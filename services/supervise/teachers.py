"""The teachers of a run config: the ``teacher`` section (teacher 0), the ``extra_teachers``
entries (teachers 1, 2, ..., each of a tokenizer family of its own, whose keys not given take the
``teacher`` section's values), and :class:`RunTeacher`, the view of each teacher that the plan,
the layout and the pre-flight iterate. Also the GPU and Ray-resource keys of a run's sections.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from services.common import config as cfgmod
from services.teacher.config import TeacherConfig, teacher_name

__all__ = [
    "EXTRA_OWN_KEYS",
    "RunExtraTeacherConfig",
    "RunTeacher",
    "RunTeacherConfig",
    "check_extra_teachers",
    "extra_teacher_entry",
    "teacher_caches",
    "teacher_list",
]


def gpus_field(help_text: str) -> Any:
    """A section's ``gpus`` key (not trained; null: the default placement)."""
    return field(default=None, metadata={"help": help_text, "trained": False})


def check_gpus(key: str, gpus: list[int] | None) -> None:
    """``gpus`` names GPU indices >= 0, or is null."""
    if gpus is not None and (not gpus or any(g < 0 for g in gpus)):
        raise ValueError(f"{key}={gpus}: name GPU indices >= 0, or null for the default")


def resources_field(role: str) -> Any:
    """A section's ``resources`` key: the Ray resources each ``role`` process asks for."""
    return field(
        default=None,
        metadata={
            "help": f"Ray resources each {role} process asks for beside its GPU (e.g. "
            "{node_a: 1}); teachers and trainers that ask for different ones are placed apart "
            "(on other nodes) and talk through the queue",
            "trained": False,
        },
    )


def check_resources(key: str, resources: dict[str, float] | None) -> None:
    """Every resource amount is a finite number > 0."""
    for name, amount in (resources or {}).items():
        if not (math.isfinite(amount) and amount > 0):
            raise ValueError(f"{key}.{name}={amount}: a resource amount must be > 0")


@dataclasses.dataclass
class RunTeacherConfig(TeacherConfig):
    """The teacher section of a run config: a :class:`TeacherConfig` and the GPUs its groups
    run on (services/supervise/layout.py)."""

    gpus: list[int] | None = gpus_field(
        "GPUs of the teacher groups: group g takes gpus[g*k:(g+1)*k], k = tensor_parallel "
        "(null: GPUs g*k.. modulo the GPUs there)"
    )

    resources: dict[str, float] | None = resources_field("teacher")
    weight: float = field(
        default=1.0,
        metadata={
            "help": "weight of this teacher's KD term in the loss: the loss sums the teachers' "
            "terms, each over its own valid chunks, times its weight",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        auto = self.transport == "auto"
        super().__post_init__()  # checks the transport auto stands for on one node
        if auto:  # the plan decides, where it knows the placement (teachers_apart)
            self.transport = "auto"
        check_gpus("gpus", self.gpus)
        check_resources("resources", self.resources)
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight={self.weight}: must be a finite number >= 0")


# The keys of an extra_teachers entry that are its own: never taken from the teacher section.
EXTRA_OWN_KEYS = ("tokenizer", "model", "weight", "projection", "groups")


@dataclasses.dataclass
class RunExtraTeacherConfig(RunTeacherConfig):
    """A further teacher of a run (teacher j >= 1: the entry ``extra_teachers[j-1]``), of a
    tokenizer family of its own: its tokenizer, model, weight, projection and groups, and every
    other key of the teacher section, which it takes from the ``teacher`` section where it does
    not give it (:func:`extra_teacher_entry`)."""

    tokenizer: str | None = field(  # type: ignore[assignment]
        default=None,
        metadata={
            "help": "this teacher's tokenizer, a name or a path (required)",
            "path": "tokenizer",
            "trained": True,
        },
    )
    model: str | None = field(  # type: ignore[assignment]
        default=None,
        metadata={
            "help": "this teacher's model: a local HF directory, a preset name, or smollm2 "
            "(required)",
            "path": "model",
            "trained": True,
        },
    )
    projection: str | None = field(
        default=None,
        metadata={
            "help": "projection file from student_tokenizer to this teacher's tokenizer (`xtoken "
            "projection build`); null: the run builds it (cached like teacher 0's)",
            "path": "file",
            "trained": False,
        },
    )
    groups: int | None = field(
        default=None,
        metadata={
            "help": "groups (processes, or tensor-parallel units) of this teacher; trainer rank r "
            "asks group r % groups; null: teachers",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        for name in ("tokenizer", "model"):
            if not getattr(self, name):
                raise ValueError(
                    f"{name} is required: this teacher's {name}, a name or a path (the teacher "
                    f"section's {name} is teacher 0's)"
                )
        super().__post_init__()
        if self.groups is not None and self.groups < 1:
            raise ValueError(f"groups={self.groups}: must be >= 1, or null for teachers")


def _run_set_keys(cls: type) -> dict[str, str]:
    """The fields of a teacher section that the run sets (marked ``context`` or ``derived``),
    each with the message's ending: what to set instead."""
    out = {}
    for key, shared in cfgmod.marks(cls, "context").items():
        out[key] = f"set by the run from {shared}; set {shared} only"
    for key, source in cfgmod.marks(cls, "derived").items():
        out[key] = f"set by the run ({source}); remove it"
    return {k: v for k, v in out.items() if "." not in k}


def extra_teacher_entry(teacher: Any, entry: Mapping[str, Any], key: str) -> dict[str, Any]:
    """An ``extra_teachers`` entry as a mapping, with the teacher section's value of every key it
    does not give (but its own keys, :data:`EXTRA_OWN_KEYS`).

    Args:
        teacher: the teacher section: a mapping of its keys, or a teacher config.
        entry: the entry's own keys.
        key: the entry's key (``extra_teachers[0]``), for messages.

    Raises:
        ConfigError: the entry sets a key the run sets (names it and what to set instead).
    """
    run_set = _run_set_keys(RunExtraTeacherConfig)
    for name in entry:
        if name in run_set:
            raise cfgmod.ConfigError(f"{key}.{name} is {run_set[name]}")
    if dataclasses.is_dataclass(teacher) and not isinstance(teacher, type):
        teacher = cfgmod.to_dict(teacher)
    if not isinstance(teacher, Mapping):
        teacher = {}
    taken = {k: v for k, v in teacher.items() if k not in EXTRA_OWN_KEYS and k not in run_set}
    return {**taken, **entry}


@dataclasses.dataclass(frozen=True)
class RunTeacher:
    """One teacher of a run as the plan, the layout and the pre-flight see it.

    Attributes:
        index: its place in the loss's list (0: the ``teacher`` section).
        key: the key of its section (``teacher``, ``extra_teachers[0]``), for messages.
        section: its settings.
        tokenizer: its tokenizer (``teacher_tokenizer`` for teacher 0).
        tokenizer_key: the key that sets it.
        groups: its groups (``teachers`` for teacher 0, an entry's ``groups`` or ``teachers``).
        projection: its projection file as the config names it (None: the run builds it).
        projection_key: the key that sets it.
        cache: its teacher cache folder (its entry of ``data.teacher_cache``), or None: its
            groups run as processes.
        online: a cache serves it and its groups run too, for the samples the cache lacks
            (``data.teacher_cache_missing: online``).
    """

    index: int
    key: str
    section: RunTeacherConfig
    tokenizer: str
    tokenizer_key: str
    groups: int
    projection: str | None
    projection_key: str
    cache: str | None = None
    online: bool = False

    @property
    def live(self) -> bool:
        """Its groups run as processes: no teacher cache serves it, or one does and they serve
        the samples it lacks (:attr:`online`)."""
        return self.cache is None or self.online

    def name(self, group: int) -> str:
        """The process name of its group ``group`` (``teacher0``, ``t1.teacher0``)."""
        return teacher_name(self.index, group)


def entry_mapping(entry: Any, i: int) -> Mapping[str, Any]:
    """An ``extra_teachers`` entry given in code: a mapping of its keys (or a teacher config,
    whose keys are all given)."""
    if isinstance(entry, Mapping):
        return entry
    if dataclasses.is_dataclass(entry) and not isinstance(entry, type):
        return cfgmod.section(entry, without=("context", "derived"))
    raise cfgmod.ConfigError(
        f"extra_teachers[{i}]: expected a mapping of teacher settings, got {entry!r}"
    )


def teacher_list(config: Any) -> list[RunTeacher]:
    """Every teacher of a run config in the loss's order: teacher 0 (the ``teacher`` section),
    then one per entry of ``extra_teachers``."""
    caches = teacher_caches(config.data.teacher_cache, 1 + len(config.extra_teachers))
    online = config.data.teacher_cache_missing == "online"
    out = [
        RunTeacher(
            0, "teacher", config.teacher, config.teacher_tokenizer, "teacher_tokenizer",
            config.teachers, config.trainer.loss.projection, "trainer.loss.projection",
            caches[0], online and caches[0] is not None,
        )
    ]  # fmt: skip
    for i, e in enumerate(config.extra_teachers):
        key = f"extra_teachers[{i}]"
        out.append(
            RunTeacher(
                i + 1, key, e, str(e.tokenizer), f"{key}.tokenizer",
                e.groups or config.teachers, e.projection, f"{key}.projection", caches[i + 1],
                online and caches[i + 1] is not None,
            )
        )  # fmt: skip
    return out


def teacher_caches(value: str | list[str | None] | None, n: int) -> list[str | None]:
    """``data.teacher_cache`` as one entry per teacher (None: the teacher stays live).

    Args:
        value: a folder (teacher 0's cache), a list of one entry per teacher, or None.
        n: the run's teachers (``teacher`` and each ``extra_teachers`` entry).

    Raises:
        ValueError: a list whose length is not ``n`` (names both and the fix).
    """
    if value is None:
        return [None] * n
    if isinstance(value, str):
        return [value] + [None] * (n - 1)
    if len(value) != n:
        raise ValueError(
            f"data.teacher_cache has {len(value)} entries for {n} teacher(s) (teacher, then "
            "each of extra_teachers): give one per teacher, null for a teacher that stays live"
        )
    return [v or None for v in value]


def check_extra_teachers(config: Any) -> None:
    """Each further teacher of a run config fits the run as teacher 0 must, and is no second
    copy of another teacher.

    Raises:
        ValueError: names the entry's key and the fix.
    """
    tr = config.trainer
    seen = {
        (config.teacher_tokenizer, config.teacher.model): "teacher 0's (teacher_tokenizer, "
        "teacher.model)"
    }
    for view in teacher_list(config)[1:]:
        e, key = view.section, view.key
        if view.groups > config.trainers:
            raise ValueError(
                f"{key}.groups={view.groups} > trainers={config.trainers}: a group serves the "
                "ranks r with r % groups == group, so the others would idle"
            )
        if tr.loss.uses_teacher:
            if e.max_batch < tr.feed.micro_batch:
                raise ValueError(
                    f"{key}.max_batch={e.max_batch} < trainer.feed.micro_batch="
                    f"{tr.feed.micro_batch}: a micro-batch must fit one teacher slot; raise "
                    f"{key}.max_batch"
                )
            if e.max_length < config.ctx_teacher:
                raise ValueError(
                    f"{key}.max_length={e.max_length} < ctx_teacher={config.ctx_teacher}: raise "
                    f"{key}.max_length to at least ctx_teacher"
                )
        if config.apart(e) and e.transport in ("shm", "cuda_ipc"):
            raise ValueError(
                f"{key}.transport={e.transport}: a ring cannot reach trainer ranks on other "
                f"nodes ({key}.resources differ from trainer.resources); use {key}.transport "
                "auto, topk or hidden"
            )
        same = seen.get((view.tokenizer, e.model))
        if same is not None:
            raise ValueError(
                f"{key}: tokenizer {view.tokenizer!r} and model {e.model!r} are {same}: one "
                "teacher twice adds nothing; drop the entry and raise that teacher's weight "
                "instead"
            )
        seen[view.tokenizer, e.model] = f"those of {key}"
