"""Settings of a trainer process (the ``trainer`` section of a run config), nested per concern."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar

from services.trainer.sections import (
    ComputeConfig,
    EvalConfig,
    ExtraTeacherLinkConfig,
    FeedConfig,
    ObserveConfig,
    OnPolicyConfig,
    OptimConfig,
    ScheduleConfig,
    StudentConfig,
    TeacherLinkConfig,
)
from xtoken_core.losses.config import CrossTokenizerLossConfig


def _moved(section: str, *names: str) -> dict[str, str]:
    return {name: f"{section}.{name}" for name in names}


# the flat keys of earlier trainer configs, each under its section now
_MOVED_KEYS = {
    "student": "student.model",  # a string; a mapping there is the section
    **_moved("student", "vocab_size", "seed", "max_length"),
    **_moved(
        "compute",
        "device",
        "dtype",
        "param_dtype",
        "parallel",
        "compile",
        "cuda_graphs",
        "fused_head",
        "fused_head_rows",
        "fused_update",
        "activation_checkpointing",
        "packed_attention",
        "gc_every",
    ),  # fmt: skip
    **_moved(
        "feed",
        "micro_batch",
        "grad_accum",
        "ordered",
        "lease_s",
        "claim_timeout_s",
        "queue_timeout_s",
        "idle_timeout_s",
    ),  # fmt: skip
    "teacher_model": "teacher.model",
    "teacher_vocab_size": "teacher.vocab_size",
    "teacher_seed": "teacher.seed",
    "teacher_groups": "teacher.groups",
    "teacher_timeout_s": "teacher.timeout_s",
    "teacher_dead_after_s": "teacher.dead_after_s",
    "dead_after_s": "teacher.dead_after_s",
    "verify_logits": "teacher.verify_logits",
    **_moved("schedule", "max_steps", "epochs", "checkpoint_every", "eval_every", "export"),
    "heldout": "eval.heldout",
    "eval_texts": "eval.texts",
    "eval_ctx": "eval.ctx",
    **_moved("observe", "report_to", "profile_steps", "profile_start"),
}


@dataclasses.dataclass
class TrainerConfig:
    """Settings of one trainer rank (rank and world size come from torchrun's environment): the
    run-wide values it shares with the run's other processes (marked ``context``), then one
    section per part of the trainer, each given to the part that reads it and to no other."""

    #: keys of older configs under their new names (services.common.config)
    MOVED_KEYS: ClassVar[dict[str, str]] = _MOVED_KEYS

    queue: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={"help": "queue server address", "context": "queue", "trained": False},
    )
    partition: str = field(
        default="train",
        metadata={"help": "sample partition of the run", "context": "partition", "trained": False},
    )
    student_tokenizer: str = field(
        default="qwen3",
        metadata={
            "help": "student tokenizer",
            "context": "student_tokenizer",
            "path": "tokenizer",
            "trained": True,
        },
    )
    teacher_tokenizer: str = field(
        default="smollm2",
        metadata={
            "help": "teacher tokenizer",
            "context": "teacher_tokenizer",
            "path": "tokenizer",
            "trained": True,
        },
    )
    run_dir: str = field(
        default="runs/default",
        metadata={
            "help": "metrics, checkpoints, export",
            "context": "run_dir",
            "path": "run",
            "trained": False,
        },
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "the samples are packed rows of several documents (as the collators pack "
            "them): positions restart per document, attention stays within a document, and the "
            "start-up step compiles for that",
            "context": "pack",
            "trained": True,
        },
    )
    student: StudentConfig = field(default_factory=StudentConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    feed: FeedConfig = field(default_factory=FeedConfig)
    teacher: TeacherLinkConfig = field(default_factory=TeacherLinkConfig)
    extra_teachers: list[ExtraTeacherLinkConfig] = field(
        default_factory=list,
        metadata={
            "help": "the loss's further teachers (teacher 1, 2, ...), each of a tokenizer family "
            "of its own: its tokenizer, projection and weight, and the link to its groups "
            "(ExtraTeacherLinkConfig); [] distills teacher 0 alone",
            "cli": False,  # a list of sections: set in --config
            "derived": "xtoken run writes one entry per entry of the run's extra_teachers",
            "trained": True,
        },
    )
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: CrossTokenizerLossConfig = field(default_factory=CrossTokenizerLossConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def __post_init__(self) -> None:
        self.check_projection()
        loss = self.loss
        if isinstance(loss.projection, list | tuple):
            raise ValueError(
                f"loss.projection={loss.projection!r}: give teacher 0's projection file alone; "
                "each further teacher is an entry of extra_teachers, with its tokenizer, "
                "projection and weight"
            )
        if loss.teacher_weights != (1.0,):
            raise ValueError(
                f"loss.teacher_weights={list(loss.teacher_weights)}: the trainer sets it from "
                "teacher.weight and each extra_teachers[j].weight; set those and delete the key"
            )
        if self.on_policy.enabled:
            self.check_on_policy()
        self.check_deterministic()
        self.check_length_multiple()
        if loss.teacher_vocab_size != (None,):
            raise ValueError(
                f"loss.teacher_vocab_size={loss.teacher_vocab_size[0]}: the trainer sets it "
                "from each teacher (teacher.vocab_size, else its tokenizer's vocab); "
                "delete the key"
            )

    def teachers(self) -> list[Teacher]:
        """The loss's teachers in order: teacher 0 (``teacher``, ``teacher_tokenizer``,
        ``loss.projection``), then one per entry of ``extra_teachers``."""
        out = [Teacher(0, self.teacher, self.teacher_tokenizer, self.loss.projection, "teacher")]
        for j, extra in enumerate(self.extra_teachers):
            key = f"extra_teachers[{j}]"
            out.append(Teacher(j + 1, extra, extra.tokenizer, extra.projection, key))
        return out

    def check_on_policy(self, names: dict[str, str] | None = None) -> None:
        """On-policy samples need a teacher, unordered claims and an end the data cannot give.

        Args:
            names: the keys to name in a message (a run config's: ``fraction`` ->
                ``data.on_policy_fraction``); default: this section's own.

        Raises:
            ValueError: names the setting that conflicts with ``on_policy.fraction``.
        """
        keys = {
            "fraction": "on_policy.fraction",
            "loss.mode": "loss.mode",
            "ordered": "feed.ordered",
            "max_steps": "schedule.max_steps",
            "start_step": "on_policy.start_step",
            **(names or {}),
        }
        fraction = f"{keys['fraction']}={self.on_policy.fraction:g}"
        if self.extra_teachers:
            raise ValueError(
                f"{fraction} with {len(self.extra_teachers)} extra_teachers: the rollout "
                "workers' samples carry teacher 0's tokens and alignment alone; distill one "
                "teacher on-policy, or set the fraction to 0"
            )
        if not self.loss.uses_teacher:
            raise ValueError(
                f"{fraction} with {keys['loss.mode']}={self.loss.mode}: on-policy distillation "
                "scores the student's samples with the teacher; use a KD mode (pkl, gold, "
                "xtoken) or fraction 0"
            )
        if self.feed.ordered:
            raise ValueError(
                f"{fraction} with {keys['ordered']}: on-policy samples come as the rollout "
                f"workers make them, never in a fixed order; set {keys['ordered']} false or "
                "fraction 0"
            )
        start = self.on_policy.start_step
        if start and self.on_policy.fraction == 1.0:
            raise ValueError(
                f"{keys['start_step']}={start} with {fraction}: the off-policy start reads the "
                "collators' samples, and a fraction of 1 runs no collator; use a fraction "
                "below 1, or start_step 0"
            )
        if start and self.schedule.max_steps and start >= self.schedule.max_steps:
            raise ValueError(
                f"{keys['start_step']}={start} with {keys['max_steps']}="
                f"{self.schedule.max_steps}: the on-policy share would never start; set "
                f"start_step below {keys['max_steps']}"
            )
        if self.on_policy.fraction == 1.0 and not self.schedule.max_steps:
            raise ValueError(
                f"{fraction} with {keys['max_steps']}=0: every sample comes from the rollout "
                f"workers, which never run out; set {keys['max_steps']}"
            )

    def check_deterministic(self) -> None:
        """Bitwise-reproducible steps need the same micro-batches in every run.

        Raises:
            ValueError: ``compute.deterministic`` without ``feed.ordered`` (names the key to set).
        """
        if self.compute.deterministic and not self.feed.ordered:
            raise ValueError(
                "compute.deterministic needs feed.ordered: true (without it a claim takes what is "
                "ready, so which samples share a micro-batch depends on timing); set "
                "feed.ordered: true, or compute.deterministic: false"
            )

    def check_length_multiple(self) -> None:
        """Micro-batch lengths padded to a multiple stay within ``student.max_length``.

        Raises:
            ValueError: ``compute.length_multiple`` does not divide ``student.max_length``.
        """
        multiple, longest = self.compute.length_multiple, self.student.max_length or 128
        if longest % multiple:
            raise ValueError(
                f"compute.length_multiple={multiple} does not divide student.max_length="
                f"{longest}: a micro-batch padded up to it could outgrow the length the start-up "
                "step checks; use a divisor (64 for 512, 4096)"
            )

    def check_projection(self) -> None:
        """A loss that compares with teachers names the projection file of each.

        Raises:
            ValueError: a teacher's loss mode without ``loss.projection``, or with an entry of
                ``extra_teachers`` without its ``projection`` (names the key and the fix).
        """
        if not self.loss.uses_teacher:
            return
        for teacher in self.teachers():
            if teacher.projection:
                continue
            tokenizer = (
                f" for {teacher.tokenizer_key}={teacher.tokenizer!r}" if teacher.index else ""
            )
            raise ValueError(
                f"loss.mode={self.loss.mode} needs {teacher.projection_key} (a file from `xtoken "
                f"projection build`{tokenizer}); `xtoken run` builds one when the run config "
                "leaves it empty"
            )


@dataclasses.dataclass(frozen=True)
class Teacher:
    """One teacher of the trainer's loss, with the key of its settings (named in messages).

    Attributes:
        index: its place in the loss's list (0: the first, ``teacher``).
        link: its link section (``teacher``, or its entry of ``extra_teachers``).
        tokenizer: its tokenizer, a name or a path.
        projection: its projection file (None: none yet).
        key: the key of its link section (``teacher``, ``extra_teachers[0]``).
    """

    index: int
    link: TeacherLinkConfig
    tokenizer: str
    projection: Any
    key: str

    @property
    def tokenizer_key(self) -> str:
        """The key of its tokenizer (``teacher_tokenizer``, ``extra_teachers[0].tokenizer``)."""
        return f"{self.key}.tokenizer" if self.index else "teacher_tokenizer"

    @property
    def projection_key(self) -> str:
        """The key of its projection (``loss.projection``, ``extra_teachers[0].projection``)."""
        return f"{self.key}.projection" if self.index else "loss.projection"
