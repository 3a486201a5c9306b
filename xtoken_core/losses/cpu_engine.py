"""The CPU engine: the KD term by each mode's CPU path (:meth:`KDMode.cpu`, the reference's
math with fewer passes over the logits: :mod:`xtoken_core.losses.cpu`) and the student CE by
:func:`~xtoken_core.losses.cpu.student_ce`, around the reference engine's steps (chunk ids,
validity, the input checks read back before any term, the sum over teachers).

:meth:`CpuEngine.start` gives the call one :class:`~xtoken_core.losses.cpu.RowStats`: each
row's logsumexp is made once per temperature and shared, so at temperature 1 the KD term and
the CE read the logits' exponentials once in the forward.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xtoken_core.losses import cpu
from xtoken_core.losses.checks import DeferredChecks
from xtoken_core.losses.engine import ReferenceEngine, TeacherInputs
from xtoken_core.losses.modes.base import KDTerms

__all__ = ["CpuEngine"]


class CpuEngine(ReferenceEngine):
    """The KD term by each mode's CPU path and the CE by the CPU path's
    (:mod:`xtoken_core.losses.cpu`); CPU logits in fp32/bf16/fp16 (:meth:`takes`).

    Args:
        config: the loss settings.
        mode: the loss's KD mode.
    """

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the CPU path runs on these logits (:func:`cpu.cpu_path_available`: every
        tensor on the CPU, fp32/bf16/fp16; fp64 takes the reference).

        Args:
            student_logits_BTV: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            True when the student's and every teacher's logits can take the CPU path.
        """
        return cpu.cpu_path_available(student_logits_BTV, *teacher_logits)

    def start(self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None):
        """See :class:`~xtoken_core.losses.engine.KDEngine`: the call's
        :class:`~xtoken_core.losses.cpu.RowStats` (made lazily, shared by :meth:`kd` and
        :meth:`ce`)."""
        return cpu.RowStats(student_logits_BTV)

    def _terms(self, student_logits_BTV, teacher, s_ids, t_ids, valid_BC, started) -> KDTerms:
        """One teacher's KD sums: the mode's CPU path."""
        return self.mode.cpu(
            student_logits_BTV,
            teacher.logits_BUW,
            s_ids,
            t_ids,
            valid_BC,
            teacher.projection,
            stats=started,
        )

    def kd(
        self,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[TeacherInputs],
        *,
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
        checks: DeferredChecks | None,
        started: cpu.RowStats | None = None,
    ):
        """See :class:`~xtoken_core.losses.engine.KDEngine` (the reference engine's steps)."""
        return super().kd(
            student_logits_BTV,
            teachers,
            sample_mask_B=sample_mask_B,
            chunk_denoms=chunk_denoms,
            checks=checks,
            started=started or cpu.RowStats(student_logits_BTV),
        )

    def ce(
        self,
        student_logits_BTV: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        started: cpu.RowStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`~xtoken_core.losses.engine.KDEngine`: :func:`cpu.student_ce`."""
        return cpu.student_ce(student_logits_BTV, *targets, stats=started)
