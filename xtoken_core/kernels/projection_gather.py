"""Projection of student probabilities through the sparse matrix M by gathers (no sparse library).

Legend (shape suffixes):
    N rows of p (flattened batch x positions), S student vocabulary (rows of M),
    W teacher vocabulary (columns of M), J selected teacher columns (``idx``),
    K non-zeros per row of M (dense top-k format), E entries of M restricted to ``idx``.

Math. q[n, j] = sum_s p[n, s] * M[s, idx[j]] and dp[n, s] = sum_j dq[n, j] * M[s, idx[j]].
The forward walks a CSC list per selected column (rows s and weights, sorted by (j, s)) for a
block of rows of p at a time; the
backward walks each row's <= K entries (an ELL table [S, K'] with K' = the most entries any row
keeps after the restriction). Both accumulate in fp32 in a fixed order: no atomics, bitwise
deterministic, any float dtype for p (bf16 included).
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ._utils import SUM_COMBINE, lazy_jit, next_power_of_2, tl, use_triton

logger = logging.getLogger(__name__)

__all__ = [
    "GatherIndex",
    "ProjectByGather",
    "build_gather_index",
    "cached_gather_index",
    "project_by_gather",
    "project_reference",
]

KERNEL_CONFIG = {
    "fwd_block_n": 32,
    "fwd_block_e": 32,
    "fwd_warps": 4,
    "bwd_block_n": 16,
    "bwd_block_s": 512,
    "bwd_warps": 4,
}


@dataclass(frozen=True)
class GatherIndex:
    """M restricted to the selected columns, as CSC lists (forward) and an ELL table (backward).

    Attributes:
        col_ptr_J1: int64 [J + 1], entries of column j are ``col_ptr[j]:col_ptr[j + 1]``.
        col_rows_E: int32 [E], student row s of each entry, sorted by (j, s).
        col_j_E: int32 [E], column j of each entry.
        col_w_E: fp32 [E], weight M[s, idx[j]].
        ell_cols_SK: int32 [S, K'], column j of each row entry, -1 = none (entries first).
        ell_w_SK: fp32 [S, K'], weights, 0 where the column is -1.
        num_rows: S.
        num_cols: J.
    """

    col_ptr_J1: torch.Tensor
    col_rows_E: torch.Tensor
    col_j_E: torch.Tensor
    col_w_E: torch.Tensor
    ell_cols_SK: torch.Tensor
    ell_w_SK: torch.Tensor
    num_rows: int
    num_cols: int

    def sparse_matrix(self) -> torch.Tensor:
        """The restricted matrix as a coalesced fp32 sparse COO tensor [S, J] (for references).

        Returns:
            torch.sparse_coo_tensor of shape (S, J).
        """
        ind_2E = torch.stack([self.col_rows_E.long(), self.col_j_E.long()])
        return torch.sparse_coo_tensor(
            ind_2E, self.col_w_E, (self.num_rows, self.num_cols), check_invariants=True
        ).coalesce()


def build_gather_index(
    indices_SK: torch.Tensor, likelihoods_SK: torch.Tensor, idx_J: torch.Tensor
) -> GatherIndex:
    """Build the CSC/ELL structure of M[:, idx] from the dense top-k format.

    Entries with index -1 or weight 0 are dropped; repeated (s, t) entries are kept and summed,
    like a coalesced sparse tensor.

    Args:
        indices_SK: int [S, K] teacher ids per student row, -1 = no entry.
        likelihoods_SK: float [S, K] weights.
        idx_J: int [J] selected teacher ids, distinct and >= 0.

    Returns:
        The :class:`GatherIndex`, on the device of ``indices_SK``.

    Raises:
        ValueError: shape mismatch, negative or repeated ids in ``idx_J``.
    """
    if indices_SK.dim() != 2 or tuple(likelihoods_SK.shape) != tuple(indices_SK.shape):
        raise ValueError(
            f"indices {tuple(indices_SK.shape)} and likelihoods {tuple(likelihoods_SK.shape)} "
            "must both be [S, K]"
        )
    if idx_J.dim() != 1:
        raise ValueError(f"idx_J must be 1-D, got shape {tuple(idx_J.shape)}")
    device = indices_SK.device
    S, K = indices_SK.shape
    J = idx_J.numel()
    idx_J = idx_J.to(device=device, dtype=torch.long)
    if J and int(idx_J.min()) < 0:
        raise ValueError(f"idx_J holds a negative teacher id ({int(idx_J.min())}): pass ids >= 0")
    tid_SK = indices_SK.to(torch.long)
    width = max(int(tid_SK.max()) + 1 if tid_SK.numel() else 0, int(idx_J.max()) + 1 if J else 0)
    inv_W = torch.full((width,), -1, dtype=torch.long, device=device)
    ar_J = torch.arange(J, device=device)
    inv_W[idx_J] = ar_J
    if J and bool((inv_W[idx_J] != ar_J).any()):
        raise ValueError("idx_J holds repeated teacher ids: pass distinct columns (e.g. unique())")
    w_SK = likelihoods_SK.to(torch.float32)
    sel_SK = torch.where(tid_SK >= 0, inv_W[tid_SK.clamp(min=0)], torch.full_like(tid_SK, -1))
    sel_SK = torch.where(w_SK != 0, sel_SK, torch.full_like(sel_SK, -1))

    # ELL (backward): move kept entries to the front of each row (stable), trim to K'.
    keep_SK = sel_SK >= 0
    k_keep = int(keep_SK.sum(1).max()) if S and K else 0
    k_eff = max(k_keep, 1)
    front_SK = torch.argsort((~keep_SK).to(torch.int8), dim=1, stable=True)[:, :k_eff]
    ell_cols_SK = torch.gather(sel_SK, 1, front_SK)
    ell_w_SK = torch.where(
        ell_cols_SK >= 0, torch.gather(w_SK, 1, front_SK), torch.zeros((), device=device)
    )
    if K == 0:
        ell_cols_SK = torch.full((S, 1), -1, dtype=torch.long, device=device)
        ell_w_SK = torch.zeros((S, 1), device=device)

    # CSC (forward): entries sorted by (j, s).
    s_SK = torch.arange(S, device=device)[:, None].expand(S, K)
    j_E, s_E, w_E = sel_SK[keep_SK], s_SK[keep_SK], w_SK[keep_SK]
    order_E = torch.argsort(j_E * max(S, 1) + s_E, stable=True)
    j_E, s_E, w_E = j_E[order_E], s_E[order_E], w_E[order_E]
    col_ptr_J1 = torch.searchsorted(j_E, torch.arange(J + 1, device=device))
    return GatherIndex(
        col_ptr_J1=col_ptr_J1.contiguous(),
        col_rows_E=s_E.to(torch.int32).contiguous(),
        col_j_E=j_E.to(torch.int32).contiguous(),
        col_w_E=w_E.contiguous(),
        ell_cols_SK=ell_cols_SK.to(torch.int32).contiguous(),
        ell_w_SK=ell_w_SK.to(torch.float32).contiguous(),
        num_rows=S,
        num_cols=J,
    )


_CACHE: "OrderedDict[tuple, tuple[GatherIndex, tuple[torch.Tensor, ...]]]" = OrderedDict()
_CACHE_SIZE = 4


def cached_gather_index(
    indices_SK: torch.Tensor, likelihoods_SK: torch.Tensor, idx_J: torch.Tensor
) -> GatherIndex:
    """:func:`build_gather_index`, cached on the identity and version of the three tensors.

    The cache keeps references to the key tensors, so a key's storage cannot be freed and
    reused while it is cached; an in-place change bumps the version and misses. Four entries.

    Args:
        indices_SK: as for :func:`build_gather_index`.
        likelihoods_SK: as for :func:`build_gather_index`.
        idx_J: as for :func:`build_gather_index`.

    Returns:
        The (possibly cached) :class:`GatherIndex`.
    """
    key = tuple(
        (
            t.data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.device,
            t._version,
        )
        for t in (indices_SK, likelihoods_SK, idx_J)
    )
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit[0]
    index = build_gather_index(indices_SK, likelihoods_SK, idx_J)
    _CACHE[key] = (index, (indices_SK, likelihoods_SK, idx_J))
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return index


def project_reference(p_NS: torch.Tensor, index: GatherIndex) -> torch.Tensor:
    """Reference: fp32 ``torch.sparse.mm`` (the Fp32SparseMM formulation), differentiable.

    Args:
        p_NS: [N, S] probabilities, any float dtype (upcast to fp32).
        index: the restricted matrix.

    Returns:
        q_NJ fp32 [N, J] = p @ M[:, idx].
    """
    mT_JS = index.sparse_matrix().t().coalesce()
    return torch.sparse.mm(mT_JS, p_NS.float().t()).t()


if tl is not None:

    @lazy_jit
    def _gather_fwd_kernel(
        p_ptr,
        q_ptr,
        col_ptr,
        col_rows,
        col_w,
        N,
        J,
        stride_pn,
        stride_qn,
        BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        # Program (n block, column j); j varies fastest so the programs running together share
        # the rows of one n block (kept in L2). Walk the CSC list of column j in BLOCK_E chunks:
        #   q[n, j] = sum_e p[n, s_e] * w_e   ([BLOCK_N, BLOCK_E] gather, fixed-order fp32 sums)
        pid = tl.program_id(0)
        nb = pid // J
        j = pid % J
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        rows = p_ptr + n.to(tl.int64) * stride_pn
        offs_e = tl.arange(0, BLOCK_E)
        e_start = tl.load(col_ptr + j)
        e_end = tl.load(col_ptr + j + 1)
        acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        for e0 in range(e_start, e_end, BLOCK_E):
            e = e0 + offs_e
            em = e < e_end
            s = tl.load(col_rows + e, mask=em, other=0)
            w = tl.load(col_w + e, mask=em, other=0.0)
            x = tl.load(rows[:, None] + s[None, :], mask=nm[:, None] & em[None, :], other=0.0)
            acc += tl.reduce(x.to(tl.float32) * w[None, :], 1, SUM_COMBINE)
        tl.store(q_ptr + n.to(tl.int64) * stride_qn + j, acc.to(q_ptr.dtype.element_ty), mask=nm)

    @lazy_jit
    def _gather_bwd_kernel(
        dq_ptr,
        dp_ptr,
        ell_cols,
        ell_w,
        N,
        S,
        num_sb,
        stride_dqn,
        stride_dqj,
        stride_dpn,
        K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # Program (n block, s block): load the ELL tile [BLOCK_S, K] once, then for each row n
        #   dp[n, s] = sum_k dq[n, cols[s, k]] * w[s, k]   (k in fixed order, fp32)
        # Every dp element is written (0 for rows of M with no selected entry).
        pid = tl.program_id(0)
        nb = pid // num_sb
        sb = pid % num_sb
        s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        k = tl.arange(0, BLOCK_K)
        sm = s < S
        tile_mask = sm[:, None] & (k[None, :] < K)
        tile_off = s[:, None].to(tl.int64) * K + k[None, :]
        cols = tl.load(ell_cols + tile_off, mask=tile_mask, other=-1)
        w = tl.load(ell_w + tile_off, mask=tile_mask, other=0.0)
        has = cols >= 0
        for i in range(0, BLOCK_N):
            n = nb * BLOCK_N + i
            if n < N:
                g = tl.load(
                    dq_ptr + n.to(tl.int64) * stride_dqn + cols * stride_dqj, mask=has, other=0.0
                ).to(tl.float32)
                dp = tl.reduce(g * w, 1, SUM_COMBINE)
                tl.store(
                    dp_ptr + n.to(tl.int64) * stride_dpn + s,
                    dp.to(dp_ptr.dtype.element_ty),
                    mask=sm,
                )


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def project_by_gather_forward(
    p_NS: torch.Tensor, index: GatherIndex, out_dtype: torch.dtype
) -> torch.Tensor:
    """Triton forward: q_NJ [N, J] in ``out_dtype`` (fp32 accumulation).

    Args:
        p_NS: [N, S] with a contiguous last dim.
        index: the restricted matrix.
        out_dtype: dtype of q.

    Returns:
        q_NJ, contiguous.
    """
    N, S = p_NS.shape
    J = index.num_cols
    q_NJ = torch.empty((N, J), device=p_NS.device, dtype=out_dtype)
    if N == 0 or J == 0:
        return q_NJ
    bn = KERNEL_CONFIG["fwd_block_n"]
    _gather_fwd_kernel[(_cdiv(N, bn) * J,)](
        p_NS,
        q_NJ,
        index.col_ptr_J1,
        index.col_rows_E,
        index.col_w_E,
        N,
        J,
        p_NS.stride(0),
        q_NJ.stride(0),
        BLOCK_N=bn,
        BLOCK_E=KERNEL_CONFIG["fwd_block_e"],
        num_warps=KERNEL_CONFIG["fwd_warps"],
    )
    return q_NJ


def project_by_gather_backward(
    dq_NJ: torch.Tensor, index: GatherIndex, p_dtype: torch.dtype
) -> torch.Tensor:
    """Triton backward: dp_NS [N, S] in ``p_dtype`` (fp32 accumulation).

    Args:
        dq_NJ: [N, J] gradient of q, any strides.
        index: the restricted matrix.
        p_dtype: dtype of the gradient (the dtype of p).

    Returns:
        dp_NS, contiguous; every element is written.
    """
    N, J = dq_NJ.shape
    S = index.num_rows
    dp_NS = torch.empty((N, S), device=dq_NJ.device, dtype=p_dtype)
    if N == 0 or S == 0:
        return dp_NS
    bn = KERNEL_CONFIG["bwd_block_n"]
    bs = min(KERNEL_CONFIG["bwd_block_s"], next_power_of_2(S))
    K = index.ell_cols_SK.shape[1]
    num_sb = _cdiv(S, bs)
    _gather_bwd_kernel[(_cdiv(N, bn) * num_sb,)](
        dq_NJ,
        dp_NS,
        index.ell_cols_SK,
        index.ell_w_SK,
        N,
        S,
        num_sb,
        dq_NJ.stride(0),
        dq_NJ.stride(1),
        dp_NS.stride(0),
        K=K,
        BLOCK_K=next_power_of_2(K),
        BLOCK_N=bn,
        BLOCK_S=bs,
        num_warps=KERNEL_CONFIG["bwd_warps"],
    )
    return dp_NS


class ProjectByGather(torch.autograd.Function):
    """Autograd Function: gather forward, ELL-gather backward, no gradient to M."""

    @staticmethod
    def forward(ctx, p_NS, index, out_dtype):
        if p_NS.stride(-1) != 1:
            p_NS = p_NS.contiguous()
        ctx.index = index
        ctx.p_dtype = p_NS.dtype
        return project_by_gather_forward(p_NS, index, out_dtype)

    @staticmethod
    def backward(ctx, dq_NJ):
        return project_by_gather_backward(dq_NJ, ctx.index, ctx.p_dtype), None, None


def project_by_gather(
    p_NS: torch.Tensor,
    index: GatherIndex | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Project probabilities through M restricted to selected columns: ``q = p @ M[:, idx]``.

    Shape:
        p_NS: [N, S] (any leading dims are flattened by the caller), fp32 / bf16 / fp16.
        index: a :class:`GatherIndex`, or ``(indices_SK, likelihoods_SK, idx_J)`` (built once
            and cached, see :func:`cached_gather_index`).
        q_NJ: [N, J] in ``out_dtype`` (fp32 by default; accumulation is always fp32).
        gradient: [N, S] in the dtype of p.

    Deterministic (bitwise equal across runs). Runs the Triton kernels on CUDA tensors (or
    anywhere under ``TRITON_INTERPRET=1``); otherwise falls back to :func:`project_reference`.

    Args:
        p_NS: student probabilities.
        index: the restricted projection matrix.
        out_dtype: dtype of q.

    Returns:
        q_NJ.

    Raises:
        ValueError: p is not 2-D, or its width is not M's row count.
    """
    if isinstance(index, tuple):
        index = cached_gather_index(*index)
    if p_NS.dim() != 2 or p_NS.shape[1] != index.num_rows:
        raise ValueError(
            f"p_NS must be [N, S={index.num_rows}] (S = rows of M), got {tuple(p_NS.shape)}: "
            "flatten leading dims and slice p to the student vocabulary of M"
        )
    if p_NS.device != index.col_w_E.device:
        raise ValueError(
            f"p_NS is on {p_NS.device} but the projection index is on {index.col_w_E.device}: "
            "build the index on the device of p"
        )
    if not use_triton(p_NS):
        return project_reference(p_NS, index).to(out_dtype)
    return ProjectByGather.apply(p_NS, index, out_dtype)
