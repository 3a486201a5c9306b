"""Kernel-backed KD terms and student CE: the Triton kernels read the logits directly
(fp32/bf16/fp16; CUDA, or ``TRITON_INTERPRET=1``) and keep one fp32 scalar per row; only valid
chunks are computed (compact ``[N, ...]``), and only the columns the loss uses.

Same signatures and conventions as :func:`xtoken_core.losses.reference.pkl_kd_loss` and
:func:`~xtoken_core.losses.reference.gold_kd_loss`, which they fall back to where the kernels do
not run (:func:`fused_path_available`). The chunk bookkeeping (shifted ids, validity, N, both
sides' row groups) is one :func:`plan_chunks` (:mod:`xtoken_core.kernels.chunk_plan`). P-KL
(:mod:`xtoken_core.kernels.pkl_projection`, :mod:`xtoken_core.kernels.pkl_chunk_kl`):
``q = softmax(z/T) @ M[:, idx]`` by CSC gathers from the logits, every chunk term (mean,
renormalization, KL, argmax check) in one kernel, backward by ELL gathers (never a
``[B, T, V]`` probability tensor); with a plan, N stays on the device. Gold
(:mod:`xtoken_core.kernels.gold_student`): the common-vocab KL in one pass over both logits
(chunk means, KL, chunk gradient, argmax), the sorted top-m L1 of the compact uncommon blocks
from counts (:mod:`xtoken_core.kernels.topm_l1`), and a backward that rebuilds ``dz`` from the
logits, the row logsumexp and the compact chunk gradient. The student's CE
(:func:`student_ce`, :mod:`xtoken_core.kernels.row_ce`): each row's logsumexp, target logit and
argmax on the logits in their own dtype, reusing gold's row logsumexps at temperature 1.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns, N valid chunks, R rows (B*T or B*U),
    m uncommon top-m.
"""

from __future__ import annotations

import torch

from xtoken_core.kernels import (
    chunk_plan,
    gold_student,
    logit_rows,
    pkl_chunk_kl,
    pkl_projection,
    row_ce,
)
from xtoken_core.kernels.topm_l1 import COARSE_BINS
from xtoken_core.losses import reference
from xtoken_core.losses.reference import KDTerms
from xtoken_core.losses.utils import (
    ChunkRows,
    chunk_rows,
    valid_chunk_numbering,
)

__all__ = [
    "fused_path_available",
    "gold_kd_loss",
    "pkl_kd_loss",
    "plan_chunks",
    "student_ce",
]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_path_available(
    student_logits_BTV: torch.Tensor, teacher_logits_BUW: torch.Tensor
) -> bool:
    """Whether :func:`pkl_kd_loss` / :func:`gold_kd_loss` take the fused path for these logits.

    Args:
        student_logits_BTV: student logits.
        teacher_logits_BUW: teacher logits.

    Returns:
        True when Triton runs on them (CUDA or ``TRITON_INTERPRET=1``) and both are fp32/bf16/fp16.
    """
    return (
        logit_rows.use_triton(student_logits_BTV)
        and student_logits_BTV.dtype in _FUSED_DTYPES
        and teacher_logits_BUW.dtype in _FUSED_DTYPES
    )


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (what the kernels need), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def plan_chunks(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
    device: torch.device | None = None,
):
    """Shifted ids, validity, N and both sides' valid-chunk rows of one teacher, on the device.

    The fused path's replacement for :func:`~xtoken_core.losses.utils.shift_chunk_ids`,
    :func:`~xtoken_core.losses.reference.chunk_validity` and
    :func:`~xtoken_core.losses.utils.chunk_rows` (see
    :func:`xtoken_core.kernels.chunk_plan.plan_chunks`); pass the result as ``plan`` to
    :func:`pkl_kd_loss` / :func:`gold_kd_loss`. Needs Triton (:func:`fused_path_available`).

    Args:
        student_chunk_id_BT: [B, T] raw (unshifted) student chunk ids.
        teacher_chunk_id_BU: [B, U] raw teacher chunk ids.
        pair_valid_BC: [B, C] bool.
        sample_mask_B: [B] or None.
        pair_is_correct_BC: [B, C] bool or None.
        exact_token_match_only: keep only the chunks with ``pair_is_correct``.
        device: where the plan is made (the inputs are moved there); None: the student ids'.

    Returns:
        A :class:`xtoken_core.kernels.chunk_plan.ChunkPlan`.

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    # the kernel wrapper moves every other input to the student ids' device
    return chunk_plan.plan_chunks(
        student_chunk_id_BT if device is None else student_chunk_id_BT.to(device),
        teacher_chunk_id_BU,
        pair_valid_BC,
        sample_mask_B=sample_mask_B,
        pair_is_correct_BC=pair_is_correct_BC,
        exact_token_match_only=exact_token_match_only,
    )


def _fused_inputs(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BUW: torch.Tensor,
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    valid_BC: torch.Tensor,
    num_valid: int | None,
    plan=None,
    device_n: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None, ChunkRows, ChunkRows]:
    """Kernel-ready logits, ``valid_BC`` on their device, N, rows per side.

    With a ``plan`` (:func:`plan_chunks`) the rows are its; else they are grouped here, with
    one valid-chunk numbering shared by both sides. N is ``num_valid`` when the caller read it
    already, else read here (one host sync); with ``device_n`` and a plan it stays on the device
    (N is None, the rows cover every chunk slot, ``plan.stats_5[4]`` holds N).
    """
    zs_BTV = last_dim_contiguous(student_logits_BTV)
    zt_BUW = last_dim_contiguous(teacher_logits_BUW.detach())
    if plan is not None:
        if device_n:
            s_rows, t_rows = ChunkRows(*plan.rows(0, None)), ChunkRows(*plan.rows(1, None))
            return zs_BTV, zt_BUW, plan.valid_BC, None, s_rows, t_rows
        N = int(plan.stats_5[4]) if num_valid is None else int(num_valid)
        s_rows, t_rows = ChunkRows(*plan.rows(0, N)), ChunkRows(*plan.rows(1, N))
        return zs_BTV, zt_BUW, plan.valid_BC, N, s_rows, t_rows
    valid_BC = valid_BC.to(zs_BTV.device)
    N = int(valid_BC.sum()) if num_valid is None else int(num_valid)
    segmap_S = valid_chunk_numbering(valid_BC)
    t_rows = chunk_rows(teacher_chunk_id_BU, valid_BC, N, segmap_S)
    s_rows = chunk_rows(student_chunk_id_BT, valid_BC, N, segmap_S)
    return zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows


def pkl_teacher_side(
    teacher_logits_BUW: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    t_rows: ChunkRows,
    tables,
    *,
    temperature: float,
    vocab_topk: int | None,
    device_N: torch.Tensor | None,
    topk_columns: str = "valid",
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The P-KL teacher side and the projection restricted to its columns, no host sync.

    Picks the ``vocab_topk`` teacher ids with the largest max-logit over the used rows (the
    ids of :func:`reference.select_teacher_columns`), chunk-averages the teacher
    ``log_softmax(z / T)`` over them and restricts the projection tables to them.

    Args:
        teacher_logits_BUW: [B, U, W] teacher logits, last dim contiguous.
        teacher_chunk_id_BU: [B, U] shifted teacher chunk ids (rows with an id >= 0 are used).
        t_rows: the teacher side's valid-chunk rows.
        tables: :class:`xtoken_core.kernels.pkl_projection.ProjectionTables` of M.
        temperature: T.
        vocab_topk: number of teacher columns kept (None: all).
        device_N: int64 [1] device N when the rows cover every chunk slot, else None.
        topk_columns: "valid" (rows with a chunk id pick the columns) or "all" (every row,
            padding and the last one included: NeMo RL's rule).

    Returns:
        ``(teacher_lp_NK, restricted)``: [N, K] fp32 chunk-averaged teacher
        log-probabilities and the restricted tables of
        :func:`xtoken_core.kernels.pkl_projection.restrict_tables`.
    """
    W = teacher_logits_BUW.shape[-1]
    with torch.no_grad():
        if vocab_topk is None or vocab_topk >= W:
            idx_K = torch.arange(W, device=teacher_logits_BUW.device)
        else:  # same ids as reference.select_teacher_columns: exact max, same topk input
            # rows with a chunk id >= 0 are used: the ids serve as the kernel's row index
            rows_R = teacher_chunk_id_BU.reshape(-1).contiguous()
            if topk_columns == "all":  # every row counts as used
                rows_R = torch.zeros_like(rows_R)
            max_W = logit_rows.column_max(teacher_logits_BUW, rows_R)
            # On CUDA the selected set (ties too) does not depend on ``sorted``: it gathers,
            # then sorts the values; skip that sort. The CPU kernel may break ties differently
            # without it, so it keeps sorted=True there. The ids go in ascending order by one
            # flag + prefix-sum launch (torch.sort is a dozen launches of host time).
            top = torch.topk(max_W, vocab_topk, sorted=not max_W.is_cuda)
            idx_K = logit_rows.ascending_ids(top.indices, W)
        teacher_lp_NK = logit_rows.chunk_mean_log_softmax_columns(
            teacher_logits_BUW, t_rows.order_R, t_rows.offsets_N1, temperature, idx_K, device_N
        )
        restricted = pkl_projection.restrict_tables(tables, idx_K)
    return teacher_lp_NK, restricted


def pkl_projection_tables(projection_VW: torch.Tensor):
    """The CSC + ELL tables of a sparse projection (:func:`pkl_projection.build_projection_tables`);
    built anew each call: a :class:`~xtoken_core.data.projection.Projection` keeps them."""
    return pkl_projection.build_projection_tables(projection_VW)


def _pkl_fused(
    student_logits_BTV,
    teacher_logits_BUW,
    student_chunk_id_BT,
    teacher_chunk_id_BU,
    valid_BC,
    projection_VW,
    *,
    temperature,
    vocab_topk,
    reverse_kl,
    num_valid,
    plan,
    topk_columns="valid",
    projection_tables=None,
) -> KDTerms:
    zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows = _fused_inputs(
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        num_valid,
        plan,
        device_n=True,
    )
    # With a plan, N stays on the device: the chunk kernels cover every slot and skip n >= N.
    device_N = None if plan is None else plan.stats_5[4:5]
    teacher_lp_NK, restricted = pkl_teacher_side(
        zt_BUW,
        teacher_chunk_id_BU,
        t_rows,
        projection_tables or pkl_projection_tables(projection_VW),
        temperature=temperature,
        vocab_topk=vocab_topk,
        device_N=device_N,
        topk_columns=topk_columns,
    )
    kd, sums_3 = pkl_chunk_kl.ProjectedChunkKL.apply(
        zs_BTV,
        s_rows.nidx_R,
        s_rows.order_R,
        s_rows.offsets_N1,
        teacher_lp_NK,
        *restricted,
        float(temperature),
        bool(reverse_kl),
        reference.PROB_EPS,
        device_N,
    )
    l1, correct, num_valid = sums_3.unbind()
    return KDTerms(kd=kd, kl=kd.detach(), l1=l1, correct=correct, num_valid=num_valid)


def _gold_fused(
    student_logits_BTV,
    teacher_logits_BUW,
    student_chunk_id_BT,
    teacher_chunk_id_BU,
    valid_BC,
    exact_map,
    *,
    temperature,
    uncommon_topk,
    reverse_kl,
    num_valid,
    plan,
    row_lse=None,
    places_V=None,
) -> KDTerms:
    zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows = _fused_inputs(
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        num_valid,
        plan,
    )
    ut = exact_map["uncommon_teacher"]
    m = min(exact_map["uncommon_student"].numel(), ut.numel(), uncommon_topk)
    lse_s_R, lse_t_R = (None, None) if row_lse is None else row_lse
    with torch.no_grad():
        if lse_s_R is None:
            lse_s_R = logit_rows.row_logsumexp(zs_BTV, s_rows.nidx_R, temperature)
        if lse_t_R is None:
            lse_t_R = logit_rows.row_logsumexp(zt_BUW, t_rows.nidx_R, temperature)
        unc_means = hist_2NK = None
        if m > 0:  # both sides' uncommon chunk means and the top-m's coarse histograms of them
            hist_2NK = torch.zeros((2, N, COARSE_BINS), dtype=torch.int32, device=zs_BTV.device)
            s_unc_NU = logit_rows.chunk_mean_columns(
                zs_BTV, lse_s_R, s_rows.order_R, s_rows.offsets_N1, temperature,
                exact_map["uncommon_student"], hist_NK=hist_2NK[0],
            )  # fmt: skip
            t_unc_NX = logit_rows.chunk_mean_columns(
                zt_BUW, lse_t_R, t_rows.order_R, t_rows.offsets_N1, temperature, ut,
                hist_NK=hist_2NK[1],
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
        float(temperature),
        bool(reverse_kl),
    )
    return reference.gold_terms_from_sums(
        kl_sum, l1_sum, correct, valid_BC, temperature=temperature
    )


# --------------------------------------------------------------------------- public API


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
    num_valid: int | None = None,
    plan=None,
    topk_columns: str = "valid",
    projection_tables=None,
) -> KDTerms:
    """P-KL summed over valid chunks, kernel-backed. See :func:`reference.pkl_kd_loss`.

    The kernels when :func:`fused_path_available`, else :func:`reference.pkl_kd_loss`.

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits (constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool from :func:`reference.chunk_validity`.
        projection_VW: sparse COO ``M[V, W]``.
        temperature: T.
        vocab_topk: number of teacher columns kept (None: all).
        reverse_kl: reverse KL.
        num_valid: N = ``valid_BC.sum()`` when the caller read it already (spares the fused
            path its host sync); None: counted here.
        plan: :func:`plan_chunks` of this batch (fused path): its rows replace the grouping
            done here, and its shifted ids and validity must be the ones passed.
        topk_columns: positions that pick the columns, "valid" or "all"
            (:func:`reference.select_teacher_columns`).
        projection_tables: the fused path's tables of ``projection_VW``
            (:meth:`~xtoken_core.data.projection.Projection.kernel_tables`); None: built here.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.
    """
    args = (
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        projection_VW,
    )
    opts = dict(
        temperature=temperature,
        vocab_topk=vocab_topk,
        reverse_kl=reverse_kl,
        topk_columns=topk_columns,
    )
    if fused_path_available(student_logits_BTV, teacher_logits_BUW):
        return _pkl_fused(
            *args, **opts, num_valid=num_valid, plan=plan, projection_tables=projection_tables
        )
    return reference.pkl_kd_loss(*args, **opts)


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
    num_valid: int | None = None,
    plan=None,
    row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    places_V: torch.Tensor | None = None,
) -> KDTerms:
    """Gold / relaxed gold summed over valid chunks, kernel-backed. See :func:`reference.gold_kd_loss`.

    The kernels when :func:`fused_path_available`, else :func:`reference.gold_kd_loss`.

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits (constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool.
        exact_map: strict or relaxed common/uncommon partition (ids on the logits' device).
        temperature: T.
        uncommon_topk: cap on the sorted-probability L1 length.
        reverse_kl: reverse KL on the common vocab.
        num_valid: N = ``valid_BC.sum()`` when the caller read it already; None: counted here.
        plan: :func:`plan_chunks` of this batch (fused path), as for :func:`pkl_kd_loss`.
        row_lse: ``(student [B*T], teacher [B*U])`` fp32 row logsumexps of ``z / temperature``
            over every row (:func:`~xtoken_core.kernels.logit_rows.row_logsumexp` with
            ``nidx_R=None``) when the caller made them (fused path); None: made here.
        places_V: ``[V]`` int32 :func:`~xtoken_core.kernels.gold_student.vocab_places` of
            ``exact_map`` when the caller keeps it (fused path); None: made here.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.
    """
    args = (
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        exact_map,
    )
    opts = dict(temperature=temperature, uncommon_topk=uncommon_topk, reverse_kl=reverse_kl)
    if fused_path_available(student_logits_BTV, teacher_logits_BUW):
        return _gold_fused(
            *args, **opts, num_valid=num_valid, plan=plan, row_lse=row_lse, places_V=places_V
        )
    return reference.gold_kd_loss(*args, **opts)


def student_ce(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
    *,
    lse_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token CE, summed, kernel-backed. See :func:`reference.student_ce_loss`.

    The kernels of :mod:`xtoken_core.kernels.row_ce` (each row's logsumexp, target logit and
    argmax on the logits in their own dtype; no fp32 copy, no log-softmax) when Triton runs on
    the logits (CUDA, or ``TRITON_INTERPRET=1``) and they are fp32/bf16/fp16; else
    :func:`reference.student_ce_loss` (fp64 logits stay fp64).

    Args:
        student_logits_BTV: ``[B, T, V]`` logits (gradient flows here).
        input_ids_BT: ``[B, T]`` student token ids; the logits at p predict ``input_ids[:, p + 1]``.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).
        lse_R: ``[B*T]`` fp32 row logsumexps of the logits at temperature 1 when the caller made
            them (the gold KD pass at temperature 1); ignored on the reference path.

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    if logit_rows.use_triton(student_logits_BTV) and student_logits_BTV.dtype in _FUSED_DTYPES:
        return row_ce.row_cross_entropy(
            student_logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R=lse_R
        )
    return reference.student_ce_loss(student_logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B)
