"""Gold (``mode: gold``) and relaxed gold (``mode: xtoken``): the common-vocab KL plus the
uncommon-vocab sorted L1 of docs/design.md, "The loss math", as their PyTorch reference and their
kernel path. The two modes differ only in the exact-token map (strict or relaxed).

Reference: full-vocabulary log-softmax on both sides, chunk-averaged by one-hot matrices
(:func:`reference_kd_loss`). Kernel path (:mod:`xtoken_core.kernels.gold_student`): the
common-vocab KL in one pass over both logits (chunk means, KL, chunk gradient, argmax), the
sorted top-m L1 of the compact uncommon blocks from counts (:mod:`xtoken_core.kernels.topm_l1`),
and a backward that rebuilds ``dz`` from the logits, the row logsumexp and the compact chunk
gradient (:func:`kernel_kd_loss`). :class:`Gold` and :class:`RelaxedGold` are the modes the
backends call; without a CPU path of their own, the CPU backend runs their reference.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, N valid chunks, M common-vocab size, R rows (B*T or B*U), m uncommon top-m.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xtoken_core.kernels import gold_student, logit_rows
from xtoken_core.kernels.topm_l1 import COARSE_BINS
from xtoken_core.losses.backends.kernel import kernel_inputs
from xtoken_core.losses.backends.reference import (
    argmax_agree,
    chunk_average_log_probs,
    compute_dtype,
)
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes.base import KDMode, KDTerms

if TYPE_CHECKING:
    from xtoken_core.data.projection import Projection
    from xtoken_core.kernels.chunk_plan import ChunkPlan
    from xtoken_core.losses.config import CrossTokenizerLossConfig

__all__ = [
    "Gold",
    "RelaxedGold",
    "chunk_terms",
    "kernel_kd_loss",
    "reference_kd_loss",
    "terms_from_chunks",
    "terms_from_sums",
]

#: An exact-token map: ``common_student``/``common_teacher`` (paired), ``uncommon_student``,
#: ``uncommon_teacher`` id tensors (:meth:`~xtoken_core.data.projection.Projection.exact_map`).
ExactMap = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- reference


def chunk_terms(
    teacher_log_probs_NW: torch.Tensor,
    student_log_probs_NV: torch.Tensor,
    exact_map: ExactMap,
    *,
    uncommon_topk: int,
    reverse_kl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk common-vocab KL and uncommon-vocab sorted L1 of the gold loss.

    Args:
        teacher_log_probs_NW: ``[N, W]`` chunk-averaged teacher log-probs ``U_c``.
        student_log_probs_NV: ``[N, V]`` chunk-averaged student log-probs ``S_c``.
        exact_map: ``common_student``/``common_teacher`` (paired), ``uncommon_student``,
            ``uncommon_teacher`` int64 id tensors.
        uncommon_topk: cap on the number m of sorted probabilities compared.
        reverse_kl: KL(S || U) instead of KL(U || S) on the common vocab.

    Returns:
        ``([N] kl, [N] l1)``, not scaled by T**2. Empty sets give zeros.
    """
    s_NM = student_log_probs_NV[:, exact_map["common_student"]]
    u_NM = teacher_log_probs_NW[:, exact_map["common_teacher"]]
    if reverse_kl:
        kl_N = (s_NM.exp() * (s_NM - u_NM)).sum(dim=-1)
    else:
        kl_N = (u_NM.exp() * (u_NM - s_NM)).sum(dim=-1)
    us, ut = exact_map["uncommon_student"], exact_map["uncommon_teacher"]
    m = min(us.numel(), ut.numel(), uncommon_topk)
    if m == 0:
        l1_N = student_log_probs_NV.new_zeros(student_log_probs_NV.shape[0])
    else:
        s_top_Nm = torch.topk(student_log_probs_NV[:, us].exp(), m, dim=-1).values
        u_top_Nm = torch.topk(teacher_log_probs_NW[:, ut].exp(), m, dim=-1).values
        l1_N = (s_top_Nm - u_top_Nm).abs().sum(dim=-1)
    return kl_N, l1_N


def reference_kd_loss(
    inputs: LossInputs, exact_map: ExactMap, config: CrossTokenizerLossConfig
) -> KDTerms:
    """Gold (or relaxed gold, depending on ``exact_map``) loss summed over valid chunks.

    Args:
        inputs: one teacher's logits, shifted chunk ids and valid chunks.
        exact_map: strict or relaxed common/uncommon partition.
        config: the loss settings (``temperature``, ``uncommon_topk``: the cap on the
            sorted-probability L1 length, ``reverse_kl``: reverse KL on the common vocab).

    Returns:
        :class:`KDTerms`.
    """
    C = inputs.valid_BC.shape[1]
    T = config.temperature
    dtype = compute_dtype(inputs.student_logits_BTV)
    student_lp_BTV = torch.log_softmax(inputs.student_logits_BTV.to(dtype) / T, -1)
    teacher_lp_BUW = torch.log_softmax(inputs.teacher_logits_BUW.detach().to(dtype) / T, -1)
    student_lp_BCV, _ = chunk_average_log_probs(student_lp_BTV, inputs.student_chunk_id_BT, C)
    teacher_lp_BCW, _ = chunk_average_log_probs(teacher_lp_BUW, inputs.teacher_chunk_id_BU, C)
    return terms_from_chunks(teacher_lp_BCW, student_lp_BCV, inputs.valid_BC, exact_map, config)


def terms_from_chunks(
    teacher_lp_BCW: torch.Tensor,
    student_lp_BCV: torch.Tensor,
    valid_BC: torch.Tensor,
    exact_map: ExactMap,
    config: CrossTokenizerLossConfig,
) -> KDTerms:
    """Gold KD sums from chunk-averaged log-probs.

    Args:
        teacher_lp_BCW: ``[B, C, W]`` chunk-averaged teacher log-probs.
        student_lp_BCV: ``[B, C, V]`` chunk-averaged student log-probs.
        valid_BC: ``[B, C]`` bool.
        exact_map: common/uncommon partition.
        config: the loss settings (``temperature`` for the T**2 factor, ``uncommon_topk``,
            ``reverse_kl``).

    Returns:
        :class:`KDTerms`.
    """
    teacher_lp_NW, student_lp_NV = teacher_lp_BCW[valid_BC], student_lp_BCV[valid_BC]
    kl_N, l1_N = chunk_terms(
        teacher_lp_NW,
        student_lp_NV,
        exact_map,
        uncommon_topk=config.uncommon_topk,
        reverse_kl=config.reverse_kl,
    )
    correct = argmax_agree(
        student_lp_NV.detach()[:, exact_map["common_student"]],
        teacher_lp_NW[:, exact_map["common_teacher"]],
    )
    return terms_from_sums(
        kl_N.sum(), l1_N.sum(), correct, valid_BC, temperature=config.temperature
    )


def terms_from_sums(
    kl_sum: torch.Tensor,
    l1_sum: torch.Tensor,
    correct: torch.Tensor,
    valid_BC: torch.Tensor,
    *,
    temperature: float,
) -> KDTerms:
    """Gold KD terms from the unscaled KL and L1 sums over the valid chunks (times T**2 here).

    Args:
        kl_sum: scalar common-vocab KL sum (differentiable).
        l1_sum: scalar uncommon L1 sum (differentiable, same dtype).
        correct: scalar count of valid chunks whose common-vocab argmaxes agree.
        valid_BC: ``[B, C]`` bool.
        temperature: T.

    Returns:
        :class:`KDTerms` with ``kd = (kl + l1) * T**2``.
    """
    scale = temperature**2
    kl, l1 = kl_sum * scale, l1_sum * scale
    return KDTerms(
        kd=kl + l1,
        kl=kl.detach(),
        l1=l1.detach(),
        correct=correct,
        num_valid=valid_BC.sum().to(kl.dtype),
    )


# --------------------------------------------------------------------------- kernel path


def kernel_kd_loss(
    inputs: LossInputs,
    exact_map: ExactMap,
    config: CrossTokenizerLossConfig,
    *,
    num_valid: int | None = None,
    plan: ChunkPlan | None = None,
    row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    places_V: torch.Tensor | None = None,
) -> KDTerms:
    """Gold / relaxed gold summed over valid chunks by the kernels (where they run:
    :func:`~xtoken_core.losses.backends.kernel.kernels_run_on`). See :func:`reference_kd_loss`.

    Args:
        inputs: one teacher's logits, shifted chunk ids and valid chunks.
        exact_map: strict or relaxed common/uncommon partition (ids on the logits' device).
        config: the loss settings (``temperature``, ``uncommon_topk``, ``reverse_kl``).
        num_valid: N = ``valid_BC.sum()`` when the caller read it already; None: counted here.
        plan: the chunk plan of this batch (:func:`xtoken_core.kernels.chunk_plan.plan_chunks`,
            the kernel backend's): its rows replace the grouping done here, and its shifted ids
            and validity must be the ones of ``inputs``.
        row_lse: ``(student [B*T], teacher [B*U])`` fp32 row logsumexps of ``z / temperature``
            over every row (:func:`~xtoken_core.kernels.logit_rows.row_logsumexp` with
            ``nidx_R=None``) when the caller made them (the kernel backend); None: made here.
        places_V: ``[V]`` int32 :func:`~xtoken_core.kernels.gold_student.vocab_places` of
            ``exact_map`` when the caller keeps it (the kernel backend); None: made here.

    Returns:
        :class:`~xtoken_core.losses.modes.base.KDTerms`.
    """
    T = config.temperature
    zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows = kernel_inputs(inputs, num_valid, plan)
    ut = exact_map["uncommon_teacher"]
    m = min(exact_map["uncommon_student"].numel(), ut.numel(), config.uncommon_topk)
    lse_s_R, lse_t_R = (None, None) if row_lse is None else row_lse
    with torch.no_grad():
        if lse_s_R is None:
            lse_s_R = logit_rows.row_logsumexp(zs_BTV, s_rows.nidx_R, T)
        if lse_t_R is None:
            lse_t_R = logit_rows.row_logsumexp(zt_BUW, t_rows.nidx_R, T)
        unc_means = hist_2NK = None
        if m > 0:  # both sides' uncommon chunk means and the top-m's coarse histograms of them
            hist_2NK = torch.zeros((2, N, COARSE_BINS), dtype=torch.int32, device=zs_BTV.device)
            s_unc_NU = logit_rows.chunk_mean_columns(
                zs_BTV, lse_s_R, s_rows.order_R, s_rows.offsets_N1, T,
                exact_map["uncommon_student"], hist_NK=hist_2NK[0],
            )  # fmt: skip
            t_unc_NX = logit_rows.chunk_mean_columns(
                zt_BUW, lse_t_R, t_rows.order_R, t_rows.offsets_N1, T, ut, hist_NK=hist_2NK[1],
            )  # fmt: skip
            unc_means = (s_unc_NU, t_unc_NX)
    kl_sum, l1_sum, correct = gold_student.GoldStudent.apply(
        zs_BTV,
        lse_s_R,
        s_rows,
        (zt_BUW, lse_t_R, t_rows),
        unc_means,
        hist_2NK,
        m,
        exact_map,
        places_V,
        float(T),
        bool(config.reverse_kl),
    )
    return terms_from_sums(kl_sum, l1_sum, correct, valid_BC, temperature=T)


# --------------------------------------------------------------------------- the modes


class Gold(KDMode):
    """Gold over one teacher with the strict exact-token map: the :func:`reference_kd_loss`
    and :func:`kernel_kd_loss` of the config's ``temperature``, ``uncommon_topk`` and
    ``reverse_kl``."""

    #: The exact-token map's rule (docs/design.md, "The projection and the exact-token map").
    relaxed = False
    row_logsumexps = True

    def reference(self, inputs: LossInputs, projection: Projection) -> KDTerms:
        """See :meth:`KDMode.reference`."""
        V, W = inputs.vocab_sizes
        exact = projection.exact_map(W, xtoken_loss=self.relaxed, student_vocab_size=V)
        return reference_kd_loss(inputs, exact, self.config)

    def kernel(
        self,
        inputs: LossInputs,
        projection: Projection,
        *,
        plan: ChunkPlan,
        num_valid: int | None = None,
        row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDTerms:
        """See :meth:`KDMode.kernel`: takes N on the host and both sides' row logsumexps."""
        V, W = inputs.vocab_sizes
        exact = projection.exact_map(
            W, xtoken_loss=self.relaxed, student_vocab_size=V, index_dtype=torch.int32
        )
        return kernel_kd_loss(
            inputs,
            exact,
            self.config,
            num_valid=num_valid,
            plan=plan,
            row_lse=row_lse,
            places_V=projection.gold_places(V, W, xtoken_loss=self.relaxed),
        )


class RelaxedGold(Gold):
    """Relaxed gold (``mode: xtoken``): :class:`Gold` with the relaxed exact-token map."""

    relaxed = True
