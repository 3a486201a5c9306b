"""Settings of a trainer process (the ``trainer`` section of a run config), nested per concern."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import ClassVar

from services.trainer.sections import (
    ComputeConfig,
    EvalConfig,
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
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: CrossTokenizerLossConfig = field(default_factory=CrossTokenizerLossConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def __post_init__(self) -> None:
        self.check_projection()
        if isinstance(self.loss.projection, list | tuple) or self.loss.num_teachers != 1:
            raise ValueError(
                f"loss.projection={self.loss.projection!r}, loss.teacher_weights="
                f"{list(self.loss.teacher_weights)}: a trainer distills one teacher; give one "
                "projection file and at most one weight"
            )
        if self.on_policy.enabled:
            self.check_on_policy()
        if self.loss.teacher_vocab_size != (None,):
            raise ValueError(
                f"loss.teacher_vocab_size={self.loss.teacher_vocab_size[0]}: the trainer sets it "
                "from the teacher (teacher.vocab_size, else its tokenizer's vocab); "
                "delete the key"
            )

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
            **(names or {}),
        }
        fraction = f"{keys['fraction']}={self.on_policy.fraction:g}"
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
        if self.on_policy.fraction == 1.0 and not self.schedule.max_steps:
            raise ValueError(
                f"{fraction} with {keys['max_steps']}=0: every sample comes from the rollout "
                f"workers, which never run out; set {keys['max_steps']}"
            )

    def check_projection(self) -> None:
        """A loss that compares with a teacher names its projection file.

        Raises:
            ValueError: a teacher's loss mode without ``loss.projection`` (names the fix).
        """
        if self.loss.uses_teacher and not self.loss.projection:
            raise ValueError(
                f"loss.mode={self.loss.mode} needs loss.projection (a file from `xtoken projection "
                "build`); `xtoken run` builds one when the run config leaves it empty"
            )
