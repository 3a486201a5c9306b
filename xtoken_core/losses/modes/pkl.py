"""P-KL (``mode: pkl``): the projected KL of docs/design.md, "The loss math", as its PyTorch
reference and its kernel path.

Reference: the teacher's ``vocab_topk`` columns (:func:`select_teacher_columns`), the student
probabilities projected through ``M[:, K]`` (:func:`project_student_probs`, fp32 under autocast)
and both sides chunk-averaged by one-hot matrices; :func:`reference_kd_loss`. Kernel path
(:mod:`xtoken_core.kernels.pkl_projection`, :mod:`xtoken_core.kernels.pkl_chunk_kl`):
``q = softmax(z/T) @ M[:, idx]`` by CSC gathers from the logits, every chunk term (mean,
renormalization, KL, argmax check) in one kernel, backward by ELL gathers (never a
``[B, T, V]`` probability tensor); with a chunk plan, N stays on the device;
:func:`kernel_kd_loss`. :class:`PKL` is the mode the backends call.

CPU path (:func:`cpu_kd_loss`): the same sums over the rows of the valid chunks and the J
student ids that have a weight in the selected columns only; ``p @ M[:, idx]`` and its transpose
as column gathers and scatters, one layer per entry rank of a student id (most ids have one
entry in the K columns); its backward writes ``softmax(z / T)`` times one factor per row, block
by block, and the J columns on top.

Teacher columns: the ``vocab_topk`` teacher ids with the largest logit over every position of
the micro-batch that has a (shifted) teacher chunk id (``topk_columns="valid"``, the default), or
over every position, padding and the last one included (``topk_columns="all"``, NeMo RL's rule);
the ids are sorted ascending. Probabilities are clamped at :data:`PROB_EPS` before a ``log``.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns, N valid chunks, R student rows (B*T),
    A student rows of a valid chunk, G teacher rows of a valid chunk, J student ids with a
    weight in the K columns, E non-zeros of the restricted projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from xtoken_core.kernels import logit_rows, pkl_chunk_kl, pkl_projection
from xtoken_core.losses.alignment import ChunkRows, chunk_row_index
from xtoken_core.losses.backends import cpu
from xtoken_core.losses.backends.kernel import kernel_inputs
from xtoken_core.losses.backends.reference import (
    Fp32SparseMM,
    argmax_agree,
    chunk_average_log_probs,
    compute_dtype,
)
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes.base import KDMode, KDTerms
from xtoken_core.losses.sparse_teacher import SparseTeacher

if TYPE_CHECKING:
    from xtoken_core.data.projection import Projection
    from xtoken_core.kernels.chunk_plan import ChunkPlan
    from xtoken_core.losses.config import CrossTokenizerLossConfig

__all__ = [
    "PKL",
    "PROB_EPS",
    "chunk_kl",
    "cpu_kd_loss",
    "kernel_kd_loss",
    "kernel_tables",
    "project_student_probs",
    "reference_kd_loss",
    "restrict_columns",
    "select_teacher_columns",
    "teacher_columns",
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
        if isinstance(teacher_logits_BUW, SparseTeacher):  # the same maxima, from the targets
            rows = (
                teacher_chunk_id_BU
                if topk_columns != "all"
                else torch.zeros_like(teacher_chunk_id_BU)
            )
            max_W = teacher_logits_BUW.column_max(rows)
        elif teacher_logits_BUW.shape[0] * teacher_logits_BUW.shape[1] == 0:
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


def teacher_columns(
    teacher_logits_BUW: torch.Tensor | SparseTeacher, idx_K: torch.Tensor
) -> torch.Tensor:
    """``[B, U, K]`` the teacher logits of columns ``idx_K`` (top-K targets: the same values,
    without the dense tensor)."""
    if isinstance(teacher_logits_BUW, SparseTeacher):
        return teacher_logits_BUW.columns(idx_K)
    return teacher_logits_BUW[..., idx_K]


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
    inputs: LossInputs, projection_VW: torch.Tensor, config: CrossTokenizerLossConfig
) -> KDTerms:
    """P-KL loss summed over valid chunks (reference).

    Args:
        inputs: one teacher's logits, shifted chunk ids and valid chunks.
        projection_VW: sparse COO ``M[V, W]``.
        config: the loss settings (``temperature``, ``vocab_topk``: the teacher columns kept,
            ``topk_columns``: the positions that pick them (:func:`select_teacher_columns`),
            ``reverse_kl``).

    Returns:
        :class:`KDTerms` (``l1`` is 0).
    """
    C = inputs.valid_BC.shape[1]
    T = config.temperature
    teacher_logits_BUW = inputs.teacher_logits_BUW.detach()
    idx_K = select_teacher_columns(
        teacher_logits_BUW, inputs.teacher_chunk_id_BU, config.vocab_topk, config.topk_columns
    )
    dtype = compute_dtype(inputs.student_logits_BTV)
    teacher_lp_BUK = torch.log_softmax(teacher_columns(teacher_logits_BUW, idx_K).to(dtype) / T, -1)
    teacher_lp_BCK, _ = chunk_average_log_probs(teacher_lp_BUK, inputs.teacher_chunk_id_BU, C)
    q_BTK = project_student_probs(
        inputs.student_logits_BTV, restrict_columns(projection_VW, idx_K), T
    )
    q_BCK, _ = chunk_average_log_probs(q_BTK, inputs.student_chunk_id_BT, C)
    return terms_from_chunks(
        teacher_lp_BCK[inputs.valid_BC],
        q_BCK[inputs.valid_BC],
        inputs.valid_BC,
        temperature=T,
        reverse_kl=config.reverse_kl,
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


# --------------------------------------------------------------------------- CPU path


def _projection_layers(projection_VW: torch.Tensor, idx_K: torch.Tensor):
    """``M[:, idx]`` on the student ids that have a weight in those columns, as layers of at
    most one entry per student id (``p @ M`` and its transpose then are column gathers and
    scatters over row-major ``[rows, J]`` blocks, which the CPU does fast; PyTorch's sparse
    matmuls need transposed copies of them).

    Args:
        projection_VW: coalesced sparse COO ``[V, W]``.
        idx_K: ``[K]`` distinct column ids.

    Returns:
        ``(cols_J, layers)``: the student ids (sorted) and, per layer, ``(pos, k, w)``: the
        positions in ``cols_J`` of the ids it covers (None for layer 0, which covers every id
        in order), their columns in ``idx`` and their weights.
    """
    restricted_VK = restrict_columns(projection_VW, idx_K)  # coalesced: sorted by id, column
    rows_E, k_E = restricted_VK.indices()
    values_E = restricted_VK.values()
    cols_J, j_E = torch.unique(rows_E, return_inverse=True)
    counts_J = torch.bincount(j_E, minlength=cols_J.numel())
    # each entry's rank among its student id's entries: its layer
    rank_E = torch.arange(rows_E.numel()) - (torch.cumsum(counts_J, 0) - counts_J)[j_E]
    layers = []
    for layer in range(int(counts_J.max()) if counts_J.numel() else 0):
        at = rank_E == layer
        pos = None if layer == 0 else j_E[at]
        layers.append((pos, k_E[at], values_E[at]))
    return cols_J, layers


def _gather_columns(z_RV: torch.Tensor, rows_A: torch.Tensor, cols_J: torch.Tensor, dtype):
    """``z[rows][:, cols]`` in ``dtype``, read block by block (:func:`cpu.row_slices`)."""
    out_AJ = torch.empty(rows_A.numel(), cols_J.numel(), dtype=dtype)
    for r0, r1, a0 in cpu.row_slices(rows_A, z_RV.shape[1]):
        out_AJ[a0 : a0 + r1 - r0] = z_RV[r0:r1].index_select(1, cols_J)
    return out_AJ


class _ChunkProjection(torch.autograd.Function):
    """``q_c = mean over chunk c's rows of softmax(z / T) @ M[:, idx]``: forward reads the J
    columns of the rows of the valid chunks; backward writes ``dz`` in one pass."""

    @staticmethod
    def forward(ctx: Any, z_BTV, rows_A, seg_A, inv_size_N, cols_J, lse_A, layers, T, K):
        z_RV = z_BTV.detach().reshape(-1, z_BTV.shape[-1])
        dtype = lse_A.dtype
        # p[a, j] = softmax(z[a] / T)[cols[j]]
        p_AJ = _gather_columns(z_RV, rows_A, cols_J, dtype)
        if T != 1.0:
            p_AJ.div_(T)
        p_AJ.sub_(lse_A[:, None]).exp_()
        # q[a] = p[a] @ M[:, idx], layer by layer
        q_AK = p_AJ.new_zeros(rows_A.numel(), K)
        for pos, k, w in layers:
            q_AK.index_add_(1, k, (p_AJ if pos is None else p_AJ.index_select(1, pos)) * w)
        q_NK = q_AK.new_zeros(inv_size_N.numel(), K).index_add_(0, seg_A, q_AK)
        q_NK.mul_(inv_size_N[:, None])
        ctx.save_for_backward(z_BTV, rows_A, seg_A, inv_size_N, cols_J, lse_A, p_AJ, q_AK)
        ctx.layers, ctx.temperature = layers, T
        return q_NK

    @staticmethod
    def backward(ctx: Any, grad_NK: torch.Tensor):
        z_BTV, rows_A, seg_A, inv_size_N, cols_J, lse_A, p_AJ, q_AK = ctx.saved_tensors
        T = ctx.temperature
        V = z_BTV.shape[-1]
        z_RV = z_BTV.detach().reshape(-1, V)
        # d loss / d q[a]: the chunk mean's share of row a
        grad_AK = (grad_NK.to(p_AJ.dtype) * inv_size_N[:, None]).index_select(0, seg_A)
        # d loss / d p[a] = grad[a] @ M[:, idx]^T, layer by layer
        grad_p_AJ = None
        for pos, k, w in ctx.layers:
            part = grad_AK.index_select(1, k).mul_(w)
            grad_p_AJ = part if pos is None else grad_p_AJ.index_add_(1, pos, part)
        if grad_p_AJ is None:  # no student id has a weight in the columns
            grad_p_AJ = p_AJ.new_zeros(p_AJ.shape)
        # softmax backward: dz = p * (dp - <p, dp>) / T, with dp = 0 outside the J columns;
        # <p[a], dp[a]> = <q[a], grad[a]>
        dot_A = (grad_AK * q_AK).sum(dim=1)
        grad_BTV = cpu.grad_buffer(z_BTV, rows_A)
        grad_RV = grad_BTV.view(-1, V)
        cpu.write_softmax_grad(grad_RV, z_RV, rows_A, lse_A, -dot_A / T, T)
        on_cols_AJ = grad_p_AJ.sub_(dot_A[:, None]).mul_(p_AJ)
        if T != 1.0:
            on_cols_AJ.div_(T)
        on_cols_AJ = on_cols_AJ.to(grad_RV.dtype)
        for r0, r1, a0 in cpu.row_slices(rows_A, V):
            grad_RV[r0:r1].index_copy_(1, cols_J, on_cols_AJ[a0 : a0 + r1 - r0])
        return grad_BTV, *([None] * 8)


def _valid_rows(chunk_id_BT: torch.Tensor, valid_BC: torch.Tensor, N: int):
    """``(rows_A, seg_A, inv_size_N)``: the rows of the valid chunks, each one's valid-chunk
    index, and 1 / the chunk sizes."""
    nidx_R = chunk_row_index(chunk_id_BT, valid_BC)
    rows_A = torch.nonzero(nidx_R >= 0).reshape(-1)
    seg_A = nidx_R[rows_A]
    sizes_N = torch.bincount(seg_A, minlength=N)[:N]
    return rows_A, seg_A, sizes_N


def cpu_kd_loss(
    inputs: LossInputs,
    projection_VW: torch.Tensor,
    config: CrossTokenizerLossConfig,
    *,
    stats: cpu.RowStats | None = None,
) -> KDTerms:
    """P-KL summed over valid chunks on the CPU path. See :func:`reference_kd_loss` (same sums
    within float rounding).

    Args:
        inputs: one teacher's logits (CPU student logits, fp32/bf16/fp16), shifted chunk ids and
            valid chunks.
        projection_VW: coalesced sparse COO ``M[V, W]``.
        config: the loss settings (``temperature``, ``vocab_topk``, ``topk_columns``,
            ``reverse_kl``).
        stats: the call's :class:`~xtoken_core.losses.backends.cpu.RowStats` of the student
            logits (shared with the CE); None: the row logsumexps are made here.

    Returns:
        :class:`KDTerms` (``l1`` is 0).
    """
    student_logits_BTV, valid_BC = inputs.student_logits_BTV, inputs.valid_BC
    temperature = config.temperature
    dtype = compute_dtype(student_logits_BTV)
    W = inputs.teacher_logits_BUW.shape[-1]
    N = int(valid_BC.sum())
    teacher_logits_BUW = inputs.teacher_logits_BUW.detach()
    idx_K = select_teacher_columns(
        teacher_logits_BUW, inputs.teacher_chunk_id_BU, config.vocab_topk, config.topk_columns
    )
    # teacher: L_c, the chunk means of log_softmax(z_t[idx] / T) over the valid chunks' rows
    rows_G, seg_G, t_sizes_N = _valid_rows(inputs.teacher_chunk_id_BU, valid_BC, N)
    if isinstance(teacher_logits_BUW, SparseTeacher):
        zt_GK = teacher_logits_BUW.columns(idx_K).reshape(-1, idx_K.numel())[rows_G].to(dtype)
    else:
        zt_GK = teacher_logits_BUW.reshape(-1, W)[rows_G[:, None], idx_K[None, :]].to(dtype)
    teacher_lp_GK = torch.log_softmax(zt_GK / temperature, dim=-1)
    teacher_lp_NK = teacher_lp_GK.new_zeros(N, idx_K.numel()).index_add_(0, seg_G, teacher_lp_GK)
    teacher_lp_NK /= t_sizes_N.clamp_min(1).to(dtype)[:, None]
    # student: q_c, the chunk means of softmax(z_s / T) @ M[:, idx]
    rows_A, seg_A, s_sizes_N = _valid_rows(inputs.student_chunk_id_BT, valid_BC, N)
    z_RV = student_logits_BTV.detach().reshape(-1, student_logits_BTV.shape[-1])
    if stats is not None:
        lse_A = stats.get(temperature)[0][rows_A]
    else:
        lse_A = cpu.row_stats(z_RV, rows_A, temperature)[0]
    cols_J, layers = _projection_layers(projection_VW, idx_K)
    layers = [(pos, k, w.to(dtype)) for pos, k, w in layers]
    inv_size_N = 1.0 / s_sizes_N.clamp_min(1).to(dtype)
    q_NK = _ChunkProjection.apply(
        student_logits_BTV,
        rows_A,
        seg_A,
        inv_size_N,
        cols_J,
        lse_A,
        layers,
        float(temperature),
        idx_K.numel(),
    )
    return terms_from_chunks(
        teacher_lp_NK, q_NK, valid_BC, temperature=temperature, reverse_kl=config.reverse_kl
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
            if isinstance(teacher_logits_BUW, SparseTeacher):
                max_W = teacher_logits_BUW.column_max(rows_R)
            else:
                max_W = logit_rows.column_max(teacher_logits_BUW, rows_R)
            # On CUDA the selected set (ties too) does not depend on ``sorted``: it gathers,
            # then sorts the values; skip that sort. The CPU kernel may break ties differently
            # without it, so it keeps sorted=True there. The ids go in ascending order by one
            # flag + prefix-sum launch (torch.sort is a dozen launches of host time).
            top = torch.topk(max_W, vocab_topk, sorted=not max_W.is_cuda)
            idx_K = logit_rows.ascending_ids(top.indices, W)
        if isinstance(teacher_logits_BUW, SparseTeacher):  # no [B, U, K] tensor at all
            teacher_lp_NK = teacher_logits_BUW.chunk_mean_log_softmax(
                t_rows.nidx_R, t_rows.sizes_N, temperature, idx_K
            )
        else:
            teacher_lp_NK = logit_rows.chunk_mean_log_softmax_columns(
                teacher_logits_BUW, t_rows.order_R, t_rows.offsets_N1, temperature, idx_K, device_N
            )
        restricted = pkl_projection.restrict_tables(tables, idx_K)
    return teacher_lp_NK, restricted


def kernel_tables(projection_VW: torch.Tensor):
    """The CSC + ELL tables of a sparse projection (:func:`pkl_projection.build_projection_tables`);
    built anew each call: a :class:`~xtoken_core.data.projection.Projection` keeps them."""
    return pkl_projection.build_projection_tables(projection_VW)


def kernel_kd_loss(
    inputs: LossInputs,
    projection_VW: torch.Tensor,
    config: CrossTokenizerLossConfig,
    *,
    plan: ChunkPlan | None = None,
    projection_tables: pkl_projection.ProjectionTables | None = None,
) -> KDTerms:
    """P-KL summed over valid chunks by the kernels (where they run:
    :func:`~xtoken_core.losses.backends.kernel.kernels_run_on`). See :func:`reference_kd_loss`.

    Args:
        inputs: one teacher's logits, shifted chunk ids and valid chunks.
        projection_VW: sparse COO ``M[V, W]``.
        config: the loss settings (``temperature``, ``vocab_topk``, ``topk_columns``,
            ``reverse_kl``).
        plan: the chunk plan of this batch (:func:`xtoken_core.kernels.chunk_plan.plan_chunks`,
            the kernel backend's): its rows replace the grouping done here (one host sync for N),
            and its shifted ids and validity must be the ones of ``inputs``.
        projection_tables: the kernels' tables of ``projection_VW``
            (:meth:`~xtoken_core.data.projection.Projection.kernel_tables`); None: built here.

    Returns:
        :class:`~xtoken_core.losses.modes.base.KDTerms`.
    """
    T = config.temperature
    zs_BTV, zt_BUW, _, _, s_rows, t_rows = kernel_inputs(inputs, None, plan, device_n=True)
    # With a plan, N stays on the device: the chunk kernels cover every slot and skip n >= N.
    device_N = None if plan is None else plan.stats_5[4:5]
    teacher_lp_NK, restricted = teacher_side(
        zt_BUW,
        inputs.teacher_chunk_id_BU,
        t_rows,
        projection_tables or kernel_tables(projection_VW),
        temperature=T,
        vocab_topk=config.vocab_topk,
        device_N=device_N,
        topk_columns=config.topk_columns,
    )
    kd, sums_3 = pkl_chunk_kl.ProjectedChunkKL.apply(
        zs_BTV,
        s_rows.nidx_R,
        s_rows.order_R,
        s_rows.offsets_N1,
        teacher_lp_NK,
        *restricted,
        float(T),
        bool(config.reverse_kl),
        PROB_EPS,
        device_N,
    )
    l1, correct, num_valid = sums_3.unbind()
    return KDTerms(kd=kd, kl=kd.detach(), l1=l1, correct=correct, num_valid=num_valid)


# --------------------------------------------------------------------------- the mode


class PKL(KDMode):
    """P-KL over one teacher: the :func:`reference_kd_loss`, :func:`kernel_kd_loss` and
    :func:`cpu_kd_loss` of the config's ``temperature``, ``vocab_topk``, ``topk_columns`` and
    ``reverse_kl``, through the teacher's sparse projection."""

    def reference(self, inputs: LossInputs, projection: Projection) -> KDTerms:
        """See :meth:`KDMode.reference`."""
        return reference_kd_loss(inputs, projection.sparse(*inputs.vocab_sizes), self.config)

    def kernel(
        self,
        inputs: LossInputs,
        projection: Projection,
        *,
        plan: ChunkPlan,
        num_valid: int | None = None,
        row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDTerms:
        """See :meth:`KDMode.kernel`: N stays on the device (``num_valid`` and ``row_lse``
        are not used)."""
        V, W = inputs.vocab_sizes
        return kernel_kd_loss(
            inputs,
            projection.sparse(V, W),
            self.config,
            plan=plan,
            projection_tables=projection.kernel_tables(V, W),
        )

    def cpu(
        self, inputs: LossInputs, projection: Projection, *, stats: cpu.RowStats | None = None
    ) -> KDTerms:
        """See :meth:`KDMode.cpu`: :func:`cpu_kd_loss`."""
        projection_VW = projection.sparse(*inputs.vocab_sizes)
        return cpu_kd_loss(inputs, projection_VW, self.config, stats=stats)

    def picks_columns(self, teacher_vocab_size: int) -> bool:
        """See :meth:`KDMode.picks_columns`: when ``vocab_topk`` < W."""
        vocab_topk = self.config.vocab_topk
        return vocab_topk is not None and vocab_topk < teacher_vocab_size
