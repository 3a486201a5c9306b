"""Reference cross-tokenizer losses in plain PyTorch: the ground truth for kernels and tests.

Everything here favours being obviously correct over being fast: chunk averages are one-hot
``[B, C, T]`` matrices times ``[B, T, V]`` (O(C*T*V)), and every intermediate is materialized in
the compute dtype (float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs, so that
``torch.autograd.gradcheck`` runs on these functions).

Conventions, chosen where the loss math (docs/design.md) leaves a choice, and followed by the kernel path:

* Chunk ids given to the KD functions are already shifted to next-token targets
  (:func:`xtoken_core.losses.utils.shift_chunk_ids`).
* A chunk average is the plain mean over the chunk's positions: of log-probabilities for
  ``S_c``/``U_c``/``L_c`` (so ``exp`` of it is an unnormalized geometric mean), and of projected
  *probabilities* for the P-KL student ``q_c``, which is then renormalized to sum to 1.
* P-KL teacher columns: the ``vocab_topk`` teacher ids with the largest logit over every
  position of the micro-batch that has a (shifted) teacher chunk id (``topk_columns="valid"``,
  the default), or over every position, padding and the last one included
  (``topk_columns="all"``, NeMo RL's rule); the ids are sorted ascending. Probabilities are clamped at :data:`PROB_EPS` before a ``log``.
* The KD functions return *sums* over valid chunks (already times ``T**2``); the caller divides
  by the global valid-chunk count (all micro-batches, all DP ranks).
* ``correct`` counts valid chunks whose student and teacher argmax agree: over the top-k columns
  (P-KL) or over the common vocabulary (gold; 0 when it is empty).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns (P-KL), N valid chunks (flattened over B, C),
    M common-vocab size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from xtoken_core.losses.utils import Fp32SparseMM, chunk_sizes

logger = logging.getLogger(__name__)

#: Floor applied to probabilities before a log (P-KL student side).
PROB_EPS = 1e-10


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, else float32 (bf16/fp16 logits are upcast)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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


def valid_chunk_mask(
    s_sizes_BC: torch.Tensor, t_sizes_BC: torch.Tensor, pair_valid_BC: torch.Tensor
) -> torch.Tensor:
    """Chunks that count: non-empty on both sides and ``pair_valid``.

    Args:
        s_sizes_BC: ``[B, C]`` student chunk sizes.
        t_sizes_BC: ``[B, C]`` teacher chunk sizes.
        pair_valid_BC: ``[B, C]`` bool (fold the sample mask and ``pair_is_correct`` in first).

    Returns:
        ``[B, C]`` bool.
    """
    return (s_sizes_BC > 0) & (t_sizes_BC > 0) & pair_valid_BC.bool()


def chunk_validity(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
) -> torch.Tensor:
    """The full validity gate of the loss math (docs/design.md), from (shifted) chunk ids alone.

    Args:
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        pair_valid_BC: ``[B, C]`` bool.
        sample_mask_B: ``[B]``; masked samples (0/False) have no valid chunk. None: all count.
        pair_is_correct_BC: ``[B, C]`` bool, needed with ``exact_token_match_only``.
        exact_token_match_only: keep only chunks whose two sides cover identical text.

    Returns:
        ``[B, C]`` bool.

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    C = pair_valid_BC.shape[1]
    mask_BC = pair_valid_BC.bool()
    if sample_mask_B is not None:
        mask_BC = mask_BC & sample_mask_B.bool().view(-1, 1)
    if exact_token_match_only:
        if pair_is_correct_BC is None:
            raise ValueError(
                "exact_token_match_only=True needs alignment_pair_is_correct in the batch"
            )
        mask_BC = mask_BC & pair_is_correct_BC.bool()
    return valid_chunk_mask(
        chunk_sizes(student_chunk_id_BT, C), chunk_sizes(teacher_chunk_id_BU, C), mask_BC
    )


# --------------------------------------------------------------------------- P-KL pieces


def select_teacher_columns(
    teacher_logits_BUW: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    vocab_topk: int | None,
    topk_columns: str = "valid",
) -> torch.Tensor:
    """Teacher ids with the largest max-logit over the micro-batch's chunked (or all) positions.

    Args:
        teacher_logits_BUW: ``[B, U, W]`` teacher logits.
        teacher_chunk_id_BU: ``[B, U]`` shifted ids; with "valid", positions with -1 are ignored.
        vocab_topk: k; None or ``>= W`` keeps every column.
        topk_columns: "valid" (positions with a chunk id) or "all" (every position, padding and
            the last one included: NeMo RL's rule).

    Returns:
        ``[K]`` int64 teacher ids, sorted ascending.
    """
    W = teacher_logits_BUW.shape[-1]
    if vocab_topk is None or vocab_topk >= W:
        return torch.arange(W, device=teacher_logits_BUW.device)
    with torch.no_grad():
        if teacher_logits_BUW.shape[0] * teacher_logits_BUW.shape[1] == 0:
            # no position (an empty batch): every column ties at -inf, like the kernel's max
            max_W = teacher_logits_BUW.new_full((W,), float("-inf"))
        elif topk_columns == "all":
            max_W = teacher_logits_BUW.amax(dim=(0, 1))
        else:
            used_BU1 = (teacher_chunk_id_BU >= 0).unsqueeze(-1)
            masked_BUW = teacher_logits_BUW.masked_fill(~used_BU1, float("-inf"))
            max_W = masked_BUW.amax(dim=(0, 1))
        idx_K = torch.topk(max_W.float(), vocab_topk).indices
    return torch.sort(idx_K).values


def restrict_columns(projection_VW: torch.Tensor, idx_K: torch.Tensor) -> torch.Tensor:
    """``M[:, idx]`` of a sparse COO matrix, still sparse.

    Args:
        projection_VW: coalesced sparse COO ``[V, W]``.
        idx_K: ``[K]`` distinct column ids.

    Returns:
        Coalesced sparse COO ``[V, K]``.
    """
    V, W = projection_VW.shape
    coords_2N = projection_VW.indices()
    values_N = projection_VW.values()
    pos_W = torch.full((W,), -1, dtype=torch.long, device=idx_K.device)
    pos_W[idx_K] = torch.arange(idx_K.numel(), device=idx_K.device)
    new_col_N = pos_W[coords_2N[1]]
    keep_N = new_col_N >= 0
    return torch.sparse_coo_tensor(
        torch.stack([coords_2N[0][keep_N], new_col_N[keep_N]]),
        values_N[keep_N],
        (V, idx_K.numel()),
        check_invariants=False,  # a subset of a valid matrix's entries
    ).coalesce()


def project_student_probs(
    student_logits_BTV: torch.Tensor, projection_VK: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``q = softmax(z_s / T) @ M`` through :class:`Fp32SparseMM`.

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits.
        projection_VK: sparse ``[V, K]`` (already restricted to the selected teacher columns).
        temperature: T.

    Returns:
        ``[B, T, K]`` projected probabilities (rows need not sum to 1).
    """
    B, T, V = student_logits_BTV.shape
    probs_BTV = torch.softmax(
        student_logits_BTV.to(compute_dtype(student_logits_BTV)) / temperature, -1
    )
    q_KN = Fp32SparseMM.apply(projection_VK, probs_BTV.reshape(B * T, V).t())
    return q_KN.t().reshape(B, T, projection_VK.shape[1])


def pkl_chunk_kl(
    teacher_log_probs_NK: torch.Tensor, student_q_NK: torch.Tensor, reverse_kl: bool
) -> torch.Tensor:
    """Per-chunk KL of P-KL: renormalize the student's averaged projection, compare.

    Args:
        teacher_log_probs_NK: ``[N, K]`` chunk-averaged teacher log-probs ``L_c``.
        student_q_NK: ``[N, K]`` chunk-averaged projected student probabilities ``q_c``.
        reverse_kl: KL(P_c || exp L_c) instead of KL(exp L_c || P_c).

    Returns:
        ``[N]`` KL per chunk (not scaled by T**2).
    """
    total_N1 = student_q_NK.sum(dim=-1, keepdim=True).clamp_min(PROB_EPS)
    p_NK = student_q_NK / total_N1
    log_p_NK = torch.log(p_NK.clamp_min(PROB_EPS))
    if reverse_kl:
        return (p_NK * (log_p_NK - teacher_log_probs_NK)).sum(dim=-1)
    return (teacher_log_probs_NK.exp() * (teacher_log_probs_NK - log_p_NK)).sum(dim=-1)


# --------------------------------------------------------------------------- gold pieces


def gold_chunk_terms(
    teacher_log_probs_NW: torch.Tensor,
    student_log_probs_NV: torch.Tensor,
    exact_map: dict[str, torch.Tensor],
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


# --------------------------------------------------------------------------- whole KD terms


@dataclass
class KDTerms:
    """Sums over the valid chunks of one teacher (divide by the global valid-chunk count).

    Attributes:
        kd: scalar, the KD loss sum (``(kl + l1) * T**2``), differentiable.
        kl: scalar, the KL part (times T**2), detached.
        l1: scalar, the uncommon L1 part (times T**2; 0 for P-KL), detached.
        correct: scalar, valid chunks whose argmaxes agree, detached.
        num_valid: scalar, number of valid chunks.
    """

    kd: torch.Tensor
    kl: torch.Tensor
    l1: torch.Tensor
    correct: torch.Tensor
    num_valid: torch.Tensor


def _argmax_agree(a_NX: torch.Tensor, b_NX: torch.Tensor) -> torch.Tensor:
    if a_NX.shape[-1] == 0:
        return a_NX.new_zeros(())
    return (a_NX.argmax(-1) == b_NX.argmax(-1)).sum().to(a_NX.dtype)


def pkl_kd_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    projection_VW: torch.Tensor,
    *,
    temperature: float,
    vocab_topk: int | None,
    reverse_kl: bool,
    topk_columns: str = "valid",
) -> KDTerms:
    """P-KL loss summed over valid chunks (reference).

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits (treated as constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool from :func:`chunk_validity`.
        projection_VW: sparse COO ``M[V, W]``.
        temperature: T.
        vocab_topk: number of teacher columns kept (None: all).
        reverse_kl: reverse KL.
        topk_columns: positions that pick the columns, "valid" or "all"
            (:func:`select_teacher_columns`).

    Returns:
        :class:`KDTerms` (``l1`` is 0).
    """
    C = valid_BC.shape[1]
    teacher_logits_BUW = teacher_logits_BUW.detach()
    idx_K = select_teacher_columns(
        teacher_logits_BUW, teacher_chunk_id_BU, vocab_topk, topk_columns
    )
    dtype = compute_dtype(student_logits_BTV)
    teacher_lp_BUK = torch.log_softmax(teacher_logits_BUW[..., idx_K].to(dtype) / temperature, -1)
    teacher_lp_BCK, _ = chunk_average_log_probs(teacher_lp_BUK, teacher_chunk_id_BU, C)
    q_BTK = project_student_probs(
        student_logits_BTV, restrict_columns(projection_VW, idx_K), temperature
    )
    q_BCK, _ = chunk_average_log_probs(q_BTK, student_chunk_id_BT, C)
    return pkl_terms_from_chunks(
        teacher_lp_BCK[valid_BC],
        q_BCK[valid_BC],
        valid_BC,
        temperature=temperature,
        reverse_kl=reverse_kl,
    )


def pkl_terms_from_chunks(
    teacher_lp_NK: torch.Tensor,
    q_NK: torch.Tensor,
    valid_BC: torch.Tensor,
    *,
    temperature: float,
    reverse_kl: bool,
) -> KDTerms:
    """P-KL KD sums from the valid chunks' averages (shared by the reference and kernel paths).

    Args:
        teacher_lp_NK: ``[N, K]`` chunk-averaged teacher log-probs ``L_c`` of the valid chunks.
        q_NK: ``[N, K]`` chunk-averaged projected student probabilities ``q_c`` (same dtype).
        valid_BC: ``[B, C]`` bool (N = its count).
        temperature: T (for the T**2 factor).
        reverse_kl: reverse KL.

    Returns:
        :class:`KDTerms` (``l1`` is 0).
    """
    kl_N = pkl_chunk_kl(teacher_lp_NK, q_NK, reverse_kl) * temperature**2
    kd = kl_N.sum()
    return KDTerms(
        kd=kd,
        kl=kd.detach(),
        l1=kd.new_zeros(()),
        correct=_argmax_agree(q_NK.detach(), teacher_lp_NK),
        num_valid=valid_BC.sum().to(kd.dtype),
    )


def gold_kd_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    exact_map: dict[str, torch.Tensor],
    *,
    temperature: float,
    uncommon_topk: int,
    reverse_kl: bool,
) -> KDTerms:
    """Gold (or relaxed gold, depending on ``exact_map``) loss summed over valid chunks.

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits (treated as constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool from :func:`chunk_validity`.
        exact_map: strict or relaxed common/uncommon partition.
        temperature: T.
        uncommon_topk: cap on the sorted-probability L1 length.
        reverse_kl: reverse KL on the common vocab.

    Returns:
        :class:`KDTerms`.
    """
    C = valid_BC.shape[1]
    dtype = compute_dtype(student_logits_BTV)
    student_lp_BTV = torch.log_softmax(student_logits_BTV.to(dtype) / temperature, -1)
    teacher_lp_BUW = torch.log_softmax(teacher_logits_BUW.detach().to(dtype) / temperature, -1)
    student_lp_BCV, _ = chunk_average_log_probs(student_lp_BTV, student_chunk_id_BT, C)
    teacher_lp_BCW, _ = chunk_average_log_probs(teacher_lp_BUW, teacher_chunk_id_BU, C)
    return gold_terms_from_chunks(
        teacher_lp_BCW,
        student_lp_BCV,
        valid_BC,
        exact_map,
        temperature=temperature,
        uncommon_topk=uncommon_topk,
        reverse_kl=reverse_kl,
    )


def gold_terms_from_chunks(
    teacher_lp_BCW: torch.Tensor,
    student_lp_BCV: torch.Tensor,
    valid_BC: torch.Tensor,
    exact_map: dict[str, torch.Tensor],
    *,
    temperature: float,
    uncommon_topk: int,
    reverse_kl: bool,
) -> KDTerms:
    """Gold KD sums from chunk-averaged log-probs (shared by the reference and kernel paths).

    Args:
        teacher_lp_BCW: ``[B, C, W]`` chunk-averaged teacher log-probs.
        student_lp_BCV: ``[B, C, V]`` chunk-averaged student log-probs.
        valid_BC: ``[B, C]`` bool.
        exact_map: common/uncommon partition.
        temperature: T (for the T**2 factor).
        uncommon_topk: cap on the sorted-probability L1 length.
        reverse_kl: reverse KL on the common vocab.

    Returns:
        :class:`KDTerms`.
    """
    teacher_lp_NW, student_lp_NV = teacher_lp_BCW[valid_BC], student_lp_BCV[valid_BC]
    kl_N, l1_N = gold_chunk_terms(
        teacher_lp_NW, student_lp_NV, exact_map, uncommon_topk=uncommon_topk, reverse_kl=reverse_kl
    )
    correct = _argmax_agree(
        student_lp_NV.detach()[:, exact_map["common_student"]],
        teacher_lp_NW[:, exact_map["common_teacher"]],
    )
    return gold_terms_from_sums(kl_N.sum(), l1_N.sum(), correct, valid_BC, temperature=temperature)


def gold_terms_from_sums(
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


# --------------------------------------------------------------------------- CE and combination


def student_ce_loss(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token cross-entropy, summed (no temperature).

    The logits at p predict ``input_ids[:, p + 1]``; a target counts when its ``token_mask`` is
    set and its sample is not masked.

    Args:
        student_logits_BTV: ``[B, T, V]`` logits.
        input_ids_BT: ``[B, T]`` student token ids.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    B, T, V = student_logits_BTV.shape
    dtype = compute_dtype(student_logits_BTV)
    targets_BT = input_ids_BT[:, 1:].long()
    mask_BT = torch.ones_like(targets_BT, dtype=torch.bool)
    if token_mask_BT is not None:
        mask_BT = mask_BT & token_mask_BT[:, 1:].bool()
    if sample_mask_B is not None:
        mask_BT = mask_BT & sample_mask_B.bool().view(-1, 1)
    safe_targets_BT = torch.where(mask_BT, targets_BT, torch.zeros_like(targets_BT))
    logits_BTV = student_logits_BTV[:, :-1].to(dtype)
    log_probs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    nll_BT = -log_probs_BTV.gather(-1, safe_targets_BT.unsqueeze(-1)).squeeze(-1)
    nll_sum = torch.where(mask_BT, nll_BT, torch.zeros_like(nll_BT)).sum()
    with torch.no_grad():
        correct = ((logits_BTV.argmax(-1) == targets_BT) & mask_BT).sum().to(dtype)
    return nll_sum, correct, mask_BT.sum().to(dtype)


def combine_losses(
    kd: torch.Tensor,
    ce: torch.Tensor,
    *,
    kl_weight: float,
    ce_weight: float,
    dynamic_scaling: bool,
) -> torch.Tensor:
    """Combine the (already normalized) KD and CE terms.

    Static: ``kl_weight * kd + ce_weight * ce``. Dynamic: ``kl_weight * s * kd + ce_weight * ce``
    with ``s = |ce| / |kd|`` detached (0 when ``kd`` is 0), so the KD term has the CE term's
    magnitude while keeping its own gradient direction.

    Args:
        kd: scalar KD term.
        ce: scalar CE term.
        kl_weight: weight of the KD term.
        ce_weight: weight of the CE term.
        dynamic_scaling: use the dynamic scale s.

    Returns:
        Scalar loss.
    """
    if not dynamic_scaling:
        return kl_weight * kd + ce_weight * ce
    kd_abs = kd.detach().abs()
    scale = torch.where(
        kd_abs > 0, ce.detach().abs() / kd_abs.clamp_min(1e-30), torch.zeros_like(kd_abs)
    )
    return kl_weight * scale * kd + ce_weight * ce
