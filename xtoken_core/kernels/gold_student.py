"""Fused gold loss, student side: the compact chunk gradient and its backward kernel to ``dz``.

:class:`GoldStudent` computes the common-vocab KL (:func:`gold_common`: both sides' chunk
averages, the KL, its chunk gradient and the argmax agreement in one pass over the logits) and
the uncommon top-m L1 (both sides' chunk averages, the caller's
:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns`, compared by
:func:`~xtoken_core.kernels.topm_l1.topm_l1_signs`), and keeps the chunk gradient compact: the
common columns' ``[N, Mc]`` fp32, the uncommon columns' as the student's chunk means and int8
top-m states (``+-e^s`` or 0); :func:`gold_backward` expands both to the logits gradient. Block
sizes come from :data:`xtoken_core.kernels.logit_rows.KERNEL_CONFIG`.

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, N valid chunks,
    C common-vocab columns (Mc of them), U uncommon student columns, m uncommon top-m.

* common KL of chunk n, with ``s`` / ``u`` the student / teacher chunk-mean log-probs at the
  common columns: forward ``kl_n = sum_c e^u (u - s)``, chunk gradient ``g = -e^u``; reverse
  ``kl_n = sum_c e^s (s - u)``, ``g = e^s (s - u + 1)``.
* backward: ``dz[r, v] = (G[n, v] - p[r, v] gsum_n) / (T n_size)`` where ``G`` is the
  chunk gradient kept as two compact blocks (common columns, uncommon columns).
"""

from __future__ import annotations

import logging

import torch

from ._utils import LOG2E, MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, tl
from .logit_rows import KERNEL_CONFIG, block_for
from .topm_l1 import topm_l1_signs

logger = logging.getLogger(__name__)

__all__ = ["CommonKL", "GoldStudent", "gold_backward", "gold_common", "vocab_places"]

#: The common KL's per-chunk sums: chunks per program, column blocks per step.
SUMS_TILE = {"chunks": 16, "blocks": 64}


if tl is not None:

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=(
            "lse_R_ptr",
            "nidx_R_ptr",
            "cpos_V_ptr",
            "gsum_N2_ptr",
            "sizes_N_ptr",
            "dcommon_ptr",
            "duncommon_ptr",
        ),
    )
    def _gold_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        nidx_R_ptr,
        gc_ptr,
        su_ptr,
        state_ptr,
        cpos_V_ptr,
        gsum_N2_ptr,
        sizes_N_ptr,
        dcommon_ptr,
        duncommon_ptr,
        dz_ptr,
        T,
        V,
        stride_b,
        stride_t,
        gc_stride,
        su_stride,
        state_stride,
        scale2,
        inv_temp,
        HAS_COMMON: tl.constexpr,
        HAS_UNCOMMON: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        # Program (row r, BLOCKS vocab blocks), n = chunk of r; c = cpos[v] says where v's
        # chunk gradient lives: c >= 0 common block, c <= -2 uncommon column j = -c - 2, -1
        # nowhere.
        #   G = dcommon gc[n, c] + duncommon gu[n, j]
        #   dz[r, v] = (G - p[r, v] (dcommon gsum[n, 0] + duncommon gsum[n, 1])) / (T |n|)
        # gu = e^s, -e^s or 0 with s = su[n, j] the student's chunk mean, as the top-m's state
        # of (n, j) says (1, 2, 0: kernels.topm_l1.TopmSigns).
        r = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BLOCKS * BLOCK_V
        n = tl.load(nidx_R_ptr + r).to(tl.int64)
        out_row = dz_ptr + r * V
        if n >= 0:
            z_row = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            gc_row = gc_ptr + n * gc_stride
            state_row = state_ptr + n * state_stride
            su_row = su_ptr + n * su_stride
            lse2 = tl.load(lse_R_ptr + r) * 1.4426950408889634
            dc, du = tl.load(dcommon_ptr), tl.load(duncommon_ptr)
            gsum = dc * tl.load(gsum_N2_ptr + 2 * n) + du * tl.load(gsum_N2_ptr + 2 * n + 1)
            coef = inv_temp / tl.maximum(tl.load(sizes_N_ptr + n), 1.0)
            for i in range(0, BLOCKS):
                v = first + i * BLOCK_V + tl.arange(0, BLOCK_V)
                vm = v < V
                z = tl.load(z_row + v, mask=vm, other=0.0).to(tl.float32)
                p = tl.exp2(z * scale2 - lse2)
                c = tl.load(cpos_V_ptr + v, mask=vm, other=-1)
                g = tl.full((BLOCK_V,), 0.0, tl.float32)
                if HAS_COMMON:
                    g += dc * tl.load(gc_row + c, mask=c >= 0, other=0.0)
                if HAS_UNCOMMON:
                    um = c <= -2
                    state = tl.load(state_row + (-2 - c), mask=um, other=0)
                    e = tl.exp(tl.load(su_row + (-2 - c), mask=um, other=0.0))
                    g += du * tl.where(state == 1, e, tl.where(state == 2, -e, 0.0))
                dz = (g - p * gsum) * coef
                tl.store(out_row + v, dz.to(dz_ptr.dtype.element_ty), mask=vm)
        else:
            for i in range(0, BLOCKS):
                v = first + i * BLOCK_V + tl.arange(0, BLOCK_V)
                zero = tl.full((BLOCK_V,), 0.0, tl.float32)
                tl.store(out_row + v, zero.to(dz_ptr.dtype.element_ty), mask=v < V)

    @lazy_jit(
        do_not_specialize=("Ts", "Tt"),
        do_not_specialize_on_alignment=(
            "lse_s_ptr",
            "s_order_ptr",
            "s_offsets_ptr",
            "lse_t_ptr",
            "t_order_ptr",
            "t_offsets_ptr",
        ),
    )
    def _gold_common_kernel(
        zs_ptr,
        lse_s_ptr,
        s_order_ptr,
        s_offsets_ptr,
        cs_ptr,
        zt_ptr,
        lse_t_ptr,
        t_order_ptr,
        t_offsets_ptr,
        ct_ptr,
        g_ptr,
        part_ptr,
        Ts,
        Tt,
        Mc,
        n_blocks,
        s_stride_b,
        s_stride_t,
        t_stride_b,
        t_stride_t,
        g_stride,
        inv_temp,
        first_block,
        REVERSE: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Program (chunk n, column block): both sides' chunk means at the common columns
        #   s[c] = mean_{r in n, student} (zs[r, cs[c]] / T - lse_s[r]),  u[c] likewise (teacher),
        # the KL summand and the chunk gradient g[c] (stored: the backward's common block).
        # Partials per (n, block): KL, sum g, max s and its first column, max u and its first.
        # (A launch covers the column blocks from first_block on.)
        n = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1) + first_block
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < Mc
        col_s = tl.load(cs_ptr + c, mask=cm, other=0).to(tl.int64)
        col_t = tl.load(ct_ptr + c, mask=cm, other=0).to(tl.int64)
        s0 = tl.load(s_offsets_ptr + n)
        s1 = tl.load(s_offsets_ptr + n + 1)
        s = tl.full((BLOCK_C,), 0.0, tl.float32)
        for k in range(s0, s1):
            r = tl.load(s_order_ptr + k)
            row = zs_ptr + (r // Ts) * s_stride_b + (r % Ts) * s_stride_t
            z = tl.load(row + col_s, mask=cm, other=0.0).to(tl.float32)
            s += z * inv_temp - tl.load(lse_s_ptr + r)
        s = s / tl.maximum(s1 - s0, 1).to(tl.float32)
        t0 = tl.load(t_offsets_ptr + n)
        t1 = tl.load(t_offsets_ptr + n + 1)
        u = tl.full((BLOCK_C,), 0.0, tl.float32)
        for k in range(t0, t1):
            r = tl.load(t_order_ptr + k)
            row = zt_ptr + (r // Tt) * t_stride_b + (r % Tt) * t_stride_t
            z = tl.load(row + col_t, mask=cm, other=0.0).to(tl.float32)
            u += z * inv_temp - tl.load(lse_t_ptr + r)
        u = u / tl.maximum(t1 - t0, 1).to(tl.float32)
        if REVERSE:
            e = tl.exp(s)
            d = s - u
            kl = e * d
            g = (d + 1.0) * e
        else:
            e = tl.exp(u)
            kl = e * (u - s)
            g = -e
        g = tl.where(cm, g, 0.0)
        tl.store(g_ptr + n * g_stride + c, g, mask=cm)
        # first column of the block max (as -max(-c) over the lanes holding it)
        sm = tl.where(cm, s, float("-inf"))
        um = tl.where(cm, u, float("-inf"))
        ms = tl.reduce(sm, 0, MAX_COMBINE)
        mu = tl.reduce(um, 0, MAX_COMBINE)
        ia = -tl.reduce(tl.where(sm == ms, -c, -Mc), 0, MAX_COMBINE)
        ib = -tl.reduce(tl.where(um == mu, -c, -Mc), 0, MAX_COMBINE)
        out = part_ptr + (n * n_blocks + cb) * 6
        tl.store(out, tl.reduce(tl.where(cm, kl, 0.0), 0, SUM_COMBINE))
        tl.store(out + 1, tl.reduce(g, 0, SUM_COMBINE))
        tl.store(out + 2, ms)
        tl.store(out + 3, ia.to(tl.float32))
        tl.store(out + 4, mu)
        tl.store(out + 5, ib.to(tl.float32))

    @lazy_jit(do_not_specialize=("N", "n_blocks"))
    def _common_sums_kernel(
        part_ptr, stats_ptr, N, n_blocks, Mc, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr
    ):
        # Chunks n of one block, over their column blocks' partials (KL, sum g, max s and its
        # first column, max u and its first), BLOCK_B blocks a step: stats[n] = (KL, sum g,
        # 1.0 where the first column of the row max of s is that of u). Of the blocks holding
        # the row max, the one of the smallest column gives it (its first column).
        n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        nm = n < N
        kl = tl.full((BLOCK_N,), 0.0, tl.float32)
        gsum = tl.full((BLOCK_N,), 0.0, tl.float32)
        best_s = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        best_u = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        arg_s = tl.full((BLOCK_N,), 0.0, tl.float32) + Mc
        arg_u = tl.full((BLOCK_N,), 0.0, tl.float32) + Mc
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            mask = nm[:, None] & (b < n_blocks)[None, :]
            part = part_ptr + (n[:, None] * n_blocks + b[None, :]) * 6
            kl += tl.reduce(tl.load(part, mask=mask, other=0.0), 1, SUM_COMBINE)
            gsum += tl.reduce(tl.load(part + 1, mask=mask, other=0.0), 1, SUM_COMBINE)
            ms = tl.load(part + 2, mask=mask, other=float("-inf"))
            mu = tl.load(part + 4, mask=mask, other=float("-inf"))
            top_s = tl.reduce(ms, 1, MAX_COMBINE)
            top_u = tl.reduce(mu, 1, MAX_COMBINE)
            at_s = tl.load(part + 3, mask=mask & (ms == top_s[:, None]), other=Mc)
            at_u = tl.load(part + 5, mask=mask & (mu == top_u[:, None]), other=Mc)
            at_s = -tl.reduce(-at_s, 1, MAX_COMBINE)
            at_u = -tl.reduce(-at_u, 1, MAX_COMBINE)
            arg_s = tl.where(top_s > best_s, at_s, arg_s)
            arg_u = tl.where(top_u > best_u, at_u, arg_u)
            best_s = tl.maximum(best_s, top_s)
            best_u = tl.maximum(best_u, top_u)
        tl.store(stats_ptr + n * 3, kl, mask=nm)
        tl.store(stats_ptr + n * 3 + 1, gsum, mask=nm)
        tl.store(stats_ptr + n * 3 + 2, (arg_s == arg_u).to(tl.float32), mask=nm)


# --------------------------------------------------------------------------- host wrapper


def gold_common(
    zs_BTV: torch.Tensor,
    lse_s_R: torch.Tensor,
    s_rows,
    common_student_C: torch.Tensor,
    zt_BUW: torch.Tensor,
    lse_t_R: torch.Tensor,
    t_rows,
    common_teacher_C: torch.Tensor,
    temperature: float,
    reverse_kl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Common-vocab KL of every valid chunk, its chunk gradient and the argmax agreement.

    ``s`` / ``u`` are the student / teacher chunk means of ``log_softmax(z / T)`` at the
    common columns (``common_student[c]`` pairs with ``common_teacher[c]``); see the module
    docstring for the KL and ``g``.

    Args:
        zs_BTV: [B, T, V] student logits, last dim contiguous.
        lse_s_R: [B*T] fp32 student row logsumexp of ``z / T``.
        s_rows: the student side's valid-chunk rows (``order_R``, ``offsets_N1``).
        common_student_C: [Mc] int student ids of the common vocabulary.
        zt_BUW: [B, U, W] teacher logits, last dim contiguous.
        lse_t_R: [B*U] fp32 teacher row logsumexp of ``z / T``.
        t_rows: the teacher side's valid-chunk rows (same chunk numbering).
        common_teacher_C: [Mc] int teacher ids paired with ``common_student_C``.
        temperature: T.
        reverse_kl: KL(student || teacher) instead of KL(teacher || student).

    Returns:
        ``(g_NC, stats_N3)``: [N, Mc] fp32 chunk gradient ``g``; [N, 3] fp32 per chunk: the
        KL, ``sum_c g``, and 1.0 where the argmaxes of ``s`` and ``u`` agree.
    """
    common = CommonKL(
        zs_BTV, lse_s_R, s_rows, common_student_C, zt_BUW, lse_t_R, t_rows, common_teacher_C,
        temperature, reverse_kl,
    )  # fmt: skip
    return common.result()


class CommonKL:
    """:func:`gold_common` launched in slices of column blocks, so that slices can fill the GPU
    while the host waits for other work (:meth:`launch`); :meth:`result` launches the rest and
    reduces. Arguments: those of :func:`gold_common`."""

    def __init__(
        self, zs_BTV, lse_s_R, s_rows, common_student_C, zt_BUW, lse_t_R, t_rows,
        common_teacher_C, temperature, reverse_kl,
    ) -> None:  # fmt: skip
        N = s_rows.offsets_N1.numel() - 1
        Mc = common_student_C.numel()
        device = zs_BTV.device
        self.g_NC = torch.empty((N, Mc), device=device, dtype=torch.float32)
        block = block_for("gcom_block_c", Mc, 16)
        self.n_blocks = cdiv(Mc, block) if N and Mc else 0
        self.part_NB6 = torch.empty((N, self.n_blocks, 6), device=device, dtype=torch.float32)
        self.launched = 0
        self._args = (
            zs_BTV, lse_s_R, s_rows.order_R, s_rows.offsets_N1, common_student_C, zt_BUW,
            lse_t_R, t_rows.order_R, t_rows.offsets_N1, common_teacher_C, self.g_NC,
            self.part_NB6, zs_BTV.shape[1], zt_BUW.shape[1], Mc, self.n_blocks, zs_BTV.stride(0),
            zs_BTV.stride(1), zt_BUW.stride(0), zt_BUW.stride(1), self.g_NC.stride(0),
            1.0 / temperature,
        )  # fmt: skip
        self._meta = dict(
            REVERSE=bool(reverse_kl), BLOCK_C=block, num_warps=KERNEL_CONFIG["gcom_warps"]
        )

    def launch(self, blocks: int | None = None) -> None:
        """Queue the next ``blocks`` column blocks of every chunk (None: all the rest)."""
        N = self.g_NC.shape[0]
        count = self.n_blocks - self.launched
        count = count if blocks is None else min(blocks, count)
        if count > 0:
            _gold_common_kernel[(N, count)](*self._args, self.launched, **self._meta)
            self.launched += count

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g_NC, stats_N3)`` of :func:`gold_common`, after launching the blocks left."""
        self.launch()
        N, Mc = self.g_NC.shape
        if self.n_blocks == 0:
            return self.g_NC, torch.zeros((N, 3), device=self.g_NC.device, dtype=torch.float32)
        # (column ids < 2**24 are exact in the fp32 partials)
        stats_N3 = torch.empty((N, 3), device=self.g_NC.device, dtype=torch.float32)
        _common_sums_kernel[(cdiv(N, SUMS_TILE["chunks"]),)](
            self.part_NB6, stats_N3, N, self.n_blocks, Mc, BLOCK_N=SUMS_TILE["chunks"],
            BLOCK_B=SUMS_TILE["blocks"],
        )  # fmt: skip
        return self.g_NC, stats_N3


def gold_backward(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    nidx_R: torch.Tensor,
    g_common_NC: torch.Tensor | None,
    uncommon: tuple[torch.Tensor, torch.Tensor] | None,
    cpos_V: torch.Tensor,
    gsum_N2: torch.Tensor,
    sizes_N: torch.Tensor,
    d_common: torch.Tensor,
    d_uncommon: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logits gradient of a loss on chunk-averaged log-probs given as compact chunk gradients.

    The chunk gradient of chunk n at vocab id v is ``d_common * g_common[n, c]`` when
    ``c = cpos[v] >= 0``, ``d_uncommon * g_uncommon[n, -c - 2]`` when ``c <= -2``, else 0, where
    ``g_uncommon = topm_gradient(s_unc_NU, state_NU)`` (made here, never stored).

    Args:
        z_BTV: [B, T, V] logits.
        lse_R: [B*T] fp32 row logsumexp.
        nidx_R: [B*T] int valid-chunk index per row, -1 = none (gradient 0).
        g_common_NC: [N, Mc] fp32, or None.
        uncommon: ``(s_unc_NU, state_NU)``: [N, Mu] fp32 the student's uncommon chunk means and
            [N, Mu] int8 their top-m states
            (:func:`~xtoken_core.kernels.topm_l1.topm_l1_signs`); or None.
        cpos_V: [V] int32 position code (see above).
        gsum_N2: [N, 2] fp32 contiguous, the sums over the columns of ``g_common`` and of
            ``g_uncommon`` (unscaled) of each chunk.
        sizes_N: [N] fp32 chunk sizes (rows of each chunk).
        d_common: 0-dim fp32 scale of the common part (its upstream gradient).
        d_uncommon: 0-dim fp32 scale of the uncommon part.
        temperature: softmax temperature.

    Returns:
        dz_BTV in the logits dtype, contiguous.
    """
    B, T, V = z_BTV.shape
    R = B * T
    dz_BTV = torch.empty((B, T, V), device=z_BTV.device, dtype=z_BTV.dtype)
    if R == 0 or V == 0:
        return dz_BTV
    has_c = g_common_NC is not None and g_common_NC.numel() > 0
    has_u = uncommon is not None and uncommon[0].numel() > 0
    if has_u:
        tables = uncommon
    else:  # any valid pointers
        tables = (gsum_N2, cpos_V)
    bv = block_for("gbwd_block_v", V, 16)
    blocks = min(KERNEL_CONFIG["gbwd_blocks"], cdiv(V, bv))
    _gold_bwd_kernel[(R, cdiv(V, bv * blocks))](
        z_BTV,
        lse_R,
        nidx_R,
        g_common_NC if has_c else gsum_N2,  # any valid pointer when absent
        *tables,
        cpos_V,
        gsum_N2,
        sizes_N,
        d_common,
        d_uncommon,
        dz_BTV,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        g_common_NC.stride(0) if has_c else 0,
        tables[0].stride(0) if has_u else 0,
        tables[1].stride(0) if has_u else 0,
        LOG2E / temperature,
        1.0 / temperature,
        HAS_COMMON=has_c,
        HAS_UNCOMMON=has_u,
        BLOCK_V=bv,
        BLOCKS=blocks,
        num_warps=KERNEL_CONFIG["gbwd_warps"],
    )
    return dz_BTV


# --------------------------------------------------------------------------- autograd


def vocab_places(
    common_student_C: torch.Tensor, uncommon_student_U: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Where each student id's chunk gradient lives in the compact tables (the ``cpos`` of
    :func:`gold_backward`): ``c`` at ``common_student[c]``, ``-2 - j`` at
    ``uncommon_student[j]``, -1 elsewhere; [V] int32 on the ids' device."""
    device = common_student_C.device
    cpos_V = torch.full((vocab_size,), -1, dtype=torch.int32, device=device)
    cpos_V[common_student_C] = torch.arange(
        common_student_C.numel(), dtype=torch.int32, device=device
    )
    cpos_V[uncommon_student_U] = -2 - torch.arange(
        uncommon_student_U.numel(), dtype=torch.int32, device=device
    )
    return cpos_V


class GoldStudent(torch.autograd.Function):
    """Student side of the gold loss from the logits: ``(kl_sum, l1_sum, correct)``.

    The chunk gradient is computed in the forward in compact form (common columns ``[N, Mc]``
    by :func:`gold_common`, which reads the teacher's common columns from its logits; uncommon
    columns as the student's uncommon chunk means with the top-m states of
    :func:`~xtoken_core.kernels.topm_l1.topm_l1_signs` against the teacher's) and expanded to
    ``dz`` by one backward kernel.

    Inputs of :meth:`forward` besides the logits ``z_BTV``: ``lse_R`` the student's row
    logsumexps of ``z / T``; ``rows`` the student's valid-chunk rows; ``teacher`` =
    ``(zt_BUW, lse_t_R, t_rows)``; ``unc_means`` = ``(s_unc_NU, t_unc_NX)`` both sides' uncommon
    chunk means (:func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns`, made by the caller
    so that the GPU has them to run while the host prepares the rest; None without uncommon
    columns) and ``hist_2NK`` their coarse histograms (student ``[0]``, teacher ``[1]``);
    ``m``, ``exact`` (the common / uncommon ids), ``places_V`` (their :func:`vocab_places`, or
    None: made here), ``temperature``, ``reverse_kl``.
    """

    @staticmethod
    def forward(
        ctx,
        z_BTV,
        lse_R,
        rows,
        teacher,
        unc_means,
        hist_2NK,
        m,
        exact,
        places_V,
        temperature,
        reverse_kl,
    ):
        cs, us = exact["common_student"], exact["uncommon_student"]
        zt_BUW, lse_t_R, t_rows = teacher
        N = rows.offsets_N1.numel() - 1
        V = z_BTV.shape[-1]
        device = z_BTV.device
        uncommon = None
        has_uncommon = m > 0 and N > 0
        # where each vocab id's chunk gradient lives (the code of gold_backward)
        cpos_V = vocab_places(cs, us, V) if places_V is None else places_V
        common = CommonKL(
            z_BTV, lse_R, rows, cs, zt_BUW, lse_t_R, t_rows, exact["common_teacher"],
            temperature, reverse_kl,
        )  # fmt: skip
        if has_uncommon:
            s_unc_NU, teacher_unc_NX = unc_means
            # the signs of d|e^s_(j) - u_(j)| / ds, kept as tables the backward reads; a quarter
            # of the common KL's blocks fills the GPU while the host waits in the top-m
            quarter = cdiv(common.n_blocks, 4)
            signs = topm_l1_signs(
                s_unc_NU, teacher_unc_NX, m, hist_2NK=hist_2NK,
                before_wait=lambda: common.launch(quarter),
            )  # fmt: skip
            uncommon = (s_unc_NU, signs.state_NA)
            l1_sum, gsum_top_N = signs.l1_N.sum(), signs.gsum_N
        else:
            l1_sum = torch.zeros((), dtype=torch.float32, device=device)
            gsum_top_N = torch.zeros(N, dtype=torch.float32, device=device)
        g_common_NC, stats_N3 = common.result()
        totals_3 = stats_N3.sum(0)
        kl_sum, correct = totals_3[0], totals_3[2]
        gsum_N2 = torch.stack([stats_N3[:, 1], gsum_top_N], 1)  # the chunk gradients' sums
        ctx.save_for_backward(
            z_BTV, lse_R, rows.nidx_R, g_common_NC, cpos_V, gsum_N2, rows.sizes_N,
            *(() if uncommon is None else uncommon),
        )  # fmt: skip
        ctx.temperature = temperature
        ctx.mark_non_differentiable(correct)
        return kl_sum, l1_sum, correct

    @staticmethod
    def backward(ctx, d_kl, d_l1, d_correct):
        (z_BTV, lse_R, nidx_R, g_common_NC, cpos_V, gsum_N2, sizes_N,
         *unc) = ctx.saved_tensors  # fmt: skip
        dz_BTV = gold_backward(
            z_BTV, lse_R, nidx_R, g_common_NC, tuple(unc) if unc else None, cpos_V, gsum_N2,
            sizes_N, d_kl.float(), d_l1.float(), ctx.temperature,
        )  # fmt: skip
        return dz_BTV, None, None, None, None, None, None, None, None, None, None
