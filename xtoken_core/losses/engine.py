"""The KD engine seam: what an engine gets (one :class:`TeacherInputs` per teacher), what it
returns (:class:`KDResult`), the steps both engines share, and the reference engine.

An engine computes the KD term of one micro-batch over every teacher, already divided by the
valid-chunk denominators and weighted (docs/design.md, "The loss math"), and the student CE's
sums, and runs the input checks the caller queued together with its own (one host readback). It
may start on the student logits before the teachers are prepared (:meth:`KDEngine.start`). The
per-teacher KD sums are the loss's :class:`~xtoken_core.losses.modes.base.KDMode`'s; an engine
does what every mode shares (chunk ids, validity, checks, the sum over teachers). Three engines:

* :class:`ReferenceEngine` (here): each mode's PyTorch reference and
  :mod:`xtoken_core.losses.reference`, any float dtype (fp64 included), any device.
* :class:`~xtoken_core.losses.kernel_engine.KernelEngine`: each mode's kernel path (the Triton
  kernels: CUDA, or ``TRITON_INTERPRET=1``) for fp32/bf16/fp16 logits.
* :class:`~xtoken_core.losses.cpu_engine.CpuEngine`: each mode's CPU path
  (:mod:`xtoken_core.losses.cpu`) for fp32/bf16/fp16 CPU logits, with the reference engine's
  steps around it.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab, C chunk slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from xtoken_core.data.projection import Projection
from xtoken_core.losses import reference
from xtoken_core.losses.checks import DeferredChecks
from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.modes.base import KDMode, KDTerms
from xtoken_core.losses.utils import AlignmentView, check_chunk_ids, shift_chunk_ids

__all__ = [
    "KDEngine",
    "KDResult",
    "MetricScales",
    "ReferenceEngine",
    "TeacherInputs",
    "check_alignment_shapes",
    "denominator_name",
    "sum_teacher_terms",
    "valid_chunks",
]


@dataclass(frozen=True)
class TeacherInputs:
    """One teacher's inputs to an engine.

    Attributes:
        index: the teacher's position (its weight, denominator and projection).
        name: how messages name its logits ("teacher_logits" or "teacher_logits[i]").
        logits_BUW: ``[B, U, W]`` logits sliced to the teacher vocab (constants).
        alignment: its alignment (raw, unshifted chunk ids).
        projection: its :class:`~xtoken_core.data.projection.Projection` on the logits' device,
            checked against V and W.
        weight: its weight in the sum over teachers.
    """

    index: int
    name: str
    logits_BUW: torch.Tensor
    alignment: AlignmentView
    projection: Projection
    weight: float

    @property
    def vocab_size(self) -> int:
        """W, the teacher logits' width."""
        return int(self.logits_BUW.shape[-1])


@dataclass(frozen=True)
class KDResult:
    """The KD term of a micro-batch, summed over teachers.

    Attributes:
        kd: scalar KD term (weighted, divided by the denominators; gradient to the student).
        metrics_4: detached ``(kl_common, l1_uncommon, proj_accuracy, num_valid_chunks)``, each
            already divided as :data:`~xtoken_core.losses.loss.METRIC_KEYS` says.
    """

    kd: torch.Tensor
    metrics_4: torch.Tensor


class KDEngine(Protocol):
    """What :class:`~xtoken_core.losses.loss.CrossTokenizerLoss` calls: :meth:`takes` to know
    whether the engine runs on a call's logits, :meth:`start` first, then :meth:`kd` and
    :meth:`ce` with what it returned."""

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the engine runs on these logits (the loss falls back to the reference
        engine for a call it does not)."""
        ...

    def start(self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None) -> Any:
        """Queue the work that needs the student logits alone (called before the teachers
        are prepared, so that the GPU starts while the host prepares them); the result goes
        to :meth:`kd` as ``started`` (None: nothing queued)."""
        ...

    def kd(
        self,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[TeacherInputs],
        *,
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
        checks: DeferredChecks | None,
        started: Any = None,
    ) -> KDResult:
        """The KD term. The engine queues the checks of the logits and the alignment in
        ``checks``; every check queued there (the caller's too) has been read back, and raised
        on bad input, before it returns."""
        ...

    def ce(
        self,
        student_logits_BTV: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        started: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The student CE's ``(nll_sum, correct, num_tokens)`` of ``targets`` = ``(input_ids,
        token_mask, sample_mask)`` (on the logits' device)."""
        ...


class MetricScales:
    """``(coef_5, bias_5)`` with ``sums_5 * (coef_5 / denom + bias_5)`` the scaled sums
    ``(kd, kl, l1, correct, num_valid)`` of one teacher, kept per device (no host-to-device copy
    per call).

    Args:
        num_teachers: the count the accuracy and chunk count are averaged over.
    """

    def __init__(self, num_teachers: int) -> None:
        self.num_teachers = num_teachers
        self._kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, weight: float, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The constants of a teacher of weight ``weight``.

        Args:
            weight: the teacher's weight.
            dtype: the compute dtype.
            device: the logits' device.

        Returns:
            ``(coef_5, bias_5)``.
        """
        key = (weight, dtype, device)
        if key not in self._kept:
            per_teacher = 1.0 / self.num_teachers
            self._kept[key] = (
                torch.tensor([weight] * 3 + [per_teacher, 0.0], dtype=dtype, device=device),
                torch.tensor([0.0] * 4 + [per_teacher], dtype=dtype, device=device),
            )
        return self._kept[key]


def sum_teacher_terms(
    terms: Sequence[KDTerms],
    teachers: Sequence[TeacherInputs],
    chunk_denoms: torch.Tensor | None,
    scales: MetricScales,
    dtype: torch.dtype,
    device: torch.device,
) -> KDResult:
    """Weight and divide each teacher's sums, and add them up.

    Args:
        terms: one :class:`~xtoken_core.losses.modes.base.KDTerms` per teacher (sums over its
            valid chunks).
        teachers: the teachers, in the same order.
        chunk_denoms: ``[n]`` global valid-chunk counts, or None (each teacher's own count).
        scales: the loss's :class:`MetricScales`.
        dtype: the compute dtype.
        device: the logits' device.

    Returns:
        The :class:`KDResult`.
    """
    kd, acc_5 = None, None
    for t, terms_t in zip(teachers, terms, strict=True):
        denom = terms_t.num_valid if chunk_denoms is None else chunk_denoms[t.index]
        # five sums updated in three launches: [kd, kl, l1] * w / d, correct / d / n_t,
        # num_valid / n_t; the metrics are detached, the gradient takes one multiply
        coef_5, bias_5 = scales(t.weight, dtype, device)
        scale_5 = torch.addcdiv(bias_5, coef_5, denom.to(dtype).clamp_min(1))
        sums_5 = torch.stack(
            [terms_t.kd.detach(), terms_t.kl, terms_t.l1, terms_t.correct, terms_t.num_valid]
        )
        scaled_5 = sums_5.to(dtype) * scale_5
        kd_t = terms_t.kd.to(dtype) * scale_5[0]
        acc_5 = scaled_5 if acc_5 is None else acc_5 + scaled_5
        kd = kd_t if kd is None else kd + kd_t
    return KDResult(kd=kd, metrics_4=acc_5[1:])


def check_alignment_shapes(alignment: AlignmentView, B: int, T: int, U: int | None) -> None:
    """The cheap shape checks of one teacher's alignment against the logits.

    Args:
        alignment: the teacher's alignment.
        B: batch size.
        T: student tokens.
        U: teacher tokens (None: not checked).

    Raises:
        ValueError: a field whose shape does not fit the logits, naming it.
    """
    C = alignment.max_chunks
    s_ids, t_ids = alignment.student_chunk_id, alignment.teacher_chunk_id
    if alignment.pair_valid.dim() != 2 or alignment.pair_valid.shape[0] != B or C < 1:
        raise ValueError(
            f"alignment_pair_valid is {tuple(alignment.pair_valid.shape)}, expected "
            f"[{B}, C] with C >= 1"
        )
    if tuple(s_ids.shape) != (B, T):
        raise ValueError(
            f"alignment_student_chunk_id is {tuple(s_ids.shape)} but the student logits "
            f"are [{B}, {T}, V]; the alignment must come from the same batch"
        )
    if t_ids.dim() != 2 or t_ids.shape[0] != B or (U is not None and t_ids.shape[1] != U):
        raise ValueError(
            f"alignment_teacher_chunk_id is {tuple(t_ids.shape)} but the teacher logits "
            f"are [{B}, {U}, W]; the alignment must come from the same batch"
        )
    if (
        alignment.pair_is_correct is not None
        and alignment.pair_is_correct.shape != alignment.pair_valid.shape
    ):
        raise ValueError(
            f"alignment_pair_is_correct is {tuple(alignment.pair_is_correct.shape)}, "
            f"expected {tuple(alignment.pair_valid.shape)} like alignment_pair_valid"
        )


def valid_chunks(
    alignment: AlignmentView,
    config: CrossTokenizerLossConfig,
    sample_mask_B: torch.Tensor | None,
    checks: DeferredChecks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shifted chunk ids and the valid chunks of one teacher (shapes checked already:
    :func:`check_alignment_shapes`).

    Args:
        alignment: the teacher's alignment.
        config: the loss settings (``check_inputs``, ``exact_token_match_only``).
        sample_mask_B: [B] or None.
        checks: where the id-range checks are queued (the ids are clamped so that nothing
            indexes out of bounds before they run); None: checked here (a host sync).

    Returns:
        ``(student_chunk_id_BT, teacher_chunk_id_BU, valid_BC)``: the shifted ids and the
        validity of :func:`~xtoken_core.losses.reference.chunk_validity`.

    Raises:
        ValueError: (without ``checks``) ids out of range.
    """
    C = alignment.max_chunks
    s_ids, t_ids = alignment.student_chunk_id, alignment.teacher_chunk_id
    if config.check_inputs:
        if checks is None:
            check_chunk_ids("alignment_student_chunk_id", s_ids, C)
            check_chunk_ids("alignment_teacher_chunk_id", t_ids, C)
        else:
            checks.id_range("alignment_student_chunk_id", s_ids, C)
            checks.id_range("alignment_teacher_chunk_id", t_ids, C)
            s_ids, t_ids = s_ids.clamp(-1, C - 1), t_ids.clamp(-1, C - 1)
    s_ids, t_ids = shift_chunk_ids(s_ids), shift_chunk_ids(t_ids)
    valid_BC = reference.chunk_validity(
        s_ids,
        t_ids,
        alignment.pair_valid,
        sample_mask_B=sample_mask_B,
        pair_is_correct_BC=alignment.pair_is_correct,
        exact_token_match_only=config.exact_token_match_only,
    )
    return s_ids, t_ids, valid_BC


class ReferenceEngine:
    """The KD term by each mode's PyTorch reference (:meth:`KDMode.reference`) and the CE by
    :func:`~xtoken_core.losses.reference.student_ce_loss`: any float dtype (computed in fp32,
    fp64 kept), any device.

    Args:
        config: the loss settings.
        mode: the loss's KD mode.
    """

    def __init__(self, config: CrossTokenizerLossConfig, mode: KDMode) -> None:
        self.config = config
        self.mode = mode
        self.scales = MetricScales(config.num_teachers)

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """See :class:`KDEngine`: every call."""
        return True

    def start(self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None) -> None:
        """See :class:`KDEngine`: nothing to queue ahead."""
        return None

    def kd(
        self,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[TeacherInputs],
        *,
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
        checks: DeferredChecks | None,
        started: Any = None,
    ) -> KDResult:
        """See :class:`KDEngine`: the checks are read back before any KD term is computed."""
        cfg = self.config
        device = student_logits_BTV.device
        dtype = reference.compute_dtype(student_logits_BTV)
        if checks is not None:
            checks.finite("student_logits", student_logits_BTV)
        prepared = []
        for t in teachers:
            if checks is not None:
                checks.finite(t.name, t.logits_BUW)
            ids = valid_chunks(t.alignment, cfg, sample_mask_B, checks)
            prepared.append(tuple(x.to(device) for x in ids))
        if checks is not None:
            if chunk_denoms is not None:
                for t, (_, _, valid_BC) in zip(teachers, prepared, strict=True):
                    checks.denominator(
                        denominator_name(t, len(teachers)),
                        chunk_denoms[t.index : t.index + 1],
                        valid_BC.sum(),
                    )
            checks.run()
        terms = [
            self._terms(student_logits_BTV, t, s_ids, t_ids, valid_BC, started)
            for t, (s_ids, t_ids, valid_BC) in zip(teachers, prepared, strict=True)
        ]
        return sum_teacher_terms(terms, teachers, chunk_denoms, self.scales, dtype, device)

    def _terms(self, student_logits_BTV, teacher, s_ids, t_ids, valid_BC, started) -> KDTerms:
        """One teacher's KD sums: the mode's reference."""
        return self.mode.reference(
            student_logits_BTV, teacher.logits_BUW, s_ids, t_ids, valid_BC, teacher.projection
        )

    def ce(
        self,
        student_logits_BTV: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        started: None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`KDEngine`."""
        return reference.student_ce_loss(student_logits_BTV, *targets)


def denominator_name(teacher: TeacherInputs, num_teachers: int) -> str:
    """How the checks name a teacher's global valid-chunk count."""
    return "global_valid_chunks" + ("" if num_teachers == 1 else f"[{teacher.index}]")
