"""P-KL (``mode: pkl``): the projected KL of docs/design.md, "The loss math", as its PyTorch
reference and its kernel path.

Reference: the teacher's ``vocab_topk`` columns (:func:`select_teacher_columns`), the student
probabilities projected through ``M[:, K]`` (:func:`project_student_probs`, fp32 under autocast)
and both sides chunk-averaged by one-hot matrices; :func:`reference_kd_loss`. Kernel path
(:mod:`xtoken_core.kernels.pkl_projection`, :mod:`xtoken_core.kernels.pkl_chunk_kl`):
``q = softmax(z/T) @ M[:, idx]`` by CSC gathers from the logits, every chunk term (mean,
renormalization, KL, argmax check) in one kernel, backward by ELL gathers (never a
``[B, T, V]`` probability tensor); with a chunk plan, N stays on the device;
:func:`kernel_kd_loss`. :class:`PKL` is the mode the engines call.

Teacher columns: the ``vocab_topk`` teacher ids with the largest logit over every position of
the micro-batch that has a (shifted) teacher chunk id (``topk_columns="valid"``, the default), or
over every position, padding and the last one included (``topk_columns="all"``, NeMo RL's rule);
the ids are sorted ascending. Probabilities are clamped at :data:`PROB_EPS` before a ``log``.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns, N valid chunks.
"""

from __future__ import annotations

from typing import Any

import torch

from xtoken_core.data.projection import Projection
from xtoken_core.kernels import logit_rows, pkl_chunk_kl, pkl_projection
from xtoken_core.losses import fused
from xtoken_core.losses.modes.base import KDMode, KDTerms
from xtoken_core.losses.reference import argmax_agree, chunk_average_log_probs, compute_dtype
from xtoken_core.losses.utils import ChunkRows, Fp32SparseMM

__all__ = [
    "PKL",
    "PROB_EPS",
    "chunk_kl",
    "kernel_kd_loss",
    "kernel_tables",
    "project_student_probs",
    "reference_kd_loss",
    "restrict_columns",
    "select_teacher_columns",
    "teacher_side",
    "terms_from_chunks",
]

#: Floor applied to probabilities before a log (the student side).
PROB_EPS = 1e-10


# --------------------------------------------------------------------------- reference


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


def chunk_kl(
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


def reference_kd_loss(
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
        valid_BC: ``[B, C]`` bool from :func:`~xtoken_core.losses.reference.chunk_validity`.
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
    return terms_from_chunks(
        teacher_lp_BCK[valid_BC],
        q_BCK[valid_BC],
        valid_BC,
        temperature=temperature,
        reverse_kl=reverse_kl,
    )


def terms_from_chunks(
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
    kl_N = chunk_kl(teacher_lp_NK, q_NK, reverse_kl) * temperature**2
    kd = kl_N.sum()
    return KDTerms(
        kd=kd,
        kl=kd.detach(),
        l1=kd.new_zeros(()),
        correct=argmax_agree(q_NK.detach(), teacher_lp_NK),
        num_valid=valid_BC.sum().to(kd.dtype),
    )


# --------------------------------------------------------------------------- kernel path


def teacher_side(
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
    ids of :func:`select_teacher_columns`), chunk-averages the teacher
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
        else:  # same ids as select_teacher_columns: exact max, same topk input
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


def kernel_tables(projection_VW: torch.Tensor):
    """The CSC + ELL tables of a sparse projection (:func:`pkl_projection.build_projection_tables`);
    built anew each call: a :class:`~xtoken_core.data.projection.Projection` keeps them."""
    return pkl_projection.build_projection_tables(projection_VW)


def _kernel_kd_loss(
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
    zs_BTV, zt_BUW, valid_BC, N, s_rows, t_rows = fused.kernel_inputs(
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
    teacher_lp_NK, restricted = teacher_side(
        zt_BUW,
        teacher_chunk_id_BU,
        t_rows,
        projection_tables or kernel_tables(projection_VW),
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
        PROB_EPS,
        device_N,
    )
    l1, correct, num_valid = sums_3.unbind()
    return KDTerms(kd=kd, kl=kd.detach(), l1=l1, correct=correct, num_valid=num_valid)


def kernel_kd_loss(
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
    """P-KL summed over valid chunks, kernel-backed. See :func:`reference_kd_loss`.

    The kernels when :func:`~xtoken_core.losses.fused.fused_path_available`, else
    :func:`reference_kd_loss`.

    Args:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits (constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool from :func:`~xtoken_core.losses.reference.chunk_validity`.
        projection_VW: sparse COO ``M[V, W]``.
        temperature: T.
        vocab_topk: number of teacher columns kept (None: all).
        reverse_kl: reverse KL.
        num_valid: N = ``valid_BC.sum()`` when the caller read it already (spares the fused
            path its host sync); None: counted here.
        plan: :func:`~xtoken_core.losses.fused.plan_chunks` of this batch (fused path): its
            rows replace the grouping done here, and its shifted ids and validity must be the
            ones passed.
        topk_columns: positions that pick the columns, "valid" or "all"
            (:func:`select_teacher_columns`).
        projection_tables: the fused path's tables of ``projection_VW``
            (:meth:`~xtoken_core.data.projection.Projection.kernel_tables`); None: built here.

    Returns:
        :class:`~xtoken_core.losses.modes.base.KDTerms`.
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
    if fused.fused_path_available(student_logits_BTV, teacher_logits_BUW):
        return _kernel_kd_loss(
            *args, **opts, num_valid=num_valid, plan=plan, projection_tables=projection_tables
        )
    return reference_kd_loss(*args, **opts)


# --------------------------------------------------------------------------- the mode


class PKL(KDMode):
    """P-KL over one teacher: the :func:`reference_kd_loss` and :func:`kernel_kd_loss` of the
    config's ``temperature``, ``vocab_topk``, ``topk_columns`` and ``reverse_kl``, through the
    teacher's sparse projection."""

    def reference(
        self,
        student_logits_BTV: torch.Tensor,
        teacher_logits_BUW: torch.Tensor,
        student_chunk_id_BT: torch.Tensor,
        teacher_chunk_id_BU: torch.Tensor,
        valid_BC: torch.Tensor,
        projection: Projection,
    ) -> KDTerms:
        """See :meth:`KDMode.reference`."""
        V, W = student_logits_BTV.shape[-1], teacher_logits_BUW.shape[-1]
        return reference_kd_loss(
            student_logits_BTV,
            teacher_logits_BUW,
            student_chunk_id_BT,
            teacher_chunk_id_BU,
            valid_BC,
            projection.sparse(V, W),
            **self._options(),
        )

    def kernel(
        self,
        student_logits_BTV: torch.Tensor,
        teacher_logits_BUW: torch.Tensor,
        plan: Any,
        projection: Projection,
        *,
        num_valid: int | None = None,
        row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDTerms:
        """See :meth:`KDMode.kernel`: N stays on the device (``num_valid`` and ``row_lse``
        are not used)."""
        V, W = student_logits_BTV.shape[-1], teacher_logits_BUW.shape[-1]
        return kernel_kd_loss(
            student_logits_BTV,
            teacher_logits_BUW,
            plan.student_chunk_id_BT,
            plan.teacher_chunk_id_BU,
            plan.valid_BC,
            projection.sparse(V, W),
            **self._options(),
            plan=plan,
            projection_tables=projection.kernel_tables(V, W),
        )

    def picks_columns(self, teacher_vocab_size: int) -> bool:
        """See :meth:`KDMode.picks_columns`: when ``vocab_topk`` < W."""
        vocab_topk = self.config.vocab_topk
        return vocab_topk is not None and vocab_topk < teacher_vocab_size

    def _options(self) -> dict[str, Any]:
        cfg = self.config
        return dict(
            temperature=cfg.temperature,
            vocab_topk=cfg.vocab_topk,
            reverse_kl=cfg.reverse_kl,
            topk_columns=cfg.topk_columns,
        )
