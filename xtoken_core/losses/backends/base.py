"""The seam of a loss backend: what a backend does for one micro-batch (:class:`Backend`), what it
returns (:class:`KDResult`) and the sum over teachers every backend ends with.

A backend computes the KD term of one micro-batch over every teacher, already divided by the
valid-chunk denominators and weighted (docs/design.md, "The loss math"), and the student CE's
sums, and runs the input checks the caller queued together with its own (one host readback). It
may start on the student logits before the teachers are prepared (:meth:`Backend.start`). The
per-teacher KD sums are the loss's :class:`~xtoken_core.losses.modes.base.KDMode`'s: a backend
calls one of the mode's paths on a :class:`~xtoken_core.losses.inputs.LossInputs` per teacher and
does what every mode shares (chunk ids, validity, checks, the sum over teachers).

Legend (shape suffixes in this file):
    B batch, T student tokens, V student vocab, U teacher tokens, W teacher vocab, N teachers,
    R rows of a teacher's scaled sums (its share of the totals; its own, with several teachers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xtoken_core.losses.checks import DeferredChecks
    from xtoken_core.losses.config import CrossTokenizerLossConfig
    from xtoken_core.losses.inputs import TeacherInputs
    from xtoken_core.losses.modes.base import KDMode, KDTerms

__all__ = ["Backend", "KDResult", "MetricScales", "sum_teacher_terms"]


@dataclass(frozen=True)
class KDResult:
    """The KD term of a micro-batch, summed over teachers.

    Attributes:
        kd: scalar KD term (weighted, divided by the denominators; gradient to the student).
        metrics_4: detached ``(kl_common, l1_uncommon, proj_accuracy, num_valid_chunks)``, each
            already divided as :data:`~xtoken_core.losses.loss.METRIC_KEYS` says.
        teachers_N5: with several teachers, detached ``[num_teachers, 5]``: each teacher's own
            ``(kd, kl_common, l1_uncommon, proj_accuracy, num_valid_chunks)``, unweighted, the
            first four divided by that teacher's denominator, the last its local count
            (:func:`~xtoken_core.losses.loss.teacher_metric_keys`); None with one teacher.
    """

    kd: torch.Tensor
    metrics_4: torch.Tensor
    teachers_N5: torch.Tensor | None = None


class Backend(ABC):
    """What :class:`~xtoken_core.losses.loss.CrossTokenizerLoss` calls on the backend it chose
    when it was built: :meth:`takes` to know whether a call's logits can run there, :meth:`start`
    first, then :meth:`kd` and :meth:`ce` with what it returned.

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
        """Whether the backend runs on these logits (the loss gives a call it does not take to
        the reference backend); here: every call."""
        return True

    def start(self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None) -> Any:
        """Queue the work that needs the student logits alone (called before the teachers
        are prepared, so that the GPU starts while the host prepares them); the result goes
        to :meth:`kd` and :meth:`ce` as ``started``. Here: nothing (None)."""
        return None

    @abstractmethod
    def kd(
        self, student_logits_BTV: torch.Tensor, teachers: Sequence[TeacherInputs], checks, started
    ) -> KDResult:
        """The KD term of ``student_logits_BTV`` against every teacher. The backend queues the
        checks of the logits and the alignment in ``checks`` (a
        :class:`~xtoken_core.losses.checks.DeferredChecks`, or None: no checks); every check
        queued there (the caller's too) has been read back, and raised on bad input, before it
        returns. ``started``: what :meth:`start` returned."""

    @abstractmethod
    def ce(self, student_logits_BTV: torch.Tensor, targets: tuple, started: Any) -> tuple:
        """The student CE's ``(nll_sum, correct, num_tokens)`` of ``targets`` = ``(input_ids_BT,
        token_mask_BT, sample_mask_B)`` (on the logits' device; the masks may be None)."""

    @abstractmethod
    def column_max(self, logits_BUW: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
        """``[W]`` column-wise max of the rows with ``rows_R >= 0`` (-inf where none): the
        max-logits that pick P-KL's teacher columns (fp32 from the kernels, else the logits'
        dtype)."""


class MetricScales:
    """``(coef_R5, bias_R5)`` with ``sums_5 * (coef_R5 / denom + bias_R5)`` the scaled sums
    ``(kd, kl, l1, correct, num_valid)`` of one teacher, kept per device (no host-to-device copy
    per call). Row 0 is the teacher's share of the totals (``kd, kl, l1`` weighted, the accuracy
    and the chunk count averaged over the teachers); with several teachers, row 1 is the
    teacher's own figures (unweighted, over its own denominator; its own chunk count).

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
            ``(coef_R5, bias_R5)``, R = 1 with one teacher, else 2.
        """
        key = (weight, dtype, device)
        if key not in self._kept:
            per_teacher = 1.0 / self.num_teachers
            coef = [[weight] * 3 + [per_teacher, 0.0]]
            bias = [[0.0] * 4 + [per_teacher]]
            if self.num_teachers > 1:
                coef.append([1.0] * 4 + [0.0])
                bias.append([0.0] * 4 + [1.0])
            self._kept[key] = (
                torch.tensor(coef, dtype=dtype, device=device),
                torch.tensor(bias, dtype=dtype, device=device),
            )
        return self._kept[key]


def sum_teacher_terms(
    terms: Sequence[KDTerms],
    teachers: Sequence[TeacherInputs],
    scales: MetricScales,
    dtype: torch.dtype,
    device: torch.device,
) -> KDResult:
    """Weight and divide each teacher's sums, and add them up; with several teachers, also
    each teacher's own figures (:attr:`KDResult.teachers_N5`), made by the same launches (no
    host sync).

    Args:
        terms: one :class:`~xtoken_core.losses.modes.base.KDTerms` per teacher (sums over its
            valid chunks).
        teachers: the teachers, in the same order (their weights and denominators).
        scales: the backend's :class:`MetricScales`.
        dtype: the compute dtype.
        device: the logits' device.

    Returns:
        The :class:`KDResult`.
    """
    kd, scaled = None, []
    for t, terms_t in zip(teachers, terms, strict=True):
        denom = terms_t.num_valid if t.denominator_1 is None else t.denominator_1
        # five sums scaled in three launches: row 0 [kd, kl, l1] * w / d, correct / d / n_t,
        # num_valid / n_t; row 1 (several teachers) [kd, kl, l1, correct] / d, num_valid; the
        # metrics are detached, the gradient takes one multiply
        coef_R5, bias_R5 = scales(t.weight, dtype, device)
        scale_R5 = torch.addcdiv(bias_R5, coef_R5, denom.to(dtype).clamp_min(1))
        sums_5 = torch.stack(
            [terms_t.kd.detach(), terms_t.kl, terms_t.l1, terms_t.correct, terms_t.num_valid]
        )
        scaled.append(sums_5.to(dtype) * scale_R5)
        kd_t = terms_t.kd.to(dtype) * scale_R5[0, 0]
        kd = kd_t if kd is None else kd + kd_t
    if len(scaled) == 1:
        return KDResult(kd=kd, metrics_4=scaled[0][0, 1:])
    scaled_N25 = torch.stack(scaled)  # the totals and every teacher's own in two launches
    return KDResult(kd=kd, metrics_4=scaled_N25[:, 0, 1:].sum(0), teachers_N5=scaled_N25[:, 1])
