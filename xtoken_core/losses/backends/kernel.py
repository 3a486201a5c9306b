"""The kernel backend: the KD term by each mode's kernel path (:meth:`KDMode.kernel`, the Triton
kernels of :mod:`xtoken_core.kernels`) and the student CE by the row kernels
(:mod:`xtoken_core.kernels.row_ce`), launched eagerly, with the plumbing every kernel path shares.

The Triton kernels read the logits directly (fp32/bf16/fp16; CUDA, or ``TRITON_INTERPRET=1``:
:func:`kernels_run_on`) and keep one fp32 scalar per row; only valid chunks are computed
(compact ``[N, ...]``), and only the columns the loss uses. The chunk bookkeeping of each teacher
(shifted ids, validity, N, both sides' row groups) is one chunk plan
(:func:`xtoken_core.kernels.chunk_plan.plan_chunks`: two launches, no host sync); a mode's
kernel path starts from :func:`kernel_inputs`. A mode such as P-KL then needs no host value
before its kernels are queued; a mode with
:attr:`~xtoken_core.losses.modes.base.KDMode.row_logsumexps` (gold) needs the valid-chunk count N
on the host, read back behind the plans while the GPU makes the row logsumexps of the logits not
done before them (the row sums of every logits tensor are the finite checks). The input checks
are read back after every kernel is queued (the kernels index only with clamped ids) and raise
before the result is returned. The student's CE: each row's logsumexp, target logit and argmax on
the logits in their own dtype, reusing gold's row logsumexps at temperature 1.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, N valid chunks, R rows (B*T or B*U).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from xtoken_core.kernels import chunk_plan, logit_rows, row_ce
from xtoken_core.kernels._utils import queue_mark, read_later
from xtoken_core.losses.alignment import ChunkRows, chunk_rows, valid_chunk_numbering
from xtoken_core.losses.backends.base import Backend, KDResult, sum_teacher_terms
from xtoken_core.losses.backends.reference import compute_dtype
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.sparse_teacher import SparseTeacher

if TYPE_CHECKING:
    from xtoken_core.losses.checks import DeferredChecks
    from xtoken_core.losses.inputs import TeacherInputs

__all__ = [
    "KERNEL_DTYPES",
    "KernelBackend",
    "kernel_inputs",
    "kernels_run_on",
    "last_dim_contiguous",
]

#: Logit dtypes the kernels read (fp64 stays on the reference, the gradcheck ground truth).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernels_run_on(*logits: torch.Tensor) -> bool:
    """Whether the kernels run on these logits.

    Args:
        *logits: the student's and the teachers' logits.

    Returns:
        True when Triton runs on the first (CUDA, or ``TRITON_INTERPRET=1``) and every one is
        fp32/bf16/fp16.
    """
    return logit_rows.use_triton(logits[0]) and all(z.dtype in KERNEL_DTYPES for z in logits)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (what the kernels need), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class KernelBackend(Backend):
    """The KD term by each mode's kernel path and the CE by the row kernels (CUDA, or
    ``TRITON_INTERPRET=1``; fp32/bf16/fp16 logits: :meth:`takes`). Reads its settings from
    ``config`` at each call.

    Args:
        config: the loss settings; with ``backend: auto`` the backend takes CUDA logits only.
        mode: the loss's KD mode.
    """

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the kernels run on these logits (:func:`kernels_run_on`, and CUDA logits
        under ``backend: auto``).

        Args:
            student_logits_BTV: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            True when every teacher's logits (and the student's) can take the kernels.
        """
        if self.config.backend == "auto" and not student_logits_BTV.is_cuda:
            return False
        return kernels_run_on(student_logits_BTV, *teacher_logits)

    def kd(
        self, student_logits_BTV: torch.Tensor, teachers: Sequence[TeacherInputs], checks, started
    ) -> KDResult:
        """See :class:`Backend`; ``started``: :meth:`start`'s (None: made here)."""
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
            teacher_logits = [last_dim_contiguous(z) for z in teacher_logits]
        elif checks is not None:
            checks.finite("student_logits", student_logits_BTV)
            for t in teachers:
                checks.finite(t.name, t.logits_BUW)
        plans = [self._plan(t, device) for t in teachers]
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
            inputs = LossInputs.planned(student_logits_BTV, teacher_logits[i], plan)
            terms.append(self.mode.kernel(inputs, t.projection, plan=plan, **kw))
        dtype = compute_dtype(student_logits_BTV)
        result = sum_teacher_terms(terms, teachers, self.scales, dtype, device)
        if checks is not None:
            # the checks' readback waits for their pieces only, not for the kernels queued
            # since (they index only with clamped ids): queued after the kernels, so that its
            # host work does not delay them; a failed check raises before the result is returned
            for t, plan in zip(teachers, plans, strict=True):
                C = t.alignment.max_chunks
                checks.id_bounds("alignment_student_chunk_id", plan.stats_5[0:2], C)
                checks.id_bounds("alignment_teacher_chunk_id", plan.stats_5[2:4], C)
                if t.denominator_1 is not None:
                    checks.denominator(t.denominator_name, t.denominator_1, plan.stats_5[4:5])
            checks.run(after=checked)
        return result

    def start(
        self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """See :class:`Backend`. A mode with row logsumexps (gold): the student's row
        logsumexps and its finite check, ``(logits, lse_R)`` (the logits last-dim contiguous);
        else (P-KL) None."""
        if not self.mode.row_logsumexps:
            return None
        z = last_dim_contiguous(student_logits_BTV)
        return z, self._row_lse("student_logits", z, checks)

    def ce(self, student_logits_BTV: torch.Tensor, targets: tuple, started: Any = None) -> tuple:
        """See :class:`Backend`: by the CE kernels (:func:`row_ce.row_cross_entropy`: no fp32
        copy of the logits, no log-softmax), reusing the row logsumexps :meth:`start` made where
        they are the CE's (``started``: the logits last-dim contiguous and their row logsumexps
        at the temperature, the CE's at temperature 1); otherwise the CE kernels make their own
        (P-KL makes no row logsumexps of every row, and gold's at another temperature are not
        the CE's)."""
        logits, lse_R = student_logits_BTV, None
        if started is not None and self.config.temperature == 1.0:
            logits, lse_R = started
        return row_ce.row_cross_entropy(logits, *targets, lse_R=lse_R)

    def column_max(self, logits_BUW: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
        """See :class:`Backend`: :func:`~xtoken_core.kernels.logit_rows.column_max`."""
        return logit_rows.column_max(last_dim_contiguous(logits_BUW), rows_R)

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

    def _plan(self, teacher: TeacherInputs, device: torch.device) -> chunk_plan.ChunkPlan:
        """Shifted ids, validity, N and both sides' rows of one teacher, on ``device``
        (:func:`xtoken_core.kernels.chunk_plan.plan_chunks`, which moves every other input to
        the student ids' device); its device stats hold the id ranges the checks read."""
        alignment = teacher.alignment
        return chunk_plan.plan_chunks(
            alignment.student_chunk_id.to(device),
            alignment.teacher_chunk_id,
            alignment.pair_valid,
            sample_mask_B=teacher.sample_mask_B,
            pair_is_correct_BC=alignment.pair_is_correct,
            exact_token_match_only=self.config.exact_token_match_only,
        )


def kernel_inputs(
    inputs: LossInputs,
    num_valid: int | None,
    plan: chunk_plan.ChunkPlan | None = None,
    device_n: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None, ChunkRows, ChunkRows]:
    """Kernel-ready logits, ``valid_BC`` on their device, N, rows per side: what a mode's kernel
    path starts from.

    With a ``plan`` (:func:`xtoken_core.kernels.chunk_plan.plan_chunks` of these ids) the rows
    are its; else they are grouped here, with one valid-chunk numbering shared by both sides. N
    is ``num_valid`` when the caller read it already, else read here (one host sync); with
    ``device_n`` and a plan it stays on the device (N is None, the rows cover every chunk slot,
    ``plan.stats_5[4]`` holds N).

    Args:
        inputs: the teacher's :class:`~xtoken_core.losses.inputs.LossInputs`.
        num_valid: N when the caller read it already, else None.
        plan: the chunk plan of this batch, or None.
        device_n: keep N on the device (with a plan).

    Returns:
        ``(zs_BTV, zt_BUW, valid_BC, N, student_rows, teacher_rows)``.
    """
    zs_BTV = last_dim_contiguous(inputs.student_logits_BTV)
    zt_BUW = inputs.teacher_logits_BUW.detach()
    if not isinstance(zt_BUW, SparseTeacher):  # top-K targets: the mode reads its columns
        zt_BUW = last_dim_contiguous(zt_BUW)
    if plan is not None:
        if device_n:
            s_rows, t_rows = ChunkRows(*plan.rows(0, None)), ChunkRows(*plan.rows(1, None))
            return zs_BTV, zt_BUW, plan.valid_BC, None, s_rows, t_rows
        N = int(plan.stats_5[4]) if num_valid is None else int(num_valid)
        s_rows, t_rows = ChunkRows(*plan.rows(0, N)), ChunkRows(*plan.rows(1, N))
        return zs_BTV, zt_BUW, plan.valid_BC, N, s_rows, t_rows
    valid_BC = inputs.valid_BC.to(zs_BTV.device)
    N = int(valid_BC.sum()) if num_valid is None else int(num_valid)
    segmap_S = valid_chunk_numbering(valid_BC)
    t_rows = chunk_rows(inputs.teacher_chunk_id_BU, valid_BC, N, segmap_S)
    s_rows = chunk_rows(inputs.student_chunk_id_BT, valid_BC, N, segmap_S)
    return zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows
