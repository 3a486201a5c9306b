"""The sections of a trainer's settings (``trainer.<section>`` of a run config): each is given
to the part of the trainer that reads it and to no other (:class:`services.trainer.config.TrainerConfig`
holds them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Literal

# experiment trackers of ``report_to`` (services/trainer/tracking.py)
TRACKERS = ("tensorboard", "wandb")


@dataclasses.dataclass
class OptimConfig:
    """AdamW with linear warmup and a cosine decay to ``min_lr_ratio * lr``."""

    lr: float = field(default=1e-3, metadata={"help": "peak learning rate", "trained": True})
    weight_decay: float = field(
        default=0.01, metadata={"help": "AdamW weight decay", "trained": True}
    )
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1", "trained": True})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2", "trained": True})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon", "trained": True})
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps", "trained": True})
    min_lr_ratio: float = field(
        default=0.1,
        metadata={"help": "final learning rate as a fraction of lr (cosine end)", "trained": True},
    )
    grad_clip: float = field(
        default=1.0,
        metadata={"help": "clip the global gradient norm to this (0: off)", "trained": True},
    )

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "beta1", "beta2", "eps", "min_lr_ratio", "grad_clip"):
            if not math.isfinite(getattr(self, name)):  # 1e999 reads as inf
                raise ValueError(f"{name}={getattr(self, name)}: must be a finite number")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip}: must be >= 0 (0 turns clipping off)")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1)")


# how the student's weights reach the rollout workers (xtoken_core.ipc.policy_weights); auto:
# cuda_ipc for a student on a GPU, shm on the CPU
WEIGHT_TRANSPORTS = ("auto", "file", "shm", "cuda_ipc")


@dataclasses.dataclass
class OnPolicyConfig:
    """On-policy distillation: a share of each step sampled by the student itself (rollout
    workers), scored by the same teacher, trained with the same loss."""

    fraction: float = field(
        default=0.0,
        metadata={
            "help": "share of each step's samples taken from the rollout workers (GKD's lambda; "
            "0: off-policy only); xtoken run sets it from data.on_policy_fraction",
            "derived": "data.on_policy_fraction",
            "trained": True,
        },
    )
    start_step: int = field(
        default=0,
        metadata={
            "help": "steps trained off-policy only before each step takes its on-policy share "
            "(an off-policy start, as GKD and Qwen3 recipes do; one optimizer and one "
            "learning-rate schedule across both; the rollout workers get their first weights "
            "max_staleness x sync_every steps before it)",
            "trained": True,
        },
    )
    sync_every: int = field(
        default=1,
        metadata={
            "help": "publish the student's weights to the rollout workers every N steps",
            "trained": True,
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "drop (never train) an on-policy sample whose weights are more than this "
            "many publications behind the trainer's",
            "trained": True,
        },
    )
    ce: bool = field(
        default=False,
        metadata={
            "help": "also train the student's CE on the tokens it sampled itself (off: it would "
            "reinforce its own mistakes; the KD term always counts)",
            "trained": True,
        },
    )
    weights: Literal["auto", "file", "shm", "cuda_ipc"] = field(
        default="auto",
        metadata={
            "help": "how the weights reach the rollout workers: auto (cuda_ipc for a student on a "
            "GPU, shm on the CPU: one node), file (a safetensors file in RUN_DIR/policy, renamed "
            "into place: rollout workers on other nodes with a shared filesystem)",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"fraction={self.fraction}: must be in [0, 1]")
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int):
            raise ValueError(f"start_step={self.start_step!r}: must be an int >= 0")
        if self.start_step < 0:
            raise ValueError(f"start_step={self.start_step}: must be >= 0")
        if self.sync_every < 1:
            raise ValueError(f"sync_every={self.sync_every}: must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: must be >= 0")
        if self.weights not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weights={self.weights!r}: use one of {', '.join(WEIGHT_TRANSPORTS)}")

    @property
    def enabled(self) -> bool:
        """Some of each step comes from the rollout workers."""
        return self.fraction > 0

    def share(self, samples: int, step: int | None = None) -> int:
        """On-policy samples of a claim of ``samples``: ``round(fraction * samples)``, at least
        one when the fraction is above 0 (a small step still gets its on-policy share); none
        for a step before ``start_step`` (``step`` None: a step past the start)."""
        if self.fraction <= 0 or (step is not None and step < self.start_step):
            return 0
        return min(samples, max(1, round(self.fraction * samples)))

    @property
    def first_publication(self) -> int:
        """The first step whose weights go to the rollout workers: the samples made with them
        are still fresh (``max_staleness`` publications old at most) at ``start_step``."""
        return max(0, self.start_step - self.max_staleness * self.sync_every)


@dataclasses.dataclass
class StudentConfig:
    """The student model: what is trained, and the length its start-up step runs at."""

    model: str = field(
        default="student-25m",
        metadata={
            "help": "student model: a local HF directory, a preset name or gguf:PATH; "
            ":drop=A-B after it removes those decoder layers",
            "path": "model",
            "trained": True,
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "vocab of a preset student (default: its tokenizer's, rounded up to a multiple of 128)",
            "trained": True,
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seed of the student init (data.seed shuffles the texts)",
            "trained": True,
        },
    )
    max_length: int = field(
        default=0,
        metadata={
            "help": "longest student micro-batch in tokens (xtoken run sets it to ctx_student "
            "when 0); the start-up step that compiles the student and checks that a step fits "
            "in memory runs at feed.micro_batch x max_length (0: 128 tokens)",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        if self.max_length < 0:
            raise ValueError(f"max_length={self.max_length}: must be >= 0 (0: 128 tokens)")


@dataclasses.dataclass
class ComputeConfig:
    """How the student computes: device, precision, parallelism, compile and kernels."""

    device: str = field(
        default="cpu",
        metadata={"help": "cpu, or cuda (each rank takes cuda:LOCAL_RANK)", "trained": False},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "compute dtype: auto (bfloat16 autocast on cuda, float32 on cpu)",
            "trained": False,
        },
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = field(
        default="auto",
        metadata={
            "help": "dtype of the student's parameters in the forward and backward: auto "
            "(bfloat16 on cuda, with fp32 master weights in the optimizer; float32 on cpu), "
            "float32 (fp32 parameters under autocast: the eager baseline) or bfloat16",
            "trained": False,
        },
    )
    parallel: Literal["ddp", "fsdp"] = field(
        default="ddp",
        metadata={
            "help": "data parallel: ddp, or fsdp (fully_shard) for big students",
            "trained": True,
        },
    )
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer of the student (None: on for cuda, off "
            "on cpu); compiled once per run, at start, with symbolic lengths",
            "trained": False,
        },
    )
    cuda_graphs: bool | None = field(
        default=None,
        metadata={
            "help": "replay each compiled decoder layer as CUDA graphs, one per length: the host "
            "launches one graph per layer instead of one kernel at a time (None: on where it can "
            "run: compiled on a cuda device, bf16 parameters, one process or ddp, no activation "
            "checkpointing)",
            "trained": False,
        },
    )
    fused_head: bool = field(
        default=False,
        metadata={
            "help": "compute the output layer and the loss together, one chunk-aligned block of "
            "rows at a time, never the whole [B*T, V] logits (xtoken_core.losses.fused_head): "
            "the forward runs the backbone, the head takes its hidden states and the output "
            "weight (one process only). Off by default: 1.05-1.14x the materialized step's "
            "time, for 1.7x the micro-batch that fits (20 x 4096 against 12, a 0.6B student "
            "on one H200)",
            "trained": False,
        },
    )
    fused_head_rows: int = field(
        default=4096,
        metadata={
            "help": "student rows per block of the fused head (a block ends on the last chunk "
            "boundary at or below it): fewer, larger blocks take fewer launches and host waits "
            "per micro-batch, and hold [rows, V] logits at a time (4096 x 151,936 in bf16: "
            "1.2 GB; 4096 ran as fast as 8192 and 1.04-1.25x faster than 1024, one H200)",
            "trained": False,
        },
    )
    fused_update: bool | None = field(
        default=None,
        metadata={
            "help": "AdamW's update of the fp32 masters and the write of their bf16 copy in one "
            "Triton launch (xtoken_core.kernels.adamw) instead of torch's fused AdamW and a "
            "copy: bf16 parameters with fp32 masters, one process or ddp (None: on where it can "
            "run: a cuda device with fp32 masters)",
            "trained": False,
        },
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "recompute each decoder layer's activations in the backward instead of "
            "keeping them (less memory for about one more forward of compute)",
            "trained": False,
        },
    )
    packed_attention: Literal["auto", "flex_attention", "sdpa"] = field(
        default="auto",
        metadata={
            "help": "attention of packed rows: flex_attention (a document BlockMask whose blocks "
            "across documents are skipped), sdpa (a [B, 1, T, T] mask) or auto (flex_attention "
            "on cuda, sdpa elsewhere)",
            "trained": False,
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "help": "bitwise-reproducible steps: deterministic PyTorch algorithms (an op without "
            "one fails), cuDNN deterministic and unbenchmarked, CUBLAS_WORKSPACE_CONFIG=:4096:8, "
            "torch, numpy and random seeded from student.seed; needs feed.ordered "
            "(data.ordered in a run config)",
            "trained": False,
        },
    )
    warm_shortest: int = field(
        default=64,
        metadata={
            "help": "the start-up step compiles (and with CUDA graphs records) the ladder "
            "max_length, max_length / 2, ... down to this length; a micro-batch shorter than "
            "the ladder reaches compiles its own graph at its first step (once). Raise "
            "it to the shortest micro-batch a run sees to save the rungs below: a micro-batch's "
            "length is its longest sample's, so with many samples each it stays near the context",
            "trained": False,
        },
    )
    length_multiple: int = field(
        default=1,
        metadata={
            "help": "pad each micro-batch's student length up to a multiple of this (it must "
            "divide student.max_length): with CUDA graphs a layer records one graph per "
            "distinct length, so a multiple of 64 bounds the recordings at max_length / 64 for "
            "up to 63 pad tokens a row; 1: the longest sample's length",
            "trained": False,
        },
    )
    gc_every: int = field(
        default=50,
        metadata={
            "help": "after the start-up step, freeze the heap that exists, turn Python's "
            "automatic garbage collector off and collect every gc_every steps, on every rank at "
            "the same step (an automatic full collection pauses one rank at a time, and under "
            "DDP the others wait for it); 0: Python's automatic collector",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if self.param_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"param_dtype={self.param_dtype!r}: use auto, float32 or bfloat16")
        if self.packed_attention not in ("auto", "flex_attention", "sdpa"):
            raise ValueError(
                f"packed_attention={self.packed_attention!r}: use auto, flex_attention or sdpa"
            )
        if self.gc_every < 0:
            raise ValueError(f"gc_every={self.gc_every}: must be >= 0")
        if self.warm_shortest < 1:
            raise ValueError(f"warm_shortest={self.warm_shortest}: must be >= 1")
        if self.length_multiple < 1:
            raise ValueError(f"length_multiple={self.length_multiple}: must be >= 1")
        if self.fused_head_rows < 1:
            raise ValueError(f"fused_head_rows={self.fused_head_rows}: must be >= 1")


@dataclasses.dataclass
class FeedConfig:
    """The samples each step claims from the queue: how many, in what order, with what waits."""

    micro_batch: int = field(
        default=4, metadata={"help": "samples per micro-batch", "trained": True}
    )
    grad_accum: int = field(
        default=1, metadata={"help": "micro-batches per optimizer step", "trained": True}
    )
    ordered: bool = field(
        default=False,
        metadata={
            "help": "claim exactly micro_batch x grad_accum samples per step in queue order and "
            "sort only within the step, so that runs on the same queue order train the same "
            "micro-batches; N ranks take fixed shares of N such steps (xtoken run sets it from "
            "data.ordered)",
            "derived": "data.ordered",
            "trained": True,
        },
    )
    lease_s: float = field(
        default=300.0,
        metadata={"help": "lease of claimed samples (redelivered if we die)", "trained": False},
    )
    claim_timeout_s: float = field(
        default=1.0, metadata={"help": "server-side wait of a claim", "trained": False}
    )
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to wait for a queue reply before failing", "trained": False},
    )
    idle_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "end the epoch after this long without data even without the collators' "
            "end-of-data marker (None: wait for the marker)",
            "trained": False,
        },
    )
    ahead_steps: int = field(
        default=1,
        metadata={
            "help": "steps of micro-batches claimed and asked of the teachers ahead of the one "
            "training (1: the teacher computes step k+1 while this rank trains on step k; 2 "
            "measured slower with a top-K teacher on the trainer's GPU: "
            "benchmarks/results/teachers.md)",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        for name in ("micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.ahead_steps < 1:
            raise ValueError(f"ahead_steps={self.ahead_steps}: must be >= 1")
        for name in ("lease_s", "claim_timeout_s", "queue_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")

    @property
    def step_samples(self) -> int:
        """Samples of one rank's optimizer step: ``micro_batch x grad_accum``."""
        return self.micro_batch * self.grad_accum


@dataclasses.dataclass
class TeacherLinkConfig:
    """The trainer's side of its teacher: whose logits it reads, from which group, how long it
    waits for them."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "teacher model spec (the hidden transport loads its output layer; xtoken run "
            "sets it from teacher.model for that transport)",
            "path": "model",
            "trained": True,
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "vocab of a preset teacher (default: its tokenizer's)",
            "derived": "teacher.vocab_size",
            "trained": True,
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seed of a preset teacher (the hidden transport rebuilds its output layer)",
            "derived": "teacher.seed",
            "trained": True,
        },
    )
    groups: int = field(
        default=1,
        metadata={
            "help": "teacher groups; rank r asks group r % groups",
            "derived": "teachers",
            "trained": False,
        },
    )
    timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "wait this long for a teacher result before asking again",
            "trained": False,
        },
    )
    dead_after_s: float = field(
        default=5.0,
        metadata={
            "help": "a teacher whose logit-ring heartbeat is older than this is dead: what it "
            "did not answer is asked of its successor",
            "trained": False,
        },
    )
    verify_logits: bool = field(
        default=False,
        metadata={"help": "check each slot's checksum (teacher checksum=true)", "trained": False},
    )
    weight: float = field(
        default=1.0,
        metadata={
            "help": "weight of this teacher's KD term in the loss (the loss sums the teachers' "
            "terms, each over its own valid chunks, times its weight)",
            "derived": "teacher.weight",
            "trained": True,
        },
    )

    cache: str | None = field(
        default=None,
        metadata={
            "help": "a teacher cache folder (xtoken cache build) whose top-K targets the "
            "samples carry: the trainer decodes them instead of asking a teacher (null: ask "
            "the teacher's groups)",
            "path": "file",
            "derived": "this teacher's entry of data.teacher_cache",
            "trained": True,
        },
    )
    cache_missing: Literal["error", "online"] = field(
        default="error",
        metadata={
            "help": "with a cache: a sample it lacks (teacher_topk_cached false) is an error, "
            "or online: asked of the teacher's groups, as a live teacher's micro-batch is",
            "derived": "data.teacher_cache_missing",
            "trained": True,
        },
    )

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups={self.groups}: must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"weight={self.weight}: must be a finite number >= 0")


@dataclasses.dataclass
class ExtraTeacherLinkConfig(TeacherLinkConfig):
    """A further teacher of the loss (teacher j >= 1, an entry of ``extra_teachers``), of a
    tokenizer family of its own: its tokenizer and projection, and the link to its groups as
    teacher 0's (its ``groups``, ``model``, ``vocab_size``, ``seed``, ``weight`` and timeouts are
    its own)."""

    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "this teacher's tokenizer, a name or a path (required)",
            "path": "tokenizer",
            "trained": True,
        },
    )
    projection: str | None = field(
        default=None,
        metadata={
            "help": "projection file from the student's tokenizer to this teacher's (xtoken "
            "projection build); needed unless loss.mode=ce (xtoken run builds one when its "
            "run config leaves it empty)",
            "path": "file",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tokenizer:
            raise ValueError("tokenizer is required: this teacher's tokenizer, a name or a path")


@dataclasses.dataclass
class ScheduleConfig:
    """When the loop stops, checkpoints, evaluates and exports. (The export is here, not under
    ``eval``: like a checkpoint it is something the loop does at a point of the run.)"""

    max_steps: int = field(
        default=100, metadata={"help": "optimizer steps (0: until the data ends)", "trained": False}
    )
    epochs: int = field(default=1, metadata={"help": "passes over the data", "trained": True})
    checkpoint_every: int = field(
        default=50, metadata={"help": "steps between checkpoints (0: off)", "trained": False}
    )
    eval_every: int = field(
        default=50, metadata={"help": "steps between held-out evals (0: off)", "trained": False}
    )
    export: bool = field(
        default=True, metadata={"help": "export the final student (HF dir)", "trained": False}
    )
    final_checkpoint: bool = field(
        default=True,
        metadata={
            "help": "checkpoint after the last step and at a stop (false: none then, for runs "
            "whose weights are thrown away, such as benchmarks: what was trained after the last "
            "checkpoint is in none)",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs={self.epochs}: must be >= 1")
        for name in ("max_steps", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")


@dataclasses.dataclass
class EvalConfig:
    """The held-out bits per byte: which texts, how many, in what windows."""

    heldout: str | None = field(
        default=None,
        metadata={
            "help": "held-out corpus (.jsonl/.txt/.parquet) for bits/byte",
            "path": "file",
            "derived": "data.heldout",
            "trained": False,
        },
    )
    texts: int = field(
        default=32,
        metadata={
            "help": "held-out texts per eval (0: no held-out eval, of the student before, during "
            "and after training nor of the teacher at its start; for runs that only measure "
            "speed)",
            "trained": True,
        },
    )
    ctx: int = field(default=512, metadata={"help": "tokens per eval window", "trained": False})

    def __post_init__(self) -> None:
        if self.texts < 0:
            raise ValueError(f"texts={self.texts}: must be >= 0 (0: no held-out eval)")
        if self.ctx < 2:
            raise ValueError(f"ctx={self.ctx}: must be >= 2 tokens")


@dataclasses.dataclass
class ObserveConfig:
    """What rank 0 reports beside its metrics files: experiment trackers and profiler traces."""

    report_to: list[str] = field(
        default_factory=list,
        metadata={
            "help": "experiment trackers that rank 0 also writes its metrics to: tensorboard "
            "(RUN_DIR/tensorboard), wandb (offline unless WANDB_MODE says otherwise, "
            "RUN_DIR/wandb); pip install 'xtoken[tracking]'",
            "trained": False,
        },
    )
    profile_steps: int = field(
        default=0,
        metadata={
            "help": "trace this many steps with torch.profiler from step profile_start, data "
            "wait and the time between steps included: RUN_DIR/profile/trainer.rank<r>"
            ".trace.json.gz (Perfetto or chrome://tracing) and .ops.txt (the top operators); "
            "0: off",
            "trained": False,
        },
    )
    profile_start: int = field(
        default=3,
        metadata={
            "help": "first traced step (after the compile's warm-up steps)",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        unknown = [name for name in self.report_to if name not in TRACKERS]
        if unknown:
            raise ValueError(
                f"report_to: unknown tracker {unknown[0]!r}; use a list of {', '.join(TRACKERS)} "
                "(or [] for none)"
            )
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps={self.profile_steps}: must be >= 0")
        if self.profile_start < 1:
            raise ValueError(f"profile_start={self.profile_start}: steps count from 1")
