"""Fused gold loss, student side: the compact chunk gradient and its backward kernel to ``dz``.

:class:`GoldStudent` computes the common-vocab KL and the uncommon top-m L1 from the logits
(chunk averages by :func:`~xtoken_core.kernels.logit_rows.chunk_mean_columns`) and keeps the
chunk gradient as two compact blocks; :func:`gold_backward` expands it to the logits gradient.
Block sizes come from :data:`xtoken_core.kernels.logit_rows.KERNEL_CONFIG`.

Legend (shape suffixes):
    R rows of the logits (flattened B x T), V vocabulary of the logits, N valid chunks,
    C common-vocab columns (Mc of them), U uncommon student columns, m uncommon top-m.

* backward: ``dz[r, v] = (G[n, v] - p[r, v] gsum_n) / (T n_size)`` where ``G`` is the
  chunk gradient kept as two compact blocks (common columns, uncommon columns).
"""

from __future__ import annotations

import logging

import torch

from ._utils import LOG2E, cdiv, lazy_jit, tl
from .logit_rows import KERNEL_CONFIG, block_for, chunk_mean_columns, row_logsumexp

logger = logging.getLogger(__name__)

__all__ = ["GoldStudent", "gold_backward"]


if tl is not None:

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=(
            "lse_R_ptr",
            "nidx_R_ptr",
            "cpos_V_ptr",
            "gsum_N_ptr",
            "coef_N_ptr",
            "gscale_ptr",
        ),
    )
    def _gold_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        nidx_R_ptr,
        gc_ptr,
        gu_ptr,
        cpos_V_ptr,
        gsum_N_ptr,
        coef_N_ptr,
        gscale_ptr,
        dz_ptr,
        T,
        V,
        stride_b,
        stride_t,
        gc_stride,
        gu_stride,
        scale2,
        HAS_COMMON: tl.constexpr,
        HAS_UNCOMMON: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # Program (row r, vocab block), n = chunk of r; c = cpos[v] says where v's chunk
        # gradient lives: c >= 0 common block, c <= -2 uncommon block at -c - 2, -1 nowhere.
        #   G = gscale[0] gc[n, c] + gscale[1] gu[n, -c - 2]
        #   dz[r, v] = (G - p[r, v] gsum[n]) coef[n]
        r = tl.program_id(0).to(tl.int64)
        vb = tl.program_id(1)
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = v < V
        n = tl.load(nidx_R_ptr + r).to(tl.int64)
        out_ptr = dz_ptr + r * V + v
        if n >= 0:
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            z = tl.load(row_ptr + v, mask=vm, other=0.0).to(tl.float32)
            p = tl.exp2(z * scale2 - tl.load(lse_R_ptr + r) * 1.4426950408889634)
            c = tl.load(cpos_V_ptr + v, mask=vm, other=-1)
            g = tl.full((BLOCK_V,), 0.0, tl.float32)
            if HAS_COMMON:
                gc = tl.load(gc_ptr + n * gc_stride + c, mask=c >= 0, other=0.0)
                g += tl.load(gscale_ptr) * gc
            if HAS_UNCOMMON:
                gu = tl.load(gu_ptr + n * gu_stride + (-2 - c), mask=c <= -2, other=0.0)
                g += tl.load(gscale_ptr + 1) * gu
            dz = (g - p * tl.load(gsum_N_ptr + n)) * tl.load(coef_N_ptr + n)
            tl.store(out_ptr, dz.to(dz_ptr.dtype.element_ty), mask=vm)
        else:
            tl.store(
                out_ptr,
                tl.full((BLOCK_V,), 0.0, tl.float32).to(dz_ptr.dtype.element_ty),
                mask=vm,
            )


# --------------------------------------------------------------------------- host wrapper


def gold_backward(
    z_BTV: torch.Tensor,
    lse_R: torch.Tensor,
    nidx_R: torch.Tensor,
    g_common_NC: torch.Tensor | None,
    g_uncommon_NU: torch.Tensor | None,
    cpos_V: torch.Tensor,
    gsum_N: torch.Tensor,
    coef_N: torch.Tensor,
    gscale_2: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logits gradient of a loss on chunk-averaged log-probs given as compact chunk gradients.

    The chunk gradient of chunk n at vocab id v is ``gscale[0] * g_common[n, c]`` when
    ``c = cpos[v] >= 0``, ``gscale[1] * g_uncommon[n, -c - 2]`` when ``c <= -2``, else 0.

    Args:
        z_BTV: [B, T, V] logits.
        lse_R: [B*T] fp32 row logsumexp.
        nidx_R: [B*T] int valid-chunk index per row, -1 = none (gradient 0).
        g_common_NC: [N, Mc] fp32, or None.
        g_uncommon_NU: [N, Mu] fp32, or None.
        cpos_V: [V] int32 position code (see above).
        gsum_N: [N] fp32, the total (scaled) chunk gradient of each chunk.
        coef_N: [N] fp32, ``1 / (temperature * chunk size)``.
        gscale_2: [2] fp32 scales of the common and uncommon parts (upstream gradients).
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
    has_u = g_uncommon_NU is not None and g_uncommon_NU.numel() > 0
    bv = block_for("gbwd_block_v", V, 16)
    _gold_bwd_kernel[(R, cdiv(V, bv))](
        z_BTV,
        lse_R,
        nidx_R,
        g_common_NC if has_c else gsum_N,  # any valid pointer when absent
        g_uncommon_NU if has_u else gsum_N,
        cpos_V,
        gsum_N,
        coef_N,
        gscale_2,
        dz_BTV,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        g_common_NC.stride(0) if has_c else 0,
        g_uncommon_NU.stride(0) if has_u else 0,
        LOG2E / temperature,
        HAS_COMMON=has_c,
        HAS_UNCOMMON=has_u,
        BLOCK_V=bv,
        num_warps=KERNEL_CONFIG["gbwd_warps"],
    )
    return dz_BTV


# --------------------------------------------------------------------------- autograd


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
        cs, us = exact["common_student"], exact["uncommon_student"]
        N, Mc = teacher_common_NC.shape
        m = teacher_top_Nm.shape[1]
        V = z_BTV.shape[-1]
        device = z_BTV.device
        lse_R = row_logsumexp(z_BTV, rows.nidx_R, temperature)
        g_unc_NU = None
        l1_sum = torch.zeros((), dtype=torch.float32, device=device)
        gsum_top_N = torch.zeros(N, dtype=torch.float32, device=device)
        if m > 0 and N > 0:
            s_unc_NU = chunk_mean_columns(
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
            s_common_NC = chunk_mean_columns(
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
        # Where each vocab id's chunk gradient lives (the code of logit_rows.gold_backward).
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
        dz_BTV = gold_backward(
            z_BTV, lse_R, nidx_R, g_common_NC, g_unc_NU, cpos_V, gsum_N, coef_N, gscale_2,
            ctx.temperature,
        )  # fmt: skip
        return dz_BTV, None, None, None, None, None, None
