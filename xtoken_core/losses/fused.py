"""Kernel-backed KD terms: the reference conventions, with fused kernels doing the heavy parts.

Same signatures and conventions as :func:`xtoken_core.losses.reference.pkl_kd_loss` and
:func:`~xtoken_core.losses.reference.gold_kd_loss`. Two implementations:

* **fused** (Triton runs: CUDA, or ``TRITON_INTERPRET=1``; fp32/bf16/fp16 logits): the kernels of
  :mod:`xtoken_core.kernels.kd_fused` read the logits directly and keep one fp32 scalar per row;
  only valid chunks are computed (compact ``[N, ...]``), and only the columns the loss uses.
  P-KL: ``q = softmax(z/T) @ M[:, idx]`` by CSC gathers from the logits, backward by ELL gathers
  (never a ``[B, T, V]`` probability tensor). Gold: chunk averages over the common columns and
  the uncommon columns separately, top-m on the compact uncommon block, and a backward that
  rebuilds ``dz`` from the logits, the row logsumexp and the compact chunk gradient.
* **composed** (float64 logits, or no Triton on CPU): the fused chunk-averaged log-softmax and the
  projection-by-gather kernels composed with PyTorch ops (each falls back to its reference).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab,
    C chunk slots, K selected teacher columns, N valid chunks, R rows (B*T or B*U),
    E entries of M, P entries per row of M, X gathered columns, Mc common-vocab size,
    m uncommon top-m.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xtoken_core.losses import reference
from xtoken_core.losses.reference import KDTerms
from xtoken_core.losses.utils import chunk_sizes

logger = logging.getLogger(__name__)

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CHUNK_AVG_NAME = "chunk_avg_log_softmax"
_KERNEL_MODULES = ("xtoken_core.kernels", "xtoken_core.kernels.chunk_log_softmax")


@functools.cache
def load_chunk_avg_log_softmax() -> Callable | None:
    """The fused ``chunk_avg_log_softmax(logits_BTV, chunk_id_BT, num_chunks, temperature)``.

    It returns ``(avg_BCV fp32, sizes_BC)``.

    Returns:
        The function, or None when the kernels (or Triton) cannot be imported.
    """
    for name in _KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            logger.debug("[losses] %s not importable: %s", name, exc)
            continue
        fn = getattr(module, _CHUNK_AVG_NAME, None)
        if callable(fn):
            return fn
    return None


@functools.cache
def load_project_by_gather() -> Callable | None:
    """The gather projection ``project_by_gather(p_NS, (indices, likelihoods, idx), out_dtype)``.

    Returns:
        The function, or None when it cannot be imported.
    """
    try:
        module = importlib.import_module("xtoken_core.kernels.projection_gather")
    except ImportError as exc:
        logger.debug("[losses] projection_gather not importable: %s", exc)
        return None
    fn = getattr(module, "project_by_gather", None)
    return fn if callable(fn) else None


def kernels_available() -> bool:
    """Whether the fused kernels can run: importable and Triton installed (CUDA: caller's check)."""
    return (
        importlib.util.find_spec("triton") is not None and load_chunk_avg_log_softmax() is not None
    )


def _require_kernel() -> Callable:
    fn = load_chunk_avg_log_softmax()
    if fn is None:
        raise RuntimeError(
            f"backend='kernel' but {_CHUNK_AVG_NAME} is not importable from {_KERNEL_MODULES} "
            "(Triton missing?); use backend='auto' or 'reference'"
        )
    return fn


def chunk_mean_scatter(
    x_BTK: torch.Tensor, chunk_id_BT: torch.Tensor, num_chunks: int
) -> torch.Tensor:
    """Per-chunk mean by ``index_add`` (O(T*K)), equal to the one-hot reference.

    Args:
        x_BTK: ``[B, T, K]`` values.
        chunk_id_BT: ``[B, T]`` ids in ``[-1, C)``.
        num_chunks: C.

    Returns:
        ``[B, C, K]`` means (0 for empty chunks).
    """
    B, T, K = x_BTK.shape
    # Slot 0 of every sample collects the -1 positions and is dropped.
    rows_BT = (
        chunk_id_BT + 1 + torch.arange(B, device=chunk_id_BT.device).view(-1, 1) * (num_chunks + 1)
    )
    sums = x_BTK.new_zeros(B * (num_chunks + 1), K).index_add(
        0, rows_BT.reshape(-1), x_BTK.reshape(B * T, K)
    )
    sums_BCK = sums.view(B, num_chunks + 1, K)[:, 1:]
    sizes_BC = chunk_sizes(chunk_id_BT, num_chunks).to(x_BTK.dtype)
    return sums_BCK / sizes_BC.clamp_min(1).unsqueeze(-1)


def _pkl_composed(
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
    projection_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> KDTerms:
    """P-KL from composed kernels (fp64, or no Triton): chunk log-softmax kernel + projection.

    With ``projection_topk`` (the dense ``(indices [V_rows, K], likelihoods)`` form of M, on the
    logits' device) the projection runs as gathers (``project_by_gather``), else through
    :class:`~xtoken_core.losses.utils.Fp32SparseMM` on ``projection_VW``.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    chunk_avg = _require_kernel()
    C = valid_BC.shape[1]
    dtype = reference.compute_dtype(student_logits_BTV)
    teacher_logits_BUW = teacher_logits_BUW.detach()
    idx_K = reference.select_teacher_columns(teacher_logits_BUW, teacher_chunk_id_BU, vocab_topk)
    with torch.no_grad():
        teacher_lp_BCK, _ = chunk_avg(
            teacher_logits_BUW[..., idx_K].contiguous(),
            teacher_chunk_id_BU,
            C,
            temperature,
            out_dtype=dtype,
        )
    project = load_project_by_gather()
    if projection_topk is not None and project is not None:
        indices_VK, likelihoods_VK = projection_topk
        B, T, V = student_logits_BTV.shape
        rows = indices_VK.shape[0]  # student ids past the rows have no entries
        probs_NV = torch.softmax(student_logits_BTV.to(dtype) / temperature, -1).reshape(B * T, V)
        q_NK = project(probs_NV[:, :rows], (indices_VK, likelihoods_VK, idx_K), out_dtype=dtype)
        q_BTK = q_NK.reshape(B, T, -1)
    else:
        projection_VK = reference.restrict_columns(projection_VW, idx_K)
        q_BTK = reference.project_student_probs(student_logits_BTV, projection_VK, temperature)
    q_BCK = chunk_mean_scatter(q_BTK, student_chunk_id_BT, C)
    teacher_lp_NK, q_NK = teacher_lp_BCK[valid_BC], q_BCK[valid_BC].to(teacher_lp_BCK.dtype)
    kd = reference.pkl_chunk_kl(teacher_lp_NK, q_NK, reverse_kl).sum() * temperature**2
    return KDTerms(
        kd=kd,
        kl=kd.detach(),
        l1=kd.new_zeros(()),
        correct=reference._argmax_agree(q_NK.detach(), teacher_lp_NK),
        num_valid=valid_BC.sum().to(kd.dtype),
    )


def _gold_composed(
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
    """Gold from composed kernels (fp64, or no Triton): full [B, C, V] chunk log-softmax.

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    chunk_avg = _require_kernel()
    C = valid_BC.shape[1]
    dtype = reference.compute_dtype(student_logits_BTV)
    student_lp_BCV, _ = chunk_avg(
        student_logits_BTV, student_chunk_id_BT, C, temperature, out_dtype=dtype
    )
    with torch.no_grad():
        teacher_lp_BCW, _ = chunk_avg(
            teacher_logits_BUW.detach(), teacher_chunk_id_BU, C, temperature, out_dtype=dtype
        )
    return reference.gold_terms_from_chunks(
        teacher_lp_BCW,
        student_lp_BCV,
        valid_BC,
        exact_map,
        temperature=temperature,
        uncommon_topk=uncommon_topk,
        reverse_kl=reverse_kl,
    )


# --------------------------------------------------------------------------- fused path


@functools.cache
def _kd_kernels():
    """The :mod:`xtoken_core.kernels.kd_fused` module, or None when it cannot be imported."""
    try:
        return importlib.import_module("xtoken_core.kernels.kd_fused")
    except ImportError as exc:  # pragma: no cover - only without triton
        logger.debug("[losses] kd_fused not importable: %s", exc)
        return None


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
    kernels = _kd_kernels()
    return (
        kernels is not None
        and kernels.use_triton(student_logits_BTV)
        and student_logits_BTV.dtype in _FUSED_DTYPES
        and teacher_logits_BUW.dtype in _FUSED_DTYPES
    )


@dataclass(frozen=True)
class ChunkRows:
    """Rows of each valid chunk on one side (valid chunks numbered 0..N-1 in ``[B, C]`` order).

    Attributes:
        nidx_R: int64 [R], valid-chunk index of each row, -1 = none.
        order_R: int64 [R], rows sorted by valid chunk (rows of no valid chunk last).
        offsets_N1: int64 [N + 1], rows of chunk n are ``order[offsets[n]:offsets[n + 1]]``.
        sizes_N: fp32 [N], rows per chunk.
    """

    nidx_R: torch.Tensor
    order_R: torch.Tensor
    offsets_N1: torch.Tensor
    sizes_N: torch.Tensor


def chunk_rows(chunk_id_BT: torch.Tensor, valid_BC: torch.Tensor, num_valid: int) -> ChunkRows:
    """Group the rows of the valid chunks (no host sync besides what the caller did).

    Args:
        chunk_id_BT: [B, T] shifted chunk ids in [-1, C).
        valid_BC: [B, C] bool.
        num_valid: N, ``valid_BC.sum()``.

    Returns:
        :class:`ChunkRows`.
    """
    B, T = chunk_id_BT.shape
    C = valid_BC.shape[1]
    device = chunk_id_BT.device
    flat_S = valid_BC.reshape(-1).to(device)
    segmap_S = torch.where(flat_S, torch.cumsum(flat_S, 0) - 1, -1)
    cid_BT = chunk_id_BT.long()
    seg_BT = torch.arange(B, device=device).view(-1, 1) * C + cid_BT.clamp(min=0)
    nidx_R = torch.where(cid_BT >= 0, segmap_S[seg_BT], -1).reshape(-1).contiguous()
    key_R = torch.where(nidx_R >= 0, nidx_R, num_valid)
    sorted_R, order_R = torch.sort(key_R, stable=True)
    offsets_N1 = torch.searchsorted(sorted_R, torch.arange(num_valid + 1, device=device))
    sizes_N = (offsets_N1[1:] - offsets_N1[:-1]).to(torch.float32)
    return ChunkRows(nidx_R, order_R.contiguous(), offsets_N1.contiguous(), sizes_N)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- P-KL


@dataclass(frozen=True)
class ProjectionTables:
    """M[S, W] as a CSC list (forward gathers) and an ELL table (backward gathers).

    Attributes:
        col_ptr_W1: int64 [W + 1], entries of teacher column t are ``col_ptr[t]:col_ptr[t + 1]``.
        col_rows_E: int32 [E] student rows, sorted by (t, s).
        col_w_E: fp32 [E] weights.
        ell_t_SP: int32 [S, P] teacher id of each row entry, -1 = none.
        ell_w_SP: fp32 [S, P] weights (0 where none).
    """

    col_ptr_W1: torch.Tensor
    col_rows_E: torch.Tensor
    col_w_E: torch.Tensor
    ell_t_SP: torch.Tensor
    ell_w_SP: torch.Tensor


_TABLES: dict[tuple, tuple[ProjectionTables, torch.Tensor]] = {}


def projection_tables(projection_VW: torch.Tensor) -> ProjectionTables:
    """CSC + ELL tables of a sparse projection, built once per matrix (cached, 4 entries).

    Args:
        projection_VW: sparse COO ``M[V, W]`` (frozen; the cache keys on its storage).

    Returns:
        :class:`ProjectionTables` on the matrix's device.
    """
    values = projection_VW._values()
    key = (
        values.data_ptr(),
        projection_VW._indices().data_ptr(),
        values.numel(),
        tuple(projection_VW.shape),
        values.device,
        values._version,
    )
    hit = _TABLES.get(key)
    if hit is not None:
        return hit[0]
    M = projection_VW if projection_VW.is_coalesced() else projection_VW.coalesce()
    S, W = M.shape
    ind_2E, w_E = M.indices(), M.values().to(torch.float32)
    keep_E = w_E != 0
    s_E, t_E, w_E = ind_2E[0][keep_E], ind_2E[1][keep_E], w_E[keep_E]
    device = w_E.device
    counts_S = torch.bincount(s_E, minlength=S)
    P = max(int(counts_S.max()) if s_E.numel() else 0, 1)
    slot_E = torch.arange(s_E.numel(), device=device) - (torch.cumsum(counts_S, 0) - counts_S)[s_E]
    ell_t_SP = torch.full((S, P), -1, dtype=torch.int32, device=device)
    ell_w_SP = torch.zeros((S, P), dtype=torch.float32, device=device)
    ell_t_SP[s_E, slot_E] = t_E.to(torch.int32)
    ell_w_SP[s_E, slot_E] = w_E
    order_E = torch.argsort(t_E * S + s_E)
    col_t_E = t_E[order_E]
    tables = ProjectionTables(
        col_ptr_W1=torch.searchsorted(col_t_E, torch.arange(W + 1, device=device)).contiguous(),
        col_rows_E=s_E[order_E].to(torch.int32).contiguous(),
        col_w_E=w_E[order_E].contiguous(),
        ell_t_SP=ell_t_SP,
        ell_w_SP=ell_w_SP,
    )
    if len(_TABLES) >= 4:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (tables, projection_VW)  # holding M keeps its storage from being reused
    return tables


def _restrict(tables: ProjectionTables, idx_K: torch.Tensor):
    """CSC lists and ELL column positions of ``M[:, idx]`` (one host sync for the entry count)."""
    device = idx_K.device
    K = idx_K.numel()
    starts_K = tables.col_ptr_W1[idx_K]
    counts_K = tables.col_ptr_W1[idx_K + 1] - starts_K
    ptr_K1 = torch.zeros(K + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts_K, 0, out=ptr_K1[1:])
    E = int(ptr_K1[-1])
    cols_E = torch.repeat_interleave(torch.arange(K, device=device), counts_K, output_size=E)
    src_E = starts_K[cols_E] + torch.arange(E, device=device) - ptr_K1[cols_E]
    W = tables.col_ptr_W1.numel() - 1
    pos_W = torch.full((W,), -1, dtype=torch.int32, device=device)
    pos_W[idx_K] = torch.arange(K, dtype=torch.int32, device=device)
    ell_t = tables.ell_t_SP
    ell_j_SP = torch.where(ell_t >= 0, pos_W[ell_t.clamp(min=0).long()], -1)
    # Pack the kept entries of each row to the low slots: the backward kernel stops at the
    # first slot with no entry in its vocab block.
    front_SP = torch.argsort((ell_j_SP < 0).to(torch.int8), dim=1, stable=True)
    ell_j_PS = ell_j_SP.gather(1, front_SP).t().contiguous()
    ell_w_PS = tables.ell_w_SP.gather(1, front_SP).t().contiguous()
    return (
        ptr_K1,
        tables.col_rows_E[src_E].contiguous(),
        cols_E.to(torch.int32),
        tables.col_w_E[src_E].contiguous(),
        ell_j_PS,
        ell_w_PS,
    )


class ProjectRows(torch.autograd.Function):
    """``q[R, K] = softmax(z / T) @ M[:, idx]`` from the logits; backward by ELL gathers.

    Saves the logits, the row logsumexp and q (``sum_j dq q`` is the softmax correction).
    """

    @staticmethod
    def forward(ctx, z_BTV, nidx_R, ptr_K1, rows_E, cols_E, w_E, ell_j_PS, ell_w_PS, temperature):
        kernels = _kd_kernels()
        lse_R = kernels.row_logsumexp(z_BTV, nidx_R, temperature)
        q_RK = kernels.project_rows_forward(z_BTV, lse_R, ptr_K1, rows_E, cols_E, w_E, temperature)
        ctx.save_for_backward(z_BTV, lse_R, q_RK, ell_j_PS, ell_w_PS)
        ctx.temperature = temperature
        return q_RK

    @staticmethod
    def backward(ctx, dq_RK):
        z_BTV, lse_R, q_RK, ell_j_PS, ell_w_PS = ctx.saved_tensors
        dq_RK = dq_RK.to(torch.float32).contiguous()
        dot_R = torch.linalg.vecdot(dq_RK, q_RK)
        dz_BTV = _kd_kernels().project_rows_backward(
            z_BTV, lse_R, dq_RK, dot_R, ell_j_PS, ell_w_PS, ctx.temperature
        )
        return dz_BTV, None, None, None, None, None, None, None, None


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
) -> KDTerms:
    kernels = _kd_kernels()
    zs_BTV = _last_dim_contiguous(student_logits_BTV)
    zt_BUW = _last_dim_contiguous(teacher_logits_BUW.detach())
    W = zt_BUW.shape[-1]
    valid_BC = valid_BC.to(zs_BTV.device)
    N = int(valid_BC.sum())
    t_rows = chunk_rows(teacher_chunk_id_BU, valid_BC, N)
    s_rows = chunk_rows(student_chunk_id_BT, valid_BC, N)
    with torch.no_grad():
        if vocab_topk is None or vocab_topk >= W:
            idx_K = torch.arange(W, device=zt_BUW.device)
        else:  # same ids as reference.select_teacher_columns: exact max, same topk input
            used_R = torch.where(teacher_chunk_id_BU.reshape(-1) >= 0, 0, -1)
            max_W = kernels.column_max(zt_BUW, used_R)
            idx_K = torch.sort(torch.topk(max_W, vocab_topk).indices).values
        zt_BUK = zt_BUW[..., idx_K]
        lse_t_R = kernels.row_logsumexp(zt_BUK, t_rows.nidx_R, temperature)
        teacher_lp_NK = kernels.chunk_mean_columns(
            zt_BUK, lse_t_R, t_rows.order_R, t_rows.offsets_N1, temperature
        )
        del zt_BUK
        restricted = _restrict(projection_tables(projection_VW), idx_K)
    q_RK = ProjectRows.apply(zs_BTV, s_rows.nidx_R, *restricted, float(temperature))
    K = q_RK.shape[1]
    dest_R = torch.where(s_rows.nidx_R >= 0, s_rows.nidx_R, N)
    q_sum_NK = q_RK.new_zeros(N + 1, K).index_add(0, dest_R, q_RK)[:N]
    q_NK = q_sum_NK / s_rows.sizes_N.clamp_min(1).unsqueeze(-1)
    kd = reference.pkl_chunk_kl(teacher_lp_NK, q_NK, reverse_kl).sum() * temperature**2
    return KDTerms(
        kd=kd,
        kl=kd.detach(),
        l1=kd.new_zeros(()),
        correct=reference._argmax_agree(q_NK.detach(), teacher_lp_NK),
        num_valid=valid_BC.sum().to(kd.dtype),
    )


# ---- gold

#: Elements per temporary in the common-vocab KL loop (bounds its extra memory).
_KL_BLOCK_ELEMS = 1 << 26


class GoldStudent(torch.autograd.Function):
    """Student side of the gold loss from the logits: ``(kl_sum, l1_sum, correct)``.

    The chunk gradient is computed in the forward in compact form (common columns ``[N, Mc]``,
    written over the teacher's common block, which is not needed afterwards; uncommon columns
    ``[N, Mu]``, written over the student's uncommon block once its top-m is taken) and
    expanded to ``dz`` by one backward kernel.
    """

    @staticmethod
    def forward(
        ctx, z_BTV, rows, teacher_common_NC, teacher_top_Nm, exact, temperature, reverse_kl
    ):
        kernels = _kd_kernels()
        cs, us = exact["common_student"], exact["uncommon_student"]
        N, Mc = teacher_common_NC.shape
        m = teacher_top_Nm.shape[1]
        V = z_BTV.shape[-1]
        device = z_BTV.device
        lse_R = kernels.row_logsumexp(z_BTV, rows.nidx_R, temperature)
        g_unc_NU = None
        l1_sum = torch.zeros((), dtype=torch.float32, device=device)
        gsum_top_N = torch.zeros(N, dtype=torch.float32, device=device)
        if m > 0 and N > 0:
            s_unc_NU = kernels.chunk_mean_columns(
                z_BTV, lse_R, rows.order_R, rows.offsets_N1, temperature, us
            )
            top = torch.topk(s_unc_NU, m, dim=-1)
            s_top_Nm = top.values.exp_()
            diff_Nm = s_top_Nm - teacher_top_Nm
            l1_sum = diff_Nm.abs().sum()
            g_top_Nm = diff_Nm.sign_().mul_(s_top_Nm)  # d|e^s - u| / ds
            gsum_top_N = g_top_Nm.sum(-1)
            g_unc_NU = s_unc_NU.zero_().scatter_(1, top.indices, g_top_Nm)  # reuse the block
            del top, diff_Nm, s_top_Nm, g_top_Nm
        kl_sum = torch.zeros((), dtype=torch.float32, device=device)
        correct = torch.zeros((), dtype=torch.float32, device=device)
        gsum_common_N = torch.zeros(N, dtype=torch.float32, device=device)
        g_common_NC = teacher_common_NC  # overwritten block by block with the chunk gradient
        if Mc > 0 and N > 0:
            s_common_NC = kernels.chunk_mean_columns(
                z_BTV, lse_R, rows.order_R, rows.offsets_N1, temperature, cs
            )
            step = max(1, _KL_BLOCK_ELEMS // Mc)
            for i in range(0, N, step):
                s, u = s_common_NC[i : i + step], g_common_NC[i : i + step]
                correct += (s.argmax(-1) == u.argmax(-1)).sum()
                if reverse_kl:  # kl = sum e^s (s - u); d/ds = e^s (s - u + 1)
                    e, d = s.exp(), s - u
                    kl_sum += torch.linalg.vecdot(e, d).sum()
                    u.copy_(d.add_(1.0).mul_(e))
                else:  # kl = sum e^u (u - s); d/ds = -e^u
                    e = u.exp()
                    kl_sum += torch.linalg.vecdot(e, u - s).sum()
                    u.copy_(e.neg_())
                gsum_common_N[i : i + step] = u.sum(-1)
            del s_common_NC
        # Where each vocab id's chunk gradient lives (the code of kd_fused.gold_backward).
        cpos_V = torch.full((V,), -1, dtype=torch.int32, device=device)
        cpos_V[cs] = torch.arange(Mc, dtype=torch.int32, device=device)
        if g_unc_NU is not None:
            cpos_V[us] = -2 - torch.arange(us.numel(), dtype=torch.int32, device=device)
        coef_N = 1.0 / (temperature * rows.sizes_N.clamp_min(1))
        ctx.save_for_backward(
            z_BTV, lse_R, rows.nidx_R, g_common_NC, g_unc_NU, cpos_V, gsum_common_N, gsum_top_N,
            coef_N,
        )  # fmt: skip
        ctx.temperature = temperature
        ctx.mark_non_differentiable(correct)
        return kl_sum, l1_sum, correct

    @staticmethod
    def backward(ctx, d_kl, d_l1, d_correct):
        (z_BTV, lse_R, nidx_R, g_common_NC, g_unc_NU, cpos_V, gsum_common_N, gsum_top_N,
         coef_N) = ctx.saved_tensors  # fmt: skip
        zero = torch.zeros((), dtype=torch.float32, device=z_BTV.device)
        gscale_2 = torch.stack(
            [
                zero if d_kl is None else d_kl.to(torch.float32),
                zero if d_l1 is None else d_l1.to(torch.float32),
            ]
        )
        gsum_N = gscale_2[0] * gsum_common_N + gscale_2[1] * gsum_top_N
        dz_BTV = _kd_kernels().gold_backward(
            z_BTV, lse_R, nidx_R, g_common_NC, g_unc_NU, cpos_V, gsum_N, coef_N, gscale_2,
            ctx.temperature,
        )  # fmt: skip
        return dz_BTV, None, None, None, None, None, None


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
) -> KDTerms:
    kernels = _kd_kernels()
    zs_BTV = _last_dim_contiguous(student_logits_BTV)
    zt_BUW = _last_dim_contiguous(teacher_logits_BUW.detach())
    valid_BC = valid_BC.to(zs_BTV.device)
    N = int(valid_BC.sum())
    t_rows = chunk_rows(teacher_chunk_id_BU, valid_BC, N)
    s_rows = chunk_rows(student_chunk_id_BT, valid_BC, N)
    ut = exact_map["uncommon_teacher"]
    m = min(exact_map["uncommon_student"].numel(), ut.numel(), uncommon_topk)
    with torch.no_grad():
        lse_t_R = kernels.row_logsumexp(zt_BUW, t_rows.nidx_R, temperature)
        if m > 0:
            u_unc_NX = kernels.chunk_mean_columns(
                zt_BUW, lse_t_R, t_rows.order_R, t_rows.offsets_N1, temperature, ut
            )
            u_top_Nm = torch.topk(u_unc_NX, m, dim=-1).values.exp_()
            del u_unc_NX
        else:
            u_top_Nm = torch.zeros((N, 0), dtype=torch.float32, device=zt_BUW.device)
        u_common_NC = kernels.chunk_mean_columns(
            zt_BUW,
            lse_t_R,
            t_rows.order_R,
            t_rows.offsets_N1,
            temperature,
            exact_map["common_teacher"],
        )
    kl, l1, correct = GoldStudent.apply(
        zs_BTV, s_rows, u_common_NC, u_top_Nm, exact_map, float(temperature), bool(reverse_kl)
    )
    scale = temperature**2
    kl, l1 = kl * scale, l1 * scale
    return KDTerms(
        kd=kl + l1,
        kl=kl.detach(),
        l1=l1.detach(),
        correct=correct,
        num_valid=valid_BC.sum().to(torch.float32),
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
    projection_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> KDTerms:
    """P-KL summed over valid chunks, kernel-backed. See :func:`reference.pkl_kd_loss`.

    Fused path when :func:`fused_path_available` (the projection tables are built once per
    ``projection_VW`` and cached); otherwise the composed kernels, where ``projection_topk``
    (the dense ``(indices [V_rows, K], likelihoods)`` form of M on the logits' device) selects
    the projection-by-gather kernel over :class:`~xtoken_core.losses.utils.Fp32SparseMM`.

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
        projection_topk: dense form of M (composed path only).

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    if fused_path_available(student_logits_BTV, teacher_logits_BUW):
        return _pkl_fused(
            student_logits_BTV,
            teacher_logits_BUW,
            student_chunk_id_BT,
            teacher_chunk_id_BU,
            valid_BC,
            projection_VW,
            temperature=temperature,
            vocab_topk=vocab_topk,
            reverse_kl=reverse_kl,
        )
    return _pkl_composed(
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        projection_VW,
        temperature=temperature,
        vocab_topk=vocab_topk,
        reverse_kl=reverse_kl,
        projection_topk=projection_topk,
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
    """Gold / relaxed gold summed over valid chunks, kernel-backed. See :func:`reference.gold_kd_loss`.

    Fused path when :func:`fused_path_available`, else the composed kernels.

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

    Returns:
        :class:`~xtoken_core.losses.reference.KDTerms`.

    Raises:
        RuntimeError: the kernels are not importable.
    """
    if fused_path_available(student_logits_BTV, teacher_logits_BUW):
        return _gold_fused(
            student_logits_BTV,
            teacher_logits_BUW,
            student_chunk_id_BT,
            teacher_chunk_id_BU,
            valid_BC,
            exact_map,
            temperature=temperature,
            uncommon_topk=uncommon_topk,
            reverse_kl=reverse_kl,
        )
    return _gold_composed(
        student_logits_BTV,
        teacher_logits_BUW,
        student_chunk_id_BT,
        teacher_chunk_id_BU,
        valid_BC,
        exact_map,
        temperature=temperature,
        uncommon_topk=uncommon_topk,
        reverse_kl=reverse_kl,
    )
