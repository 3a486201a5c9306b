"""The kernel engine: the KD term by each mode's kernel path (:meth:`KDMode.kernel`, the Triton
kernels) and the student CE by :func:`~xtoken_core.losses.fused.student_ce`, launched eagerly.

The chunk bookkeeping of each teacher is one :func:`~xtoken_core.losses.fused.plan_chunks` (two
launches, no host sync). A mode such as P-KL then needs no host value before its kernels are
queued; a mode with :attr:`~xtoken_core.losses.modes.base.KDMode.row_logsumexps` (gold) needs
the valid-chunk count N on the host, read back behind the plans while the GPU makes the row
logsumexps of the logits not done before them (the row sums of every logits tensor are the finite
checks). The input checks are read back after every kernel is queued (the kernels index only with
clamped ids) and raise before the result is returned.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xtoken_core.kernels import logit_rows
from xtoken_core.kernels._utils import queue_mark, read_later
from xtoken_core.losses import fused, reference
from xtoken_core.losses.checks import DeferredChecks
from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.engine import (
    KDResult,
    MetricScales,
    TeacherInputs,
    denominator_name,
    sum_teacher_terms,
)
from xtoken_core.losses.modes.base import KDMode

__all__ = ["KernelEngine"]


class KernelEngine:
    """The KD term by each mode's kernel path and the CE by the row kernels (CUDA, or
    ``TRITON_INTERPRET=1``; fp32/bf16/fp16 logits: :meth:`takes`). Reads its settings from
    ``config`` at each call.

    Args:
        config: the loss settings; with ``backend: auto`` the engine takes CUDA logits only.
        mode: the loss's KD mode.
    """

    def __init__(self, config: CrossTokenizerLossConfig, mode: KDMode) -> None:
        self.config = config
        self.mode = mode
        self.scales = MetricScales(config.num_teachers)

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the kernels run on these logits (:func:`fused.fused_path_available`, and
        CUDA logits under ``backend: auto``).

        Args:
            student_logits_BTV: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            True when every teacher's logits (and the student's) can take the kernels.
        """
        if self.config.backend == "auto" and not student_logits_BTV.is_cuda:
            return False
        return all(fused.fused_path_available(student_logits_BTV, z) for z in teacher_logits)

    def kd(
        self,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[TeacherInputs],
        *,
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
        checks: DeferredChecks | None,
        started: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDResult:
        """See :class:`~xtoken_core.losses.engine.KDEngine`; ``started``: :meth:`start`'s."""
        device = student_logits_BTV.device
        # A mode with row logsumexps (gold): the row logsumexps of every row, whose row sums
        # are the finite checks (one read of each logits tensor for both); made last-dim
        # contiguous once, as the row kernels and the mode's kernels read the same tensors.
        # Gold sizes its buffers by N, read back behind the plans: the student's row
        # logsumexps go first (:meth:`start`: the GPU makes them while the host prepares the
        # teachers and makes the plans), the teachers' after the plans (the GPU makes them
        # while the host waits for N and queues the next kernels).
        counts = None
        teacher_logits = [t.logits_BUW for t in teachers]
        if self.mode.row_logsumexps:
            if started is None:
                started = self.start(student_logits_BTV, checks)
            student_logits_BTV, lse_s = started
            teacher_logits = [fused.last_dim_contiguous(z) for z in teacher_logits]
        elif checks is not None:
            checks.finite("student_logits", student_logits_BTV)
            for t in teachers:
                checks.finite(t.name, t.logits_BUW)
        plans = [self._plan(t, sample_mask_B, device) for t in teachers]
        if self.mode.row_logsumexps:
            planned = queue_mark(device)  # the copy of N waits for this point only
            lse_t = [
                self._row_lse(t.name, z, checks)
                for t, z in zip(teachers, teacher_logits, strict=True)
            ]
            counts = read_later(*(plan.stats_5[4:5] for plan in plans), after=planned)
        # every check's piece is written by here (the plans' id ranges and counts, the row sums)
        checked = None if checks is None else queue_mark(device)
        num_valid = None if counts is None else counts()
        terms = []
        for i, (t, plan) in enumerate(zip(teachers, plans, strict=True)):
            kw = {}
            if self.mode.row_logsumexps:
                kw = dict(num_valid=int(num_valid[i]), row_lse=(lse_s, lse_t[i]))
            terms.append(
                self.mode.kernel(student_logits_BTV, teacher_logits[i], plan, t.projection, **kw)
            )
        dtype = reference.compute_dtype(student_logits_BTV)
        result = sum_teacher_terms(terms, teachers, chunk_denoms, self.scales, dtype, device)
        if checks is not None:
            # the checks' readback waits for their pieces only, not for the kernels queued
            # since (they index only with clamped ids): queued after the kernels, so that its
            # host work does not delay them; a failed check raises before the result is returned
            for t, plan in zip(teachers, plans, strict=True):
                C = t.alignment.max_chunks
                checks.id_bounds("alignment_student_chunk_id", plan.stats_5[0:2], C)
                checks.id_bounds("alignment_teacher_chunk_id", plan.stats_5[2:4], C)
                if chunk_denoms is not None:
                    name = denominator_name(t, len(teachers))
                    checks.denominator(name, chunk_denoms[t.index : t.index + 1], plan.stats_5[4:5])
            checks.run(after=checked)
        return result

    def start(
        self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """See :class:`~xtoken_core.losses.engine.KDEngine`. A mode with row logsumexps (gold):
        the student's row logsumexps and its finite check, ``(logits, lse_R)`` (the logits
        last-dim contiguous); else (P-KL) None."""
        if not self.mode.row_logsumexps:
            return None
        z = fused.last_dim_contiguous(student_logits_BTV)
        return z, self._row_lse("student_logits", z, checks)

    def ce(
        self,
        student_logits_BTV: torch.Tensor,
        targets: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        started: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :class:`~xtoken_core.losses.engine.KDEngine`: by the CE kernels
        (:func:`~xtoken_core.losses.fused.student_ce`: no fp32 copy of the logits), reusing the
        row logsumexps :meth:`start` made where they are the CE's (``started``: the logits
        last-dim contiguous and their row logsumexps at the temperature, the CE's at
        temperature 1); otherwise the CE kernels make their own (P-KL makes no row
        logsumexps of every row, and gold's at another temperature are not the CE's)."""
        logits, lse_R = student_logits_BTV, None
        if started is not None and self.config.temperature == 1.0:
            logits, lse_R = started
        return fused.student_ce(logits, *targets, lse_R=lse_R)

    def _row_lse(
        self, name: str, logits: torch.Tensor, checks: DeferredChecks | None
    ) -> torch.Tensor:
        """Row logsumexps of ``logits / T`` over every row (the gold kernels'; last dim
        contiguous); with ``checks``, the NaN/inf check of ``logits`` is queued from the same
        read's row sums."""
        rows = logits.shape[0] * logits.shape[1]
        sums_R = None
        if checks is not None:
            sums_R = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse_R = logit_rows.row_logsumexp(logits, None, self.config.temperature, row_sum_R=sums_R)
        if checks is not None:
            checks.finite(name, logits, total=sums_R)
        return lse_R

    def _plan(self, teacher: TeacherInputs, sample_mask_B, device):
        """Shifted ids, validity, N and both sides' rows of one teacher
        (:func:`fused.plan_chunks`); its device stats hold the id ranges the checks read."""
        alignment = teacher.alignment
        return fused.plan_chunks(
            alignment.student_chunk_id,
            alignment.teacher_chunk_id,
            alignment.pair_valid,
            sample_mask_B=sample_mask_B,
            pair_is_correct_BC=alignment.pair_is_correct,
            exact_token_match_only=self.config.exact_token_match_only,
            device=device,
        )
