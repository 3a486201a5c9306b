"""Settings of a rollout process (the ``rollout`` section of a run config; the flags of
``xtoken rollout`` come from here).

No heavy imports: the CLI builds its parser from this dataclass (``services.common.config``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field

from services.common.context import shared_field

KV_CACHES = ("dynamic", "static")


@dataclasses.dataclass
class RolloutConfig:
    """One rollout worker: a copy of the student that samples continuations of prompts.

    In a run, the queue, the partition, the tokenizers, the context lengths, ``kd_where_agrees``
    and the run directory come from its shared context; the worker's index, the student (the
    trainer's spec, vocab and seed) and the weights directory are the run's (``derived``); the
    prompts default to ``data.train``; a run config's ``rollout`` section sets the rest.
    """

    queue: str = shared_field(
        "queue", default="tcp://127.0.0.1:5555", help="queue server address", trained=False
    )
    partition: str = shared_field(
        "partition", help="the run's sample partition; on-policy samples go to <partition>.rollout"
    )
    worker: int = field(
        default=0,
        metadata={
            "help": "this worker's index: it takes prompt i when i % workers is it",
            "derived": "each rollout worker's index",
            "trained": False,
        },
    )
    workers: int = field(
        default=1,
        metadata={"help": "rollout workers of the run", "derived": "rollouts", "trained": False},
    )
    student: str = field(
        default="student-25m",
        metadata={
            "help": "student model spec (the trainer's): its weights come from the trainer",
            "derived": "trainer.student.model",
            "trained": True,
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "vocab of a preset student (default: its tokenizer's, rounded up to a multiple of 128)",
            "derived": "trainer.student.vocab_size",
            "trained": True,
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seed of the student init and of the sampling",
            "derived": "trainer.student.seed",
            "trained": True,
        },
    )
    student_tokenizer: str = shared_field("student_tokenizer")
    teacher_tokenizer: str = shared_field("teacher_tokenizer")
    ctx_student: int = shared_field("ctx_student", help="student tokens kept per sample")
    ctx_teacher: int = shared_field("ctx_teacher", help="teacher tokens kept per sample")
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N", "trained": False})
    dtype: str = field(
        default="auto",
        metadata={"help": "model dtype: auto (bfloat16 on cuda, else float32)", "trained": False},
    )
    weights: str = field(
        default="runs/default/policy",
        metadata={
            "help": "directory where the trainer publishes the student's weights",
            "derived": "RUN_DIR/policy",
            "trained": False,
        },
    )
    prompts: str | None = field(
        default=None,
        metadata={
            "help": "prompt corpus (.jsonl/.txt/.parquet file, folder or glob); xtoken run: "
            "data.train unless set",
            "path": "file",
            "trained": True,
        },
    )
    limit: int | None = field(
        default=None,
        metadata={"help": "use only the first N texts of the prompt corpus", "trained": True},
    )
    text_field: str = field(
        default="text",
        metadata={"help": "JSON field / parquet column of the texts", "trained": True},
    )
    prompt_field: str | None = field(
        default=None,
        metadata={
            "help": "JSON field / column holding a prompt; None: a prompt is the first "
            "prompt_tokens student tokens of each text",
            "trained": True,
        },
    )
    prompt_tokens: int = field(
        default=32,
        metadata={"help": "most student tokens of a prompt (BOS included)", "trained": True},
    )
    max_new_tokens: int = field(
        default=64, metadata={"help": "most tokens sampled per prompt", "trained": True}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "sampling temperature (0: greedy)", "trained": True}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "nucleus sampling: keep this mass", "trained": True}
    )
    batch: int = field(
        default=8, metadata={"help": "prompts sampled together (one put)", "trained": False}
    )
    kv_cache: str = field(
        default="dynamic",
        metadata={
            "help": "dynamic: the KV cache grows a token per step; static: allocated for batch "
            "x (prompt_tokens + max_new_tokens), every batch filled to that shape (on CUDA "
            "transformers compiles the decoding step once and replays it as CUDA graphs: "
            "3.3x the new tokens/s of dynamic on an H100, after ~13 s more in the first batch)",
            "trained": False,
        },
    )
    kd_where_agrees: str | None = shared_field(
        "kd_where_agrees",
        help="a third tokenizer name or path: KD terms only on chunks whose student tokens are "
        "each also one token of it (as the collators)",
    )
    max_pending: int | None = field(
        default=None,
        metadata={
            "help": "wait while the rollout partition holds this many samples no trainer took "
            "(more would only grow stale); None: two batches (xtoken run: a step of the "
            "trainers' on-policy samples, at least a batch)",
            "trained": False,
        },
    )
    state_dir: str | None = field(
        default=None,
        metadata={
            "help": "keep the position in the prompts here (a restarted worker goes on from "
            "it); None: start from the first prompt",
            "derived": "RUN_DIR/rollout",
            "trained": False,
        },
    )
    run_dir: str | None = shared_field(
        "run_dir",
        default=None,
        help="write metrics under RUN_DIR/metrics (rollout<worker>.jsonl)",
        default_text="no metrics file",
    )
    poll_s: float = field(
        default=0.2,
        metadata={"help": "seconds between two looks for weights or queue room", "trained": False},
    )
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to wait for a queue reply before failing", "trained": False},
    )
    put_timeout_s: float = field(
        default=300.0,
        metadata={"help": "seconds a put may wait for queue capacity", "trained": False},
    )

    def __post_init__(self) -> None:
        for name in ("workers", "ctx_student", "ctx_teacher", "prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch}: must be >= 1")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={self.kv_cache!r}: use one of {', '.join(KV_CACHES)}")
        if self.max_pending is not None and self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending}: must be >= 1, or None")
        if not 0 <= self.worker < self.workers:
            raise ValueError(f"worker={self.worker}: must be in [0, workers={self.workers})")
        self.check_fits()
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1, or null for the whole corpus")
        for name in ("poll_s", "queue_timeout_s", "put_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name}={value}: must be a finite number of seconds > 0")

    def check_fits(self) -> None:
        """A prompt and its continuation fit the student's context.

        Raises:
            ValueError: names the three settings and the fix.
        """
        if self.prompt_tokens + self.max_new_tokens > self.ctx_student:
            raise ValueError(
                f"prompt_tokens={self.prompt_tokens} + max_new_tokens={self.max_new_tokens} > "
                f"ctx_student={self.ctx_student}: a sample would not fit the student's context; "
                "lower one of them or raise ctx_student"
            )

    @property
    def pending_bound(self) -> int:
        """Samples no trainer took above which the worker waits (``max_pending``)."""
        return self.max_pending if self.max_pending is not None else 2 * self.batch
