"""CrossTokenizerLossConfig: the typed, validated settings of the cross-tokenizer loss, used as
is by the library and by the trainer (the ``trainer.loss`` section of a run config). Imports no
torch or Triton: a run config is parsed and checked before either loads."""

from __future__ import annotations

import math
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from torch import Tensor
else:

    class _TensorType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            torch = sys.modules.get("torch")  # no tensor exists before torch is imported
            return torch is not None and isinstance(obj, torch.Tensor)

    class Tensor(metaclass=_TensorType):
        """``torch.Tensor`` in the field types without importing torch: ``isinstance(x, Tensor)``
        is ``isinstance(x, torch.Tensor)``."""


#: A projection is a file path (dense top-k or sparse format) or an in-memory dense top-k pair
#: ``(indices Long[V_s, K], likelihoods Float[V_s, K])`` with -1 for "no entry".
ProjectionSource = str | os.PathLike | tuple[Tensor, Tensor]

#: The KD modes, one module each in :mod:`xtoken_core.losses.modes`; its registry
#: (:data:`xtoken_core.losses.modes.MODES`) maps these names to their classes (a test checks).
KD_MODES = ("pkl", "gold", "xtoken")
#: The mode that trains on the student CE alone: no teacher, no projection, no KD term.
CE_ONLY = "ce"
#: Every ``mode``: :data:`KD_MODES`, then :data:`CE_ONLY`.
MODE_NAMES = (*KD_MODES, CE_ONLY)
Mode = Literal[MODE_NAMES]  # type: ignore[valid-type]  # built from the names above
Backend = Literal["auto", "reference", "kernel"]
BACKENDS = typing.get_args(Backend)
TopkColumns = Literal["valid", "all"]
TOPK_COLUMNS = typing.get_args(TopkColumns)


def _is_single_projection(value: object) -> bool:
    if isinstance(value, str | os.PathLike):
        return True
    return (
        isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, Tensor) for v in value)
    )


def _check_topk_pair(pair: tuple[Tensor, Tensor], where: str) -> None:
    import torch  # loaded already: the pair holds tensors

    indices, likelihoods = pair
    if indices.dim() != 2 or indices.shape != likelihoods.shape:
        raise ValueError(
            f"{where}: indices {tuple(indices.shape)} and likelihoods {tuple(likelihoods.shape)} "
            "must both be [V_s, K]"
        )
    if indices.is_floating_point() or indices.dtype == torch.bool:
        raise ValueError(f"{where}: indices must be an integer tensor, got {indices.dtype}")
    if not likelihoods.is_floating_point():
        raise ValueError(f"{where}: likelihoods must be floating point, got {likelihoods.dtype}")
    if indices.numel() and int(indices.min()) < -1:
        raise ValueError(f"{where}: indices hold {int(indices.min())}; use -1 for 'no entry'")


@dataclass(eq=False)
class CrossTokenizerLossConfig:
    """The cross-tokenizer loss: mode, weights, backend (mode ce: the student CE alone).

    Settings of :class:`~xtoken_core.losses.loss.CrossTokenizerLoss`; each field's ``help`` says
    what it does, docs/design.md ("The loss math") has the formulas. The trainer takes it as is:
    its fields are the keys of ``trainer.loss`` in a run config and the ``--loss.*`` flags (but
    the settings of several teachers, which a trainer does not take). ``teacher_vocab_size`` is
    known at run time only: the trainer sets it (``dataclasses.replace``).
    """

    #: keys of older run configs, refused with the reason (services.common.config)
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "cuda_graphs": "the P-KL phase runs as eager Triton kernels (CUDA-graph replay saved "
        "nothing end to end: benchmarks/results/e2e_pipeline.md); delete the key",
    }

    mode: Mode = field(
        default="pkl",
        metadata={
            "help": "pkl (projected KL), gold, xtoken (relaxed gold) or ce (the student CE alone, "
            "no teacher)",
            "trained": True,
        },
    )
    projection: ProjectionSource | Sequence[ProjectionSource] | None = field(
        default=None,
        metadata={
            "help": "projection file (xtoken projection build), or one per teacher; needed "
            "unless mode=ce (in code also an (indices, likelihoods) tensor pair)",
            "path": "file",
            "trained": False,
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "softmax temperature T of the KD term (> 0); the KD term is times T**2",
            "trained": True,
        },
    )
    kl_weight: float = field(
        default=1.0, metadata={"help": "weight of the KD term", "trained": True}
    )
    ce_weight: float = field(
        default=1.0, metadata={"help": "weight of the student CE term", "trained": True}
    )
    vocab_topk: int | None = field(
        default=8192, metadata={"help": "teacher columns kept by P-KL (None: all)", "trained": True}
    )
    topk_columns: TopkColumns = field(
        default="valid",
        metadata={
            "help": "positions that pick P-KL's top-k teacher columns (the ids with the largest "
            "max-logit): valid (the positions that belong to a chunk after the next-token "
            "shift) or all (every position, padding and the last one included: NeMo RL's "
            "rule); they differ only when vocab_topk < the teacher vocab",
            "trained": True,
        },
    )
    uncommon_topk: int = field(
        default=8192, metadata={"help": "gold: sorted-L1 length cap", "trained": True}
    )
    reverse_kl: bool = field(
        default=False, metadata={"help": "KL(student || teacher)", "trained": True}
    )
    dynamic_scaling: bool = field(
        default=False,
        metadata={"help": "scale the KD term by |ce| / |kd| (detached)", "trained": True},
    )
    exact_token_match_only: bool = field(
        default=False,
        metadata={
            "help": "only chunks whose two sides cover identical text count",
            "trained": True,
        },
    )
    teacher_weights: Sequence[float] | None = field(
        default=None,
        metadata={
            "help": "one weight per teacher (None: one teacher, weight 1)",
            "cli": False,
            "trained": True,
        },
    )
    teacher_vocab_size: int | Sequence[int | None] | None = field(
        default=None,
        metadata={
            "help": "true teacher vocab (or one per teacher): wider teacher logits (lm_head "
            "padding) are sliced to it; None: the logits' width. The trainer sets it",
            "cli": False,
            "trained": True,
        },
    )
    backend: Backend = field(
        default="auto",
        metadata={
            "help": "loss backend, chosen once: auto (the Triton kernels on CUDA, else the "
            "CPU path: the reference's math with fewer passes over the logits), reference, or "
            "kernel (the kernels wherever Triton runs: CUDA or TRITON_INTERPRET=1); fp64 "
            "logits always take the reference",
            "trained": False,
        },
    )
    check_inputs: bool = field(
        default=True,
        metadata={
            "help": "run the cheap input checks (shapes, chunk-id range, finite logits)",
            "trained": False,
        },
    )
    projections: tuple[ProjectionSource, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODE_NAMES:
            raise ValueError(f"mode={self.mode!r} is unknown; use one of {MODE_NAMES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of {BACKENDS}")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number > 0")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (1.0 is plain softmax)")
        if self.vocab_topk is not None and (
            not isinstance(self.vocab_topk, int) or self.vocab_topk < 1
        ):
            raise ValueError(f"vocab_topk={self.vocab_topk!r} must be a positive int or None (all)")
        if self.topk_columns not in TOPK_COLUMNS:
            raise ValueError(
                f"topk_columns={self.topk_columns!r} is unknown; use one of {TOPK_COLUMNS} "
                "('valid': chunked positions only, the default; 'all': every position, as NeMo RL)"
            )
        if not isinstance(self.uncommon_topk, int) or self.uncommon_topk < 1:
            raise ValueError(f"uncommon_topk={self.uncommon_topk!r} must be a positive int")
        for name in ("kl_weight", "ce_weight"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be finite and >= 0")
        if self.mode == CE_ONLY and self.ce_weight == 0:
            raise ValueError("mode=ce with ce_weight=0 trains nothing; set ce_weight > 0")

        projections: tuple[ProjectionSource, ...] = ()
        if self.projection is None:
            # mode ce, or a run that builds its projection later: the loss refuses a KD mode
            # without one (CrossTokenizerLoss)
            pass
        elif _is_single_projection(self.projection):
            projections = (self.projection,)
        elif isinstance(self.projection, Sequence) and len(self.projection) > 0:
            projections = tuple(self.projection)
            for i, p in enumerate(projections):
                if not _is_single_projection(p):
                    raise ValueError(
                        f"projection[{i}] is {type(p).__name__}; use a path or an "
                        "(indices, likelihoods) tensor pair"
                    )
        else:
            raise ValueError(
                f"projection of type {type(self.projection).__name__} is not a path, an "
                "(indices, likelihoods) tensor pair, or a non-empty list of them"
            )
        for i, p in enumerate(projections):
            if isinstance(p, tuple):
                _check_topk_pair(p, f"projection[{i}]")

        if self.teacher_weights is None:
            self.teacher_weights = (1.0,) * max(len(projections), 1)
        self.teacher_weights = tuple(float(w) for w in self.teacher_weights)
        n = len(self.teacher_weights)
        if n == 0:
            raise ValueError("teacher_weights=() is empty; give one weight per teacher")
        if any(not math.isfinite(w) or w < 0 for w in self.teacher_weights):
            raise ValueError(f"teacher_weights={self.teacher_weights} must be finite and >= 0")
        if len(projections) not in (0, 1, n):
            raise ValueError(
                f"{len(projections)} projections for {n} teacher_weights; give one projection "
                "per teacher or a single shared one"
            )
        self.projections = projections * n if len(projections) == 1 else projections

        sizes = self.teacher_vocab_size
        if sizes is None or isinstance(sizes, int):
            sizes = (sizes,) * n
        sizes = tuple(sizes)
        if len(sizes) != n:
            raise ValueError(
                f"teacher_vocab_size has {len(sizes)} entries for {n} teachers; give one per "
                "teacher or a single int"
            )
        for s in sizes:
            if s is not None and (not isinstance(s, int) or s < 1):
                raise ValueError(f"teacher_vocab_size entry {s!r} must be a positive int or None")
        self.teacher_vocab_size = sizes

    @property
    def num_teachers(self) -> int:
        """Number of teachers (``len(teacher_weights)``)."""
        return len(self.teacher_weights)

    @property
    def uses_teacher(self) -> bool:
        """Whether the loss has a KD term (needs teacher logits and a projection)."""
        return self.mode != CE_ONLY
