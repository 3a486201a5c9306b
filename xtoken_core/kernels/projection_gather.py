"""Projection of student probabilities through the sparse matrix M by gathers (no sparse library).

Legend (shape suffixes):
    N rows of p (flattened batch x positions), S student vocabulary (rows of M),
    W teacher vocabulary (columns of M), J selected teacher columns (``idx``),
    K non-zeros per row of M (dense top-k format), E entries of M restricted to ``idx``,
    P pieces (runs of at most ``piece_len`` entries of one column), H columns with > 1 piece,
    A partial rows (one per piece of those columns), NC rows of p per forward chunk.

Math. q[n, j] = sum_s p[n, s] * M[s, idx[j]] and dp[n, s] = sum_j dq[n, j] * M[s, idx[j]].

Layout is what makes this fast: a gather along s from p[N, S] reads one element per row of p
(a 32-byte sector for 2 useful bytes). Both directions therefore gather whole rows of a
transposed operand, contiguous along n:
    forward:  pT[S, NC] (a chunk of rows of p, transposed by one tiled pass); each program
              takes a block of n and one piece of a CSC column list, loads [entries, BLOCK_N]
              row segments of pT and writes qT[j, n-block]; pieces bound the work of the few
              very long columns, their partials are summed in piece order; qT is transposed
              back into q.
    backward: dqT[J, N] (dq transposed); each program takes [BLOCK_S rows of M, BLOCK_N] and
              walks the <= K entries of each row (ELL table [S, K]), writing the dp tile.
Concurrent programs share one block of n, so the rows they gather (S * BLOCK_N elements of pT,
J * BLOCK_N of dqT) stay in L2. Accumulation is fp32 in a fixed order: no atomics, bitwise
deterministic, any float dtype for p (bf16 included).
"""

import logging
from dataclasses import dataclass

import torch

from ._utils import (
    SUM_COMBINE,
    cdiv,
    interpret_mode,
    lazy_jit,
    next_power_of_2,
    tl,
    transpose_into,
    use_triton,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GatherIndex",
    "ProjectByGather",
    "build_gather_index",
    "teacher_major",
    "project_by_gather",
    "project_reference",
]

KERNEL_CONFIG = {  # best of the H100 sweep in benchmarks/kernels/bench_projection_gather.py
    "fwd_block_n": 128,
    "fwd_block_e": 16,
    "fwd_warps": 4,
    "piece_len": 512,  # entries per forward program at most (read when an index is built)
    "fwd_chunk_bytes": 512 << 20,  # transposed copy of p: at most this many bytes at once
    "bwd_block_n": 64,
    "bwd_block_s": 128,
    "bwd_warps": 4,
}


@dataclass(frozen=True)
class GatherIndex:
    """M restricted to the selected columns: CSC lists cut into pieces (forward), ELL (backward).

    Attributes:
        col_ptr_J1: int64 [J + 1], entries of column j are ``col_ptr[j]:col_ptr[j + 1]``.
        col_rows_E: int32 [E], student row s of each entry, sorted by (j, s).
        col_j_E: int32 [E], column j of each entry.
        col_w_E: fp32 [E], weight M[s, idx[j]].
        ell_cols_SK: int32 [S, K'], column j of each row entry, -1 = none.
        ell_w_SK: fp32 [S, K'], weights, 0 where the column is -1.
        num_rows: S.
        num_cols: J.
        piece_start_P: int32 [P], first entry of each piece (pieces in column order).
        piece_end_P: int32 [P], one past its last entry.
        piece_dest_P: int32 [P], row of the forward buffer it writes: j for a column of one
            piece, ``J + a`` (partial row a) for a piece of a longer column.
        heavy_cols_H: int32 [H], the columns with more than one piece.
        heavy_ptr_H1: int32 [H + 1], partial rows of heavy column h are
            ``J + heavy_ptr[h] : J + heavy_ptr[h + 1]``.
        num_partials: A, partial rows in all.
        piece_len: the piece length the pieces were cut with.
    """

    col_ptr_J1: torch.Tensor
    col_rows_E: torch.Tensor
    col_j_E: torch.Tensor
    col_w_E: torch.Tensor
    ell_cols_SK: torch.Tensor
    ell_w_SK: torch.Tensor
    num_rows: int
    num_cols: int
    piece_start_P: torch.Tensor
    piece_end_P: torch.Tensor
    piece_dest_P: torch.Tensor
    heavy_cols_H: torch.Tensor
    heavy_ptr_H1: torch.Tensor
    num_partials: int
    piece_len: int

    def sparse_matrix(self) -> torch.Tensor:
        """The restricted matrix as a coalesced fp32 sparse COO tensor [S, J] (for references).

        Returns:
            torch.sparse_coo_tensor of shape (S, J).
        """
        ind_2E = torch.stack([self.col_rows_E.long(), self.col_j_E.long()])
        return torch.sparse_coo_tensor(
            ind_2E, self.col_w_E, (self.num_rows, self.num_cols), check_invariants=True
        ).coalesce()


@dataclass(frozen=True)
class TeacherMajor:
    """Every entry of M sorted by (teacher id t, student row s): depends on M only.

    Attributes:
        t_ptr_W1: int64 [W + 1], entries of teacher id t are ``t_ptr[t]:t_ptr[t + 1]``.
        rows_F: int64 [F], student row of each entry (F = all non-zero entries of M).
        w_F: fp32 [F], weights.
        width: W, one past the largest teacher id.
    """

    t_ptr_W1: torch.Tensor
    rows_F: torch.Tensor
    w_F: torch.Tensor
    width: int


def _validate_topk(indices_SK: torch.Tensor, likelihoods_SK: torch.Tensor) -> None:
    if indices_SK.dim() != 2 or tuple(likelihoods_SK.shape) != tuple(indices_SK.shape):
        raise ValueError(
            f"indices {tuple(indices_SK.shape)} and likelihoods {tuple(likelihoods_SK.shape)} "
            "must both be [S, K]"
        )


def teacher_major(indices_SK: torch.Tensor, likelihoods_SK: torch.Tensor) -> TeacherMajor:
    """The entries of M sorted by (t, s), the part of :func:`build_gather_index` that does not
    depend on the selected columns: build it once per matrix and pass it as ``matrix``.

    Entries with id -1 or weight 0 are dropped.

    Args:
        indices_SK: int [S, K] teacher ids per student row, -1 = no entry.
        likelihoods_SK: float [S, K] weights.

    Returns:
        The :class:`TeacherMajor` entries, on the device of ``indices_SK``.

    Raises:
        ValueError: shape mismatch.
    """
    _validate_topk(indices_SK, likelihoods_SK)
    S, K = indices_SK.shape
    device = indices_SK.device
    tid_SK = indices_SK.to(torch.long)
    w_SK = likelihoods_SK.to(torch.float32)
    keep_SK = (tid_SK >= 0) & (w_SK != 0)
    rows_SK = torch.arange(S, device=device)[:, None].expand(S, K)
    t_F, s_F, w_F = tid_SK[keep_SK], rows_SK[keep_SK], w_SK[keep_SK]
    width = int(t_F.max()) + 1 if t_F.numel() else 0
    order_F = torch.argsort(t_F * max(S, 1) + s_F, stable=True)
    t_F, s_F, w_F = t_F[order_F], s_F[order_F], w_F[order_F]
    t_ptr_W1 = torch.searchsorted(t_F, torch.arange(width + 1, device=device))
    return TeacherMajor(t_ptr_W1=t_ptr_W1, rows_F=s_F, w_F=w_F.contiguous(), width=width)


def build_gather_index(
    indices_SK: torch.Tensor,
    likelihoods_SK: torch.Tensor,
    idx_J: torch.Tensor,
    *,
    piece_len: int | None = None,
    matrix: TeacherMajor | None = None,
) -> GatherIndex:
    """Build the CSC/ELL structure of M[:, idx] from the dense top-k format.

    Entries with index -1 or weight 0 are dropped; repeated (s, t) entries are kept and summed,
    like a coalesced sparse tensor. With ``matrix`` (the :func:`teacher_major` entries of M,
    built once) a new ``idx_J`` (every micro-batch) costs only gathers and two device syncs.

    Args:
        indices_SK: int [S, K] teacher ids per student row, -1 = no entry.
        likelihoods_SK: float [S, K] weights.
        idx_J: int [J] selected teacher ids, distinct and >= 0.
        piece_len: entries per forward piece (default ``KERNEL_CONFIG["piece_len"]``).
        matrix: :func:`teacher_major` of ``indices_SK`` and ``likelihoods_SK``; None: built here.

    Returns:
        The :class:`GatherIndex`, on the device of ``indices_SK``.

    Raises:
        ValueError: shape mismatch, negative or repeated ids in ``idx_J``, piece_len < 1.
    """
    _validate_topk(indices_SK, likelihoods_SK)
    if idx_J.dim() != 1:
        raise ValueError(f"idx_J must be 1-D, got shape {tuple(idx_J.shape)}")
    L = int(KERNEL_CONFIG["piece_len"] if piece_len is None else piece_len)
    if L < 1:
        raise ValueError(f"piece_len must be >= 1, got {L}")
    device = indices_SK.device
    S, K = indices_SK.shape
    J = idx_J.numel()
    idx_J = idx_J.to(device=device, dtype=torch.long)
    tm = teacher_major(indices_SK, likelihoods_SK) if matrix is None else matrix
    lo, hi = torch.stack([idx_J.min(), idx_J.max()]).tolist() if J else (0, -1)
    if lo < 0:
        raise ValueError(f"idx_J holds a negative teacher id ({lo}): pass ids >= 0")
    width = max(tm.width, hi + 1)
    t_ptr_W1 = tm.t_ptr_W1
    if width > tm.width:  # ids past the last one used by M: empty columns
        t_ptr_W1 = torch.cat([t_ptr_W1, t_ptr_W1[-1:].expand(width - tm.width)])
    ar_J = torch.arange(J, device=device)
    inv_W = torch.full((max(width, 1),), -1, dtype=torch.long, device=device)
    inv_W[idx_J] = ar_J

    # CSC: column j is the run of teacher id idx[j] in the (t, s)-sorted entries.
    start_J = t_ptr_W1[idx_J]
    cnt_J = t_ptr_W1[idx_J + 1] - start_J
    col_ptr_J1 = torch.zeros(J + 1, dtype=torch.long, device=device)
    torch.cumsum(cnt_J, 0, out=col_ptr_J1[1:])
    pieces_J = torch.clamp((cnt_J + L - 1) // L, min=1)
    heavy_J = pieces_J > 1
    dup = (inv_W[idx_J] != ar_J).any() if J else torch.zeros((), dtype=torch.bool)
    E, P, A, H, has_dup = (
        torch.stack(
            [
                col_ptr_J1[-1],
                pieces_J.sum(),
                (pieces_J * heavy_J).sum(),
                heavy_J.sum(),
                dup.to(device=device, dtype=torch.long),
            ]
        ).tolist()
        if J
        else (0, 0, 0, 0, 0)
    )
    if has_dup:
        raise ValueError("idx_J holds repeated teacher ids: pass distinct columns (e.g. unique())")
    j_E = torch.repeat_interleave(ar_J, cnt_J, output_size=E)
    src_E = start_J[j_E] - col_ptr_J1[j_E] + torch.arange(E, device=device)
    rows_E, w_E = tm.rows_F[src_E], tm.w_F[src_E]

    # Pieces: column j is cut into pieces_J[j] runs of <= L entries (an empty column: one).
    j_P = torch.repeat_interleave(ar_J, pieces_J, output_size=P)
    first_J = torch.cumsum(pieces_J, 0) - pieces_J
    k_P = torch.arange(P, device=device) - first_J[j_P]
    start_P = col_ptr_J1[j_P] + k_P * L
    end_P = torch.minimum(start_P + L, col_ptr_J1[j_P + 1])
    heavy_P = heavy_J[j_P]
    partial_P = torch.cumsum(heavy_P.to(torch.long), 0) - 1
    dest_P = torch.where(heavy_P, J + partial_P, j_P)
    heavy_cols_H = torch.nonzero(heavy_J).flatten()
    heavy_ptr_H1 = torch.zeros(H + 1, dtype=torch.long, device=device)
    torch.cumsum(pieces_J[heavy_cols_H], 0, out=heavy_ptr_H1[1:])

    # ELL (backward): every slot of the top-k table, -1 where the entry is not selected.
    tid_SK = indices_SK.to(torch.long)
    w_SK = likelihoods_SK.to(torch.float32)
    keep_SK = (tid_SK >= 0) & (w_SK != 0)
    sel_SK = torch.where(keep_SK, inv_W[tid_SK.clamp(0, max(width - 1, 0))], -1)
    sel_SK = torch.where(keep_SK & (tid_SK < width), sel_SK, -1)
    ell_w_SK = torch.where(sel_SK >= 0, w_SK, 0.0)
    if K == 0:
        sel_SK = torch.full((S, 1), -1, dtype=torch.long, device=device)
        ell_w_SK = torch.zeros((S, 1), device=device)

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).contiguous()

    return GatherIndex(
        col_ptr_J1=col_ptr_J1,
        col_rows_E=i32(rows_E),
        col_j_E=i32(j_E),
        col_w_E=w_E.contiguous(),
        ell_cols_SK=i32(sel_SK),
        ell_w_SK=ell_w_SK.to(torch.float32).contiguous(),
        num_rows=S,
        num_cols=J,
        piece_start_P=i32(start_P),
        piece_end_P=i32(end_P),
        piece_dest_P=i32(dest_P),
        heavy_cols_H=i32(heavy_cols_H),
        heavy_ptr_H1=i32(heavy_ptr_H1),
        num_partials=A,
        piece_len=L,
    )


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

    @lazy_jit(
        do_not_specialize=("NC",),
        do_not_specialize_on_alignment=(
            "piece_start",
            "piece_end",
            "piece_dest",
            "col_rows",
            "col_w",
        ),
    )
    def _gather_fwd_kernel(
        pT_ptr,
        out_ptr,
        piece_start,
        piece_end,
        piece_dest,
        col_rows,
        col_w,
        NC,
        P,
        stride_pt,
        stride_out,
        BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        # Program (n block, piece); the piece varies fastest so the programs running together
        # gather from the same n block of pT (S * BLOCK_N elements, kept in L2).
        #   out[dest, n] = sum_{e in piece} w_e * pT[s_e, n]
        # Each entry loads BLOCK_N contiguous elements; the [BLOCK_E, BLOCK_N] products add up
        # per lane in entry order and reduce once at the end: a fixed order, deterministic.
        pid = tl.program_id(0)
        nb = pid // P
        piece = pid % P
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < NC
        offs_e = tl.arange(0, BLOCK_E)
        e_start = tl.load(piece_start + piece)
        e_end = tl.load(piece_end + piece)
        dest = tl.load(piece_dest + piece).to(tl.int64)
        acc = tl.full((BLOCK_E, BLOCK_N), 0.0, tl.float32)
        for e0 in range(e_start, e_end, BLOCK_E):
            e = e0 + offs_e
            em = e < e_end
            s = tl.load(col_rows + e, mask=em, other=0).to(tl.int64)
            w = tl.load(col_w + e, mask=em, other=0.0)
            x = tl.load(
                pT_ptr + s[:, None] * stride_pt + n[None, :],
                mask=em[:, None] & nm[None, :],
                other=0.0,
            )
            acc += x.to(tl.float32) * w[:, None]
        q = tl.reduce(acc, 0, SUM_COMBINE)
        tl.store(out_ptr + dest * stride_out + n, q, mask=nm)

    @lazy_jit(do_not_specialize=("NC",), do_not_specialize_on_alignment=("heavy_cols", "heavy_ptr"))
    def _sum_partials_kernel(
        buf_ptr,
        heavy_cols,
        heavy_ptr,
        NC,
        H,
        J,
        stride_buf,
        BLOCK_N: tl.constexpr,
    ):
        # Program (n block, heavy column h): buf[j_h, n] = sum of its partial rows, in order.
        pid = tl.program_id(0)
        nb = pid // H
        h = pid % H
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < NC
        a0 = tl.load(heavy_ptr + h)
        a1 = tl.load(heavy_ptr + h + 1)
        acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        for a in range(a0, a1):
            acc += tl.load(buf_ptr + (J + a).to(tl.int64) * stride_buf + n, mask=nm, other=0.0)
        j = tl.load(heavy_cols + h).to(tl.int64)
        tl.store(buf_ptr + j * stride_buf + n, acc, mask=nm)

    @lazy_jit(do_not_specialize=("N",), do_not_specialize_on_alignment=("ell_cols", "ell_w"))
    def _gather_bwd_kernel(
        dqT_ptr,
        dp_ptr,
        ell_cols,
        ell_w,
        N,
        S,
        num_sb,
        stride_dqt,
        stride_dpn,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # Program (n block, s block); s varies fastest so the programs running together gather
        # from the same n block of dqT (J * BLOCK_N elements, kept in L2).
        #   dp[n, s] = sum_k w[s, k] * dqT[cols[s, k], n]   (k in fixed order, fp32)
        # The [BLOCK_S, BLOCK_N] tile is stored transposed into dp (staged through shared
        # memory by the compiler); rows of M with no selected entry get 0.
        pid = tl.program_id(0)
        nb = pid // num_sb
        sb = pid % num_sb
        s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        n = (nb * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        sm = s < S
        nm = n < N
        ell_off = s.to(tl.int64) * K
        acc = tl.full((BLOCK_S, BLOCK_N), 0.0, tl.float32)
        for k in range(K):
            c = tl.load(ell_cols + ell_off + k, mask=sm, other=-1)
            w = tl.load(ell_w + ell_off + k, mask=sm, other=0.0)
            x = tl.load(
                dqT_ptr + c.to(tl.int64)[:, None] * stride_dqt + n[None, :],
                mask=(c >= 0)[:, None] & nm[None, :],
                other=0.0,
            )
            acc += x.to(tl.float32) * w[:, None]
        tl.store(
            dp_ptr + n[None, :] * stride_dpn + s[:, None],
            acc.to(dp_ptr.dtype.element_ty),
            mask=sm[:, None] & nm[None, :],
        )


def _block_n(key: str, n: int) -> int:
    """Configured block over rows of p; interpreted, no wider than the rows (cheap on CPU)."""
    block = KERNEL_CONFIG[key]
    if interpret_mode():
        block = min(block, next_power_of_2(n))
    return block


def project_by_gather_forward(
    p_NS: torch.Tensor, index: GatherIndex, out_dtype: torch.dtype
) -> torch.Tensor:
    """Triton forward: q_NJ [N, J] in ``out_dtype`` (fp32 accumulation).

    Per chunk of NC rows of p: transpose into pT [S, NC], gather per (n block, piece) into an
    fp32 buffer [J + A, NC], sum the partial rows of long columns, transpose into q.

    Args:
        p_NS: [N, S], any strides.
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
    if S == 0 or index.col_rows_E.numel() == 0:
        return q_NJ.zero_()
    bn = _block_n("fwd_block_n", N)
    per_row = S * p_NS.element_size()
    nc = max(bn, (KERNEL_CONFIG["fwd_chunk_bytes"] // per_row) // bn * bn)
    nc = min(nc, cdiv(N, bn) * bn)
    P = index.piece_start_P.numel()
    H = index.heavy_cols_H.numel()
    pT_SC = torch.empty((S, nc), device=p_NS.device, dtype=p_NS.dtype)
    buf_AC = torch.empty((J + index.num_partials, nc), device=p_NS.device, dtype=torch.float32)
    for n0 in range(0, N, nc):
        m = min(nc, N - n0)
        transpose_into(p_NS[n0 : n0 + m], pT_SC[:, :m])
        _gather_fwd_kernel[(cdiv(m, bn) * P,)](
            pT_SC,
            buf_AC,
            index.piece_start_P,
            index.piece_end_P,
            index.piece_dest_P,
            index.col_rows_E,
            index.col_w_E,
            m,
            P,
            pT_SC.stride(0),
            buf_AC.stride(0),
            BLOCK_N=bn,
            BLOCK_E=KERNEL_CONFIG["fwd_block_e"],
            num_warps=KERNEL_CONFIG["fwd_warps"],
        )
        if H:
            _sum_partials_kernel[(cdiv(m, bn) * H,)](
                buf_AC,
                index.heavy_cols_H,
                index.heavy_ptr_H1,
                m,
                H,
                J,
                buf_AC.stride(0),
                BLOCK_N=bn,
            )
        transpose_into(buf_AC[:J, :m], q_NJ[n0 : n0 + m])
    return q_NJ


def project_by_gather_backward(
    dq_NJ: torch.Tensor, index: GatherIndex, p_dtype: torch.dtype
) -> torch.Tensor:
    """Triton backward: dp_NS [N, S] in ``p_dtype`` (fp32 accumulation).

    Args:
        dq_NJ: [N, J] gradient of q, any strides (e.g. expanded).
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
    if J == 0:
        return dp_NS.zero_()
    dqT_JN = transpose_into(dq_NJ, torch.empty((J, N), device=dq_NJ.device, dtype=dq_NJ.dtype))
    bn = _block_n("bwd_block_n", N)
    bs = min(KERNEL_CONFIG["bwd_block_s"], next_power_of_2(S))
    num_sb = cdiv(S, bs)
    _gather_bwd_kernel[(cdiv(N, bn) * num_sb,)](
        dqT_JN,
        dp_NS,
        index.ell_cols_SK,
        index.ell_w_SK,
        N,
        S,
        num_sb,
        dqT_JN.stride(0),
        dp_NS.stride(0),
        K=index.ell_cols_SK.shape[1],
        BLOCK_N=bn,
        BLOCK_S=bs,
        num_warps=KERNEL_CONFIG["bwd_warps"],
    )
    return dp_NS


class ProjectByGather(torch.autograd.Function):
    """Autograd Function: gather forward, ELL-gather backward, no gradient to M."""

    @staticmethod
    def forward(ctx, p_NS, index, out_dtype):
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
        index: a :class:`GatherIndex`, or ``(indices_SK, likelihoods_SK, idx_J)`` (built here,
            every call: pass a :class:`GatherIndex` to reuse one).
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
        index = build_gather_index(*index)
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
