"""The reference backend: each mode's PyTorch reference and the reference pieces every mode
shares (chunk averages, the argmax check, the student CE, the fp32 sparse matmul). Each mode's
own reference is in its module of :mod:`xtoken_core.losses.modes`; together they are the ground
truth for the kernels, the CPU path and the tests.

Everything here favours being obviously correct over being fast: chunk averages are one-hot
``[B, C, T]`` matrices times ``[B, T, V]`` (O(C*T*V)), and every intermediate is materialized in
the compute dtype (float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs, so that
``torch.autograd.gradcheck`` runs on these functions). The backend takes any float dtype on any
device: the loss gives it the calls the backend it chose cannot take.

Conventions, chosen where the loss math (docs/design.md) leaves a choice, and followed by the
modes, the kernels and the CPU path:

* Chunk ids given to the KD functions are already shifted to next-token targets
  (:func:`xtoken_core.losses.alignment.shift_chunk_ids`).
* A chunk average is the plain mean over the chunk's positions: of log-probabilities for
  ``S_c``/``U_c``/``L_c`` (so ``exp`` of it is an unnormalized geometric mean), and of projected
  *probabilities* for the P-KL student ``q_c``, which is then renormalized to sum to 1.
* The KD functions return *sums* over valid chunks (already times ``T**2``); the caller divides
  by the global valid-chunk count (all micro-batches, all DP ranks).
* ``correct`` counts valid chunks whose student and teacher argmax agree (:func:`argmax_agree`):
  over the top-k columns (P-KL) or over the common vocabulary (gold; 0 when it is empty).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, N valid chunks (flattened over B, C), X the compared or dense columns.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.amp import custom_bwd, custom_fwd

from xtoken_core.losses.alignment import valid_chunks
from xtoken_core.losses.backends.base import Backend, KDResult, sum_teacher_terms
from xtoken_core.losses.inputs import LossInputs

if TYPE_CHECKING:
    from xtoken_core.losses.inputs import TeacherInputs
    from xtoken_core.losses.modes.base import KDTerms

__all__ = [
    "Fp32SparseMM",
    "ReferenceBackend",
    "argmax_agree",
    "ce_targets",
    "chunk_average_log_probs",
    "compute_dtype",
    "student_ce_loss",
]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (bf16/fp16 logits are upcast)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class ReferenceBackend(Backend):
    """The KD term by each mode's PyTorch reference (:meth:`KDMode.reference`) and the CE by
    :func:`student_ce_loss`: any float dtype (computed in fp32, fp64 kept), any device, every
    call (:meth:`Backend.takes`).

    Args:
        config: the loss settings.
        mode: the loss's KD mode.
    """

    def kd(
        self, student_logits_BTV: torch.Tensor, teachers: Sequence[TeacherInputs], checks, started
    ) -> KDResult:
        """See :class:`Backend`: the checks are read back before any KD term is computed
        (``started`` None: :meth:`start` runs here)."""
        if started is None:
            started = self.start(student_logits_BTV, None)
        device = student_logits_BTV.device
        dtype = compute_dtype(student_logits_BTV)
        if checks is not None:
            checks.finite("student_logits", student_logits_BTV)
        inputs = []
        for t in teachers:
            if checks is not None:
                checks.finite(t.name, t.logits_BUW)
            ids = valid_chunks(t.alignment, self.config, t.sample_mask_B, checks)
            s_ids, t_ids, valid_BC = (x.to(device) for x in ids)
            inputs.append(LossInputs(student_logits_BTV, t.logits_BUW, s_ids, t_ids, valid_BC))
        if checks is not None:
            for t, inputs_t in zip(teachers, inputs, strict=True):
                if t.denominator_1 is not None:
                    checks.denominator(t.denominator_name, t.denominator_1, inputs_t.valid_BC.sum())
            checks.run()
        terms = [
            self._terms(inputs_t, t, started) for t, inputs_t in zip(teachers, inputs, strict=True)
        ]
        return sum_teacher_terms(terms, teachers, self.scales, dtype, device)

    def _terms(self, inputs: LossInputs, teacher: TeacherInputs, started: Any) -> KDTerms:
        """One teacher's KD sums: the mode's reference."""
        return self.mode.reference(inputs, teacher.projection)

    def ce(self, student_logits_BTV: torch.Tensor, targets: tuple, started: Any = None) -> tuple:
        """See :class:`Backend`: :func:`student_ce_loss`."""
        return student_ce_loss(student_logits_BTV, *targets)

    def column_max(self, logits_BUW: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
        """See :class:`Backend`: a masked ``amax``."""
        unused_BU1 = (rows_R < 0).view(*logits_BUW.shape[:2], 1)
        return logits_BUW.masked_fill(unused_BU1, float("-inf")).amax(dim=(0, 1))


# --------------------------------------------------------------------------- chunk helpers


def chunk_average_log_probs(
    log_probs_BTV: torch.Tensor, chunk_id_BT: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``log_probs`` over the positions of every chunk (one-hot bmm).

    Works for any per-position quantity (log-probabilities or probabilities).

    Args:
        log_probs_BTV: ``[B, T, V]`` values.
        chunk_id_BT: ``[B, T]`` int64 in ``[-1, max_chunks)``; -1 belongs to no chunk.
        max_chunks: number of chunk slots C.

    Returns:
        ``([B, C, V] averages, [B, C] sizes)``; an empty chunk averages to 0. Sizes are in the
        values' dtype.
    """
    slots_C = torch.arange(max_chunks, device=chunk_id_BT.device)
    onehot_BCT = (chunk_id_BT.unsqueeze(1) == slots_C.view(1, -1, 1)).to(log_probs_BTV.dtype)
    sizes_BC = onehot_BCT.sum(dim=-1)
    avg_BCV = torch.bmm(onehot_BCT, log_probs_BTV) / sizes_BC.clamp_min(1).unsqueeze(-1)
    return avg_BCV, sizes_BC


def argmax_agree(a_NX: torch.Tensor, b_NX: torch.Tensor) -> torch.Tensor:
    """Rows whose argmaxes agree (0 when there are no columns).

    Args:
        a_NX: ``[N, X]`` values of one side.
        b_NX: ``[N, X]`` values of the other side.

    Returns:
        Scalar count in ``a_NX``'s dtype.
    """
    if a_NX.shape[-1] == 0:
        return a_NX.new_zeros(())
    return (a_NX.argmax(-1) == b_NX.argmax(-1)).sum().to(a_NX.dtype)


# --------------------------------------------------------------------------- the student CE


def ce_targets(
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None,
    sample_mask_B: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CE's next-token targets and which of them count.

    Args:
        input_ids_BT: ``[B, T]`` student token ids.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).

    Returns:
        ``(targets_BT, mask_BT)``, both ``[B, T - 1]``: ``input_ids[:, p + 1]`` (int64), the
        target of the logits at p, and whether it counts (its ``token_mask`` is set and its
        sample is not masked).
    """
    targets_BT = input_ids_BT[:, 1:].long()
    mask_BT = torch.ones_like(targets_BT, dtype=torch.bool)
    if token_mask_BT is not None:
        mask_BT = mask_BT & token_mask_BT[:, 1:].bool()
    if sample_mask_B is not None:
        mask_BT = mask_BT & sample_mask_B.bool().view(-1, 1)
    return targets_BT, mask_BT


def student_ce_loss(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token cross-entropy, summed (no temperature).

    The logits at p predict ``input_ids[:, p + 1]``; a target counts when its ``token_mask`` is
    set and its sample is not masked (:func:`ce_targets`).

    Args:
        student_logits_BTV: ``[B, T, V]`` logits.
        input_ids_BT: ``[B, T]`` student token ids.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    dtype = compute_dtype(student_logits_BTV)
    targets_BT, mask_BT = ce_targets(input_ids_BT, token_mask_BT, sample_mask_B)
    safe_targets_BT = torch.where(mask_BT, targets_BT, torch.zeros_like(targets_BT))
    logits_BTV = student_logits_BTV[:, :-1].to(dtype)
    log_probs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    nll_BT = -log_probs_BTV.gather(-1, safe_targets_BT.unsqueeze(-1)).squeeze(-1)
    nll_sum = torch.where(mask_BT, nll_BT, torch.zeros_like(nll_BT)).sum()
    with torch.no_grad():
        correct = ((logits_BTV.argmax(-1) == targets_BT) & mask_BT).sum().to(dtype)
    return nll_sum, correct, mask_BT.sum().to(dtype)


# --------------------------------------------------------------------------- fp32 sparse mm


@functools.cache
def _fp32_sparse_mm_function(device_type: str) -> type[torch.autograd.Function]:
    """One autograd Function per device type: ``custom_fwd`` binds the device type at definition."""

    class _Fp32SparseMM(torch.autograd.Function):
        @staticmethod
        @custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx: Any, sparse_M_VW: torch.Tensor, dense_VX: torch.Tensor) -> torch.Tensor:
            # Outside autocast cast_inputs is a no-op: follow the dense dtype (float64 gradcheck).
            sparse_M_VW = sparse_M_VW.to(dense_VX.dtype)
            ctx.save_for_backward(sparse_M_VW)
            return torch.sparse.mm(sparse_M_VW.t(), dense_VX)

        @staticmethod
        @custom_bwd(device_type=device_type)
        def backward(ctx: Any, grad_WX: torch.Tensor) -> tuple[None, torch.Tensor]:
            (sparse_M_VW,) = ctx.saved_tensors
            # The projection is frozen: no gradient for it.
            return None, torch.sparse.mm(sparse_M_VW, grad_WX.to(sparse_M_VW.dtype))

    _Fp32SparseMM.__name__ = f"Fp32SparseMM_{device_type}"
    return _Fp32SparseMM


class Fp32SparseMM:
    """``M.t() @ dense`` with a sparse frozen ``M`` that stays in fp32 inside bf16 autocast.

    PyTorch has no bf16 sparse-mm kernel, and ``loss.backward()`` runs inside the caller's
    autocast, so disabling autocast around the forward alone is not enough.
    ``custom_fwd(cast_inputs=float32)`` / ``custom_bwd`` make both passes run in fp32. The
    device type that autocast keys on is taken from the dense input. No gradient reaches ``M``.
    Outside autocast the dense dtype is kept (float64 stays float64, for gradcheck).
    """

    @staticmethod
    def apply(sparse_M_VW: torch.Tensor, dense_VX: torch.Tensor) -> torch.Tensor:
        """Compute ``sparse_M.t() @ dense``.

        Args:
            sparse_M_VW: sparse COO ``[V, W]`` matrix (frozen).
            dense_VX: dense ``[V, X]``.

        Returns:
            Dense ``[W, X]`` (fp32 under autocast, else the dense dtype).
        """
        return _fp32_sparse_mm_function(dense_VX.device.type).apply(sparse_M_VW, dense_VX)
