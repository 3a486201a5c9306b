"""CrossTokenizerLossConfig: the typed, validated settings of the cross-tokenizer loss."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: A projection is a file path (dense top-k or sparse format) or an in-memory dense top-k pair
#: ``(indices Long[V_s, K], likelihoods Float[V_s, K])`` with -1 for "no entry".
ProjectionSource = str | os.PathLike | tuple[torch.Tensor, torch.Tensor]

MODES = ("pkl", "gold", "xtoken")
BACKENDS = ("auto", "reference", "kernel")
TOPK_COLUMNS = ("valid", "all")


def _is_single_projection(value: object) -> bool:
    if isinstance(value, str | os.PathLike):
        return True
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, torch.Tensor) for v in value)
    )


def _check_topk_pair(pair: tuple[torch.Tensor, torch.Tensor], where: str) -> None:
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
    """Settings of :class:`~xtoken_core.losses.loss.CrossTokenizerLoss`.

    Attributes:
        projection: one :data:`ProjectionSource` shared by every teacher, or one per teacher.
        mode: shortcut for the two flags below: "pkl", "gold" or "xtoken" (relaxed gold).
        gold_loss: gold loss (common-vocab KL + uncommon sorted L1) instead of P-KL.
        xtoken_loss: relaxed exact-token map for the gold loss (needs ``gold_loss``).
        reverse_kl: KL(student || teacher) instead of KL(teacher || student).
        temperature: softmax temperature T (> 0); the KD term is scaled by T**2.
        vocab_topk: teacher columns kept by P-KL (None: all).
        topk_columns: which positions pick P-KL's ``vocab_topk`` teacher columns (the ids with
            the largest max-logit): "valid" (default) the positions that belong to a chunk after
            the next-token shift, so padding and the last position never pick a column; "all"
            every position of the micro-batch, padding and the last one included, as NeMo RL
            does (for parity with it). The two differ only when ``vocab_topk`` < teacher vocab.
        uncommon_topk: cap on the sorted-probability L1 length of the gold loss.
        kl_weight: weight of the KD term.
        ce_weight: weight of the student CE term.
        dynamic_scaling: scale the KD term by ``|ce| / |kd|`` (detached).
        exact_token_match_only: only chunks whose two sides cover identical text count.
        teacher_weights: one weight per teacher (default: one teacher, weight 1).
        teacher_vocab_size: true teacher vocab (int, or one per teacher); wider teacher logits
            (lm_head padding) are sliced to it. None: the logits' width.
        backend: the KD engine: "reference" (PyTorch, any dtype), "kernel" (the Triton
            kernels where they run: CUDA or ``TRITON_INTERPRET=1``, fp32/bf16/fp16; the
            reference elsewhere) or "auto" (the kernels on CUDA, else the reference).
        check_inputs: run the cheap input checks (shapes, chunk-id range, finite logits).
    """

    projection: ProjectionSource | Sequence[ProjectionSource] | None = None
    mode: str | None = None
    gold_loss: bool = False
    xtoken_loss: bool = False
    reverse_kl: bool = False
    temperature: float = 1.0
    vocab_topk: int | None = 8192
    topk_columns: str = "valid"
    uncommon_topk: int = 8192
    kl_weight: float = 1.0
    ce_weight: float = 1.0
    dynamic_scaling: bool = False
    exact_token_match_only: bool = False
    teacher_weights: Sequence[float] | None = None
    teacher_vocab_size: int | Sequence[int | None] | None = None
    backend: str = "auto"
    check_inputs: bool = True
    projections: tuple[ProjectionSource, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode is not None:
            if self.mode not in MODES:
                raise ValueError(f"mode={self.mode!r} is unknown; use one of {MODES}")
            want_gold, want_xtoken = self.mode != "pkl", self.mode == "xtoken"
            if (self.gold_loss and not want_gold) or (self.xtoken_loss and not want_xtoken):
                raise ValueError(
                    f"mode={self.mode!r} contradicts gold_loss={self.gold_loss}, "
                    f"xtoken_loss={self.xtoken_loss}; set either mode or the flags"
                )
            self.gold_loss, self.xtoken_loss = want_gold, want_xtoken
        if self.xtoken_loss and not self.gold_loss:
            raise ValueError(
                "xtoken_loss=True needs gold_loss=True (the relaxed map is a gold-loss variant); "
                "set gold_loss=True or mode='xtoken'"
            )
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

        if self.projection is None:
            raise ValueError(
                "projection is required: a file path or an (indices, likelihoods) tensor pair"
            )
        if _is_single_projection(self.projection):
            projections: tuple = (self.projection,)
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
            self.teacher_weights = (1.0,) * len(projections)
        self.teacher_weights = tuple(float(w) for w in self.teacher_weights)
        n = len(self.teacher_weights)
        if n == 0:
            raise ValueError("teacher_weights=() is empty; give one weight per teacher")
        if any(not math.isfinite(w) or w < 0 for w in self.teacher_weights):
            raise ValueError(f"teacher_weights={self.teacher_weights} must be finite and >= 0")
        if len(projections) not in (1, n):
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
    def loss_mode(self) -> str:
        """ "pkl", "gold" or "xtoken"."""
        if not self.gold_loss:
            return "pkl"
        return "xtoken" if self.xtoken_loss else "gold"
