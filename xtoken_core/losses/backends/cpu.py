"""The CPU backend: each mode's CPU path (:meth:`KDMode.cpu`) and the student CE for CPU logits,
the reference's math with fewer passes over the ``[B, T, V]`` logits and no full-size fp32
copies of them, around the reference backend's steps (chunk ids, validity, the input checks read
back before any term, the sum over teachers).

On a CPU the step is bound by memory traffic and by ``exp`` over the student vocabulary
(V = 151,669 for Qwen3): the reference writes several ``[B, T, V]`` fp32 tensors per call
(the upcast, ``z / T``, the softmax, the log-softmax, their gradients, the CE's slice). The CPU
path reads the logits in blocks of rows that stay in the cache while they are reused:

* :func:`row_stats`: each row's logsumexp of ``z / T`` and its max, one read of the logits
  (:func:`argmax_is` then tells whether a column is the row's argmax);
* :func:`write_softmax_grad`: ``dz[r] = coef[r] * softmax(z[r] / T)``, one read and one write,
  the only full-size tensor of a backward (a mode adds its few sparse columns on top);
* :func:`student_ce`: the student CE from the row logsumexps and the target logits.

:meth:`CpuBackend.start` gives the call one :class:`RowStats`: each row's logsumexp is made once
per temperature and shared, so at temperature 1 the KD term and the CE read the logits'
exponentials once in the forward. A mode's CPU path (P-KL's ``cpu_kd_loss``) builds on these
pieces; a mode without one runs its reference. The results equal the reference's within float
rounding (tests/xtoken_core/losses/test_cpu.py and tests/xtoken_core/losses/modes/test_cpu_paths.py).

Legend (shape suffixes in this file):
    B batch, T student tokens, V student vocab, R rows (``B*T``), A the rows a call reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from xtoken_core.losses.backends.reference import ReferenceBackend, ce_targets, compute_dtype

if TYPE_CHECKING:
    from xtoken_core.losses.checks import DeferredChecks
    from xtoken_core.losses.inputs import LossInputs, TeacherInputs
    from xtoken_core.losses.modes.base import KDTerms

__all__ = [
    "BLOCK_ELEMENTS",
    "CPU_DTYPES",
    "CpuBackend",
    "RowStats",
    "cpu_path_available",
    "grad_buffer",
    "row_slices",
    "argmax_is",
    "row_stats",
    "student_ce",
    "write_softmax_grad",
]

#: Logit dtypes the CPU path takes (fp64 stays on the reference, the gradcheck ground truth).
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Elements of one block of rows (8 MiB in fp32): a block is read, scaled and exponentiated
#: while it is in the cache, instead of in ``[B, T, V]`` temporaries.
BLOCK_ELEMENTS = 1 << 21


def cpu_path_available(*logits: torch.Tensor) -> bool:
    """Whether the CPU path takes these logits: every tensor on the CPU, fp32/bf16/fp16.

    Args:
        *logits: the student's and the teachers' logits.

    Returns:
        True when all of them are CPU tensors of a :data:`CPU_DTYPES` dtype.
    """
    return all(z.device.type == "cpu" and z.dtype in CPU_DTYPES for z in logits)


class CpuBackend(ReferenceBackend):
    """The KD term by each mode's CPU path and the CE by :func:`student_ce`; CPU logits in
    fp32/bf16/fp16 (:meth:`takes`), the reference backend's steps around them.

    Args:
        config: the loss settings.
        mode: the loss's KD mode.
    """

    def takes(
        self, student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the CPU path runs on these logits (:func:`cpu_path_available`: every tensor
        on the CPU, fp32/bf16/fp16; fp64 takes the reference).

        Args:
            student_logits_BTV: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            True when the student's and every teacher's logits can take the CPU path.
        """
        return cpu_path_available(student_logits_BTV, *teacher_logits)

    def start(self, student_logits_BTV: torch.Tensor, checks: DeferredChecks | None) -> RowStats:
        """See :class:`~xtoken_core.losses.backends.base.Backend`: the call's :class:`RowStats`
        (made lazily, shared by :meth:`kd` and :meth:`ce`)."""
        return RowStats(student_logits_BTV)

    def _terms(self, inputs: LossInputs, teacher: TeacherInputs, started: Any) -> KDTerms:
        """One teacher's KD sums: the mode's CPU path."""
        return self.mode.cpu(inputs, teacher.projection, stats=started)

    def ce(self, student_logits_BTV: torch.Tensor, targets: tuple, started: Any = None) -> tuple:
        """See :class:`~xtoken_core.losses.backends.base.Backend`: :func:`student_ce`."""
        return student_ce(student_logits_BTV, *targets, stats=started)


def row_slices(rows_A: torch.Tensor, width: int) -> list[tuple[int, int, int]]:
    """Sorted distinct rows as slices of consecutive rows of at most :data:`BLOCK_ELEMENTS`
    elements: the blocks the CPU path reads and writes in place (views, no gather).

    Args:
        rows_A: int64 [A] sorted distinct row ids.
        width: elements per row (V).

    Returns:
        ``(r0, r1, a0)`` per block: rows ``r0:r1``, which are ``rows_A[a0 : a0 + r1 - r0]``.
    """
    if rows_A.numel() == 0:
        return []
    step = max(1, BLOCK_ELEMENTS // max(width, 1))
    breaks = (torch.nonzero(rows_A[1:] != rows_A[:-1] + 1).reshape(-1) + 1).tolist()
    firsts = rows_A[[0, *breaks]].tolist()
    ends = [*breaks, rows_A.numel()]
    out, a0 = [], 0
    for first, a_end in zip(firsts, ends, strict=True):
        for a in range(a0, a_end, step):
            n = min(step, a_end - a)
            out.append((first + a - a0, first + a - a0 + n, a))
        a0 = a_end
    return out


def row_stats(
    z_RV: torch.Tensor, rows_A: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``logsumexp(z / T)`` and its max, one read of the rows.

    Args:
        z_RV: ``[R, V]`` logits (fp32/bf16/fp16), rows contiguous.
        rows_A: int64 [A] sorted distinct rows to read.
        temperature: T.

    Returns:
        ``(lse_A, max_A)``: fp32 [A] (fp64 for fp64 logits): the logsumexps of ``z / T`` and
        the maxima of ``z`` itself.
    """
    dtype = compute_dtype(z_RV)
    lse_A = torch.empty(rows_A.numel(), dtype=dtype)
    max_A = torch.empty(rows_A.numel(), dtype=dtype)
    for r0, r1, a0 in row_slices(rows_A, z_RV.shape[1]):
        a1 = a0 + r1 - r0
        src = z_RV[r0:r1]
        max_A[a0:a1] = src.amax(dim=-1)
        # the max of z / T is max(z) / T; an infinite max shifts by 0 (torch.logsumexp's rule)
        shift_a = max_A[a0:a1] / temperature
        shift_a.masked_fill_(~torch.isfinite(shift_a), 0.0)
        if temperature == 1.0:
            shifted = src.to(dtype) - shift_a[:, None]
        else:
            shifted = src.to(dtype).div(temperature).sub_(shift_a[:, None])
        lse_A[a0:a1] = shifted.exp_().sum(dim=-1).log_().add_(shift_a)
    return lse_A, max_A


def argmax_is(
    z_RV: torch.Tensor, rows_A: torch.Tensor, ids_A: torch.Tensor, max_A: torch.Tensor
) -> torch.Tensor:
    """Whether ``ids`` is each row's argmax (its first maximal index, as ``argmax`` takes it),
    from the row maxima: no argmax pass over the rows.

    Args:
        z_RV: ``[R, V]`` logits.
        rows_A: int64 [A] rows.
        ids_A: int64 [A] a column of each row.
        max_A: [A] the rows' maxima (:func:`row_stats`).

    Returns:
        bool [A].
    """
    at_max_A = z_RV[rows_A, ids_A].to(max_A.dtype) == max_A
    # a tie before the column makes the earlier index the argmax: check those few rows
    for a in torch.nonzero(at_max_A & (ids_A > 0)).reshape(-1).tolist():
        before = z_RV[rows_A[a], : ids_A[a]]
        at_max_A[a] = bool(before.to(max_A.dtype).amax() < max_A[a])
    return at_max_A


def grad_buffer(z_BTV: torch.Tensor, rows_A: torch.Tensor) -> torch.Tensor:
    """An uninitialized gradient of ``z``'s shape and dtype whose rows outside ``rows_A`` are 0
    (the caller writes every row of ``rows_A``): no zero pass over the rows it writes. A tensor
    of its own (not a view), so that autograd can add another gradient into it in place.

    Args:
        z_BTV: ``[B, T, V]`` logits.
        rows_A: int64 [A] distinct rows (of ``[B*T, V]``) the caller writes.

    Returns:
        ``[B, T, V]`` tensor.
    """
    grad_BTV = torch.empty(z_BTV.shape, dtype=z_BTV.dtype)
    untouched_R = torch.ones(z_BTV.shape[:-1].numel(), dtype=torch.bool)
    untouched_R[rows_A] = False
    # index_fill_ writes those rows only (a boolean-mask assignment reads every row)
    grad_BTV.view(-1, z_BTV.shape[-1]).index_fill_(0, torch.nonzero(untouched_R).reshape(-1), 0)
    return grad_BTV


def write_softmax_grad(
    grad_RV: torch.Tensor,
    z_RV: torch.Tensor,
    rows_A: torch.Tensor,
    lse_A: torch.Tensor,
    coef_A: torch.Tensor,
    temperature: float,
) -> None:
    """``grad[rows] = coef * softmax(z[rows] / T)``, block by block, in place (rows not named:
    untouched). One read of the logits, one write of the gradient.

    Args:
        grad_RV: ``[R, V]`` gradient being written (any float dtype), rows contiguous.
        z_RV: ``[R, V]`` logits.
        rows_A: int64 [A] sorted distinct rows to write.
        lse_A: [A] ``logsumexp(z / T)`` of those rows (:func:`row_stats`).
        coef_A: [A] each row's factor.
        temperature: T.
    """
    for r0, r1, a0 in row_slices(rows_A, z_RV.shape[1]):
        a1 = a0 + r1 - r0
        dst = grad_RV[r0:r1]
        work = dst if dst.dtype == lse_A.dtype else torch.empty(dst.shape, dtype=lse_A.dtype)
        if temperature == 1.0:
            torch.sub(z_RV[r0:r1], lse_A[a0:a1, None], out=work)
        else:
            torch.div(z_RV[r0:r1], temperature, out=work).sub_(lse_A[a0:a1, None])
        work.exp_().mul_(coef_A[a0:a1, None])
        if work is not dst:
            dst.copy_(work)


class RowStats:
    """Row logsumexps and maxima of one call's student logits, made once per temperature and
    shared by the KD term and the CE (at temperature 1 the CE's are the KD's).

    Args:
        z_BTV: ``[B, T, V]`` student logits.
    """

    def __init__(self, z_BTV: torch.Tensor) -> None:
        self.z_RV = z_BTV.detach().reshape(-1, z_BTV.shape[-1])
        self._made: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lse_R, max_R)`` of every row at ``temperature`` (:func:`row_stats`).

        Args:
            temperature: T.

        Returns:
            fp32 [R] logsumexps of ``z / T`` and maxima of ``z``.
        """
        made = self._made.get(float(temperature))
        if made is None:
            made = row_stats(self.z_RV, torch.arange(self.z_RV.shape[0]), temperature)
            self._made[float(temperature)] = made
        return made


class _StudentNLL(torch.autograd.Function):
    """Sum of ``lse[r] - z[r, target[r]]`` over the rows; backward ``softmax - onehot``."""

    @staticmethod
    def forward(ctx: Any, z_BTV, rows_A, targets_A, lse_A) -> torch.Tensor:
        z_RV = z_BTV.detach().reshape(-1, z_BTV.shape[-1])
        target_logit_A = z_RV[rows_A, targets_A].to(lse_A.dtype)
        ctx.save_for_backward(z_BTV, rows_A, targets_A, lse_A)
        return (lse_A - target_logit_A).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        z_BTV, rows_A, targets_A, lse_A = ctx.saved_tensors
        V = z_BTV.shape[-1]
        z_RV = z_BTV.detach().reshape(-1, V)
        grad_BTV = grad_buffer(z_BTV, rows_A)
        grad_RV = grad_BTV.view(-1, V)
        g = grad.to(lse_A.dtype)
        write_softmax_grad(grad_RV, z_RV, rows_A, lse_A, g.expand(rows_A.numel()), 1.0)
        # the target column: g * (softmax - 1), from the softmax term just written
        softmax_A = (z_RV[rows_A, targets_A].to(lse_A.dtype) - lse_A).exp()
        grad_RV[rows_A, targets_A] = (g * (softmax_A - 1.0)).to(grad_RV.dtype)
        return grad_BTV, None, None, None


def student_ce(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
    *,
    stats: RowStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token CE, summed, on the CPU path. See
    :func:`~xtoken_core.losses.backends.reference.student_ce_loss` (same values within float rounding).

    Reads each row's logsumexp and max once (from ``stats`` when the KD term made them at
    temperature 1) and the target logits; the backward writes ``softmax - onehot`` of the
    counted rows, block by block. No ``[B, T, V]`` fp32 copy, no log-softmax tensor.

    Args:
        student_logits_BTV: ``[B, T, V]`` CPU logits (fp32/bf16/fp16; gradient flows here).
        input_ids_BT: ``[B, T]`` student token ids; the logits at p predict ``input_ids[:, p + 1]``.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).
        stats: the call's :class:`RowStats` (None: made here).

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    B, T, V = student_logits_BTV.shape
    dtype = compute_dtype(student_logits_BTV)
    targets_BT, mask_BT = ce_targets(input_ids_BT, token_mask_BT, sample_mask_B)
    # row b * T + p of the logits predicts targets_BT[b, p] (p < T - 1)
    rows_BT = torch.arange(B).view(-1, 1) * T + torch.arange(max(T - 1, 0)).view(1, -1)
    rows_A, targets_A = rows_BT[mask_BT], targets_BT[mask_BT]
    stats = stats or RowStats(student_logits_BTV)
    lse_R, max_R = stats.get(1.0)
    nll_sum = _StudentNLL.apply(student_logits_BTV, rows_A, targets_A, lse_R[rows_A])
    with torch.no_grad():
        z_RV = student_logits_BTV.detach().reshape(-1, V)
        correct = argmax_is(z_RV, rows_A, targets_A, max_R[rows_A]).sum().to(dtype)
    return nll_sum, correct, mask_BT.sum().to(dtype)
