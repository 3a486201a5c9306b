"""The teacher process's config (the ``teacher`` section of a run config).

Imports nothing heavy: the CLI builds its parser from this dataclass and a run config validates it
before any model is touched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import ClassVar, Literal

from services.protocol.names import TRANSPORTS
from xtoken_core.models.dtypes import check_dtype_name

__all__ = [
    "TeacherConfig",
    "check_tensor_parallel",
    "resolve_compile",
    "resolve_cuda_graphs",
    "ring_transport",
    "teacher_name",
]

# Transports a tensor-parallel teacher group serves: each shard writes its vocab slice of a ring
# slot (shm, cuda_ipc), rank 0 sends the replicated hidden states (hidden) or the top-K of the
# logits all-gathered from the shards (topk).
TENSOR_PARALLEL_TRANSPORTS = ("shm", "cuda_ipc", "hidden", "topk")


def _device_type(device: object) -> str:
    """``cuda`` for ``cuda``, ``cuda:1`` or a ``torch.device`` on a GPU; ``cpu`` etc. alike."""
    return str(device).split(":", 1)[0]


def ring_transport(device: object) -> str:
    """The logit ring of a teacher on ``device``: ``cuda_ipc`` on a GPU, else ``shm``."""
    return "cuda_ipc" if _device_type(device) == "cuda" else "shm"


def teacher_name(teacher: int, group: int) -> str:
    """The name of group ``group`` of the run's teacher ``teacher``: its process, log, ready and
    heartbeat files (``teacher0``; ``t1.teacher0`` for the run's second teacher). The ranks of a
    tensor-parallel group past the first add ``.<rank>``."""
    return f"teacher{group}" if teacher == 0 else f"t{teacher}.teacher{group}"


def resolve_compile(flag: bool | None, device: object) -> bool:
    """Whether to compile: ``teacher.compile`` as given, or for None on when ``device`` is CUDA."""
    if flag is None:
        return _device_type(device) == "cuda"
    return flag


def check_tensor_parallel(size: int, model_config: object, model: str = "the model") -> None:
    """Refuse a ``teacher.tensor_parallel`` that does not divide the shapes it shards.

    A tensor-parallel group splits the attention heads, the KV heads and the MLP's intermediate
    size over its ranks (the vocab may split unevenly). Imports nothing: a run's pre-flight calls
    it on a model's config before any process starts.

    Args:
        size: the group's ranks (``teacher.tensor_parallel``).
        model_config: a transformers config, or any object or dict with ``num_attention_heads``,
            ``num_key_value_heads`` (default: the heads) and ``intermediate_size``.
        model: the model's name, for the message.

    Raises:
        ValueError: ``size`` is not an int >= 1, the config lacks a size, or ``size`` does not
            divide them (one line naming ``teacher.tensor_parallel`` and the sizes that would).
    """
    if type(size) is not int or size < 1:
        raise ValueError(f"teacher.tensor_parallel={size!r}: must be an int >= 1")

    def get(name: str, default: object = None) -> object:
        if isinstance(model_config, dict):
            return model_config.get(name, default)
        return getattr(model_config, name, default)

    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    intermediate = get("intermediate_size")
    sizes = {"attention heads": heads, "KV heads": kv_heads, "intermediate size": intermediate}
    for what, value in sizes.items():
        if type(value) is not int or value < 1:
            raise ValueError(
                f"teacher.tensor_parallel={size}: {model} has no {what} to shard (got {value!r}); "
                "set teacher.tensor_parallel: 1"
            )
    values = list(sizes.values())
    if all(v % size == 0 for v in values):
        return
    fits = [t for t in range(1, min(values) + 1) if all(v % t == 0 for v in values)]
    raise ValueError(
        f"teacher.tensor_parallel={size} does not divide {model}'s {heads} attention heads, "
        f"{kv_heads} KV heads and intermediate size {intermediate}; use one of "
        f"{', '.join(map(str, fits))}"
    )


def resolve_cuda_graphs(flag: bool, compiled: bool, device: object) -> bool:
    """Whether the compiled layers replay as CUDA graphs (``teacher.cuda_graphs``).

    Args:
        flag: the setting.
        compiled: whether the layers compile (``resolve_compile``).
        device: the teacher's device.

    Raises:
        ValueError: ``cuda_graphs: true`` where it cannot run (names the setting to change).
    """
    if not flag:
        return False
    why = None
    if _device_type(device) != "cuda":
        why = f"the teacher runs on {device}, not a cuda device"
    elif not compiled:
        why = "teacher.compile is off"
    if why:
        raise ValueError(f"teacher.cuda_graphs: {why}; set teacher.cuda_graphs: false")
    return True


@dataclasses.dataclass
class TeacherConfig:
    """Settings of one teacher process (the ``teacher`` section of a run config)."""

    #: keys of older configs under their new names (services.common.config)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"heartbeat_s": "ring_heartbeat_s"}

    queue: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={"help": "queue server address", "context": "queue", "trained": False},
    )
    partition: str = field(
        default="train",
        metadata={"help": "sample partition of the run", "context": "partition", "trained": False},
    )
    teacher: int = field(
        default=0,
        metadata={
            "help": "which of the run's teachers this is: 0 the first (the teacher section), "
            "j >= 1 the run's extra_teachers[j-1], whose requests are in "
            "<partition>.t<j>.teacher<group>",
            "derived": "each teacher's index in the run (0: teacher, j: extra_teachers[j-1])",
            "trained": False,
        },
    )
    group: int = field(
        default=0,
        metadata={
            "help": "teacher group served: requests of <partition>.teacher<group> (of "
            "<partition>.t<teacher>.teacher<group> for teacher >= 1)",
            "derived": "each teacher group's index",
            "trained": False,
        },
    )
    model: str = field(
        default="smollm2",
        metadata={
            "help": "teacher model: a local HF directory, a preset name, or smollm2",
            "path": "model",
            "trained": True,
        },
    )
    tokenizer: str = field(
        default="smollm2",
        metadata={
            "help": "teacher tokenizer name or path",
            "context": "teacher_tokenizer",
            "path": "tokenizer",
            "trained": True,
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "model vocab of a preset model (default: the tokenizer's vocab)",
            "trained": True,
        },
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N", "trained": False})
    dtype: str = field(
        default="auto",
        metadata={"help": "model dtype: auto (bfloat16 on cuda, else float32)", "trained": False},
    )
    transport: Literal["auto", "shm", "cuda_ipc", "hidden", "topk"] = field(
        default="auto",
        metadata={
            "help": "how logits reach the trainer: shm, cuda_ipc (a ring slot), hidden (the final "
            "hidden states through the queue), topk (the top_k log-probs per token, the rest "
            "mass and the log-partition through the queue), or auto: a ring (cuda_ipc on a "
            "GPU, else shm), topk for trainers on other nodes (xtoken run decides)",
            "trained": False,
        },
    )
    top_k: int = field(
        default=64,
        metadata={
            "help": "transport=topk: log-probs sent per teacher token (the rest of the mass is "
            "spread evenly over the other ids); at most the teacher's vocab",
            "trained": True,
        },
    )
    slots: int = field(
        default=2, metadata={"help": "slots of the logit ring (>= 2)", "trained": False}
    )
    max_batch: int = field(
        default=8, metadata={"help": "most rows of one request (slot rows)", "trained": False}
    )
    forward_rows: int = field(
        default=8,
        metadata={
            "help": "most rows of one forward: requests of one length that wait together share "
            "a forward up to this many rows (1: a forward per request; a larger request still "
            "gets one of its own)",
            "trained": False,
        },
    )
    max_length: int = field(
        default=2048,
        metadata={"help": "longest teacher row (the teacher context length)", "trained": False},
    )
    logits_dtype: str = field(
        default="bfloat16",
        metadata={"help": "dtype of the logits in the ring / hidden states", "trained": False},
    )
    compile: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer (dynamic shapes, so no recompile per "
            "length); unset: on for cuda, off on cpu; a failed compile falls back to eager",
            "trained": False,
        },
    )
    cuda_graphs: bool = field(
        default=False,
        metadata={
            "help": "replay each compiled decoder layer as CUDA graphs, one per row count and "
            "length: the host launches one graph per layer instead of one kernel at a time "
            "(needs compiled layers on a cuda device; measured: no change to the pipeline's "
            "tokens/s at 1x4096 or 4x2048, so it is off by default)",
            "trained": False,
        },
    )
    pack: bool = field(
        default=False,
        metadata={
            "help": "requests hold packed rows of several documents (as the collators pack them): "
            "the model runs packed_attention",
            "context": "pack",
            "trained": True,
        },
    )
    packed_attention: Literal["auto", "flex_attention", "sdpa"] = field(
        default="auto",
        metadata={
            "help": "attention of packed rows: flex_attention (a document BlockMask), sdpa (a "
            "[B, 1, T, T] mask) or auto (flex_attention on cuda, sdpa elsewhere)",
            "trained": False,
        },
    )
    checksum: bool = field(
        default=False,
        metadata={
            "help": "put a checksum of each slot (int64 sum of its bits) in its handle",
            "trained": False,
        },
    )
    lease_s: float = field(
        default=120.0,
        metadata={"help": "lease of a claimed request (redelivered if we die)", "trained": False},
    )
    claim_timeout_s: float = field(
        default=1.0, metadata={"help": "server-side wait of a claim", "trained": False}
    )
    queue_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to wait for a queue reply before failing", "trained": False},
    )
    ring_heartbeat_s: float = field(
        default=0.5,
        metadata={
            "help": "seconds between two heartbeats in each logit ring (trainers call a teacher "
            "whose ring beat is older than their trainer.teacher.dead_after_s dead)",
            "trained": False,
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of a preset model's random weights", "trained": True}
    )
    tensor_parallel: int = field(
        default=1,
        metadata={
            "help": "processes of this teacher group, one GPU each, that split the model by "
            "tensor parallelism (attention heads, MLP, vocab); more than 1: start the group with "
            "torchrun --nproc-per-node N, and N must divide the model's heads, KV heads and "
            "intermediate size",
            "trained": False,
        },
    )
    max_rings: int = field(
        default=64,
        metadata={
            "help": "most trainer ranks served (one logit ring each); others are refused",
            "trained": False,
        },
    )
    heldout: str | None = field(
        default=None,
        metadata={
            "help": "held-out corpus: report the teacher's bits/byte once at start",
            "path": "file",
            "derived": "data.heldout",
            "trained": False,
        },
    )
    eval_texts: int = field(
        default=32,
        metadata={
            "help": "held-out texts of that eval (0: none)",
            "derived": "trainer.eval.texts",
            "trained": False,
        },
    )
    eval_ctx: int = field(
        default=512,
        metadata={
            "help": "tokens per eval window",
            "derived": "trainer.eval.ctx",
            "trained": False,
        },
    )
    run_dir: str | None = field(
        default=None,
        metadata={
            "help": "write metrics under RUN_DIR/metrics",
            "default_text": "no metrics file",
            "context": "run_dir",
            "path": "run",
            "trained": False,
        },
    )

    def __post_init__(self) -> None:
        if self.transport == "auto":
            self.transport = ring_transport(self.device)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: use one of {', '.join(TRANSPORTS)}")
        if self.transport == "cuda_ipc" and not str(self.device).startswith("cuda"):
            raise ValueError(
                f"transport=cuda_ipc needs a CUDA device, got device={self.device!r}; use "
                "transport=shm on CPU"
            )
        if type(self.top_k) is not int or self.top_k < 1:
            raise ValueError(
                f"top_k={self.top_k!r}: the log-probs sent per teacher token must be an int >= 1; "
                "set teacher.top_k >= 1"
            )
        if self.slots < 2:
            raise ValueError(
                f"slots={self.slots}: the ring needs >= 2 slots so that the teacher computes "
                "batch k+1 while the trainer trains on batch k"
            )
        for name in ("max_batch", "max_length", "forward_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.group < 0:
            raise ValueError(f"group={self.group}: must be >= 0")
        if type(self.teacher) is not int or self.teacher < 0:
            raise ValueError(
                f"teacher={self.teacher!r}: must be an int >= 0 (0: the run's first teacher)"
            )
        if type(self.tensor_parallel) is not int or self.tensor_parallel < 1:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel!r}: must be an int >= 1 (1: one process "
                "holds the whole teacher)"
            )
        if self.tensor_parallel > 1 and self.transport not in TENSOR_PARALLEL_TRANSPORTS:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} with transport={self.transport}: a "
                f"tensor-parallel teacher serves {', '.join(TENSOR_PARALLEL_TRANSPORTS)}; set "
                "teacher.tensor_parallel: 1 or another transport"
            )
        for name in ("lease_s", "claim_timeout_s", "queue_timeout_s", "ring_heartbeat_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # nan and 1e999 (inf) too
                raise ValueError(f"{name}={value}: must be a finite number of seconds > 0")
        if self.max_length > 1 << 20 or self.eval_ctx > 1 << 20:
            raise ValueError(
                f"max_length={self.max_length}, eval_ctx={self.eval_ctx}: at most {1 << 20} tokens"
            )
        check_dtype_name(self.dtype)
        check_dtype_name(self.logits_dtype)
        resolve_cuda_graphs(
            self.cuda_graphs, resolve_compile(self.compile, self.device), self.device
        )
        if self.packed_attention not in ("auto", "flex_attention", "sdpa"):
            raise ValueError(
                f"packed_attention={self.packed_attention!r}: use auto, flex_attention or sdpa"
            )
