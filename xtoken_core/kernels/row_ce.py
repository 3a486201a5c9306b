"""Student next-token cross-entropy from the logits in their own dtype: row kernels, autograd.

The PyTorch path (:func:`xtoken_core.losses.backends.reference.student_ce_loss`) casts
``[B, T, V]`` to fp32 and runs a full log-softmax, then does the same again in its backward.
Here the forward reads each row once (online logsumexp, the target logit, the argmax) and keeps
one fp32 scalar and one int32 target per row; the backward reads the row once more with that
logsumexp and writes the gradient in the logits' dtype. No ``[B, T, V]`` intermediate in either
pass.

Legend (shape suffixes):
    B batch, T positions, V vocabulary, R = B*T rows of the logits (flattened positions).

Math, per row ``r = (b, t)`` with ``z = z[r, :]`` (fp32 accumulation):

* target: ``y_r = input_ids[b, t + 1]``, counted (``c_r = 1``) when ``t + 1 < T``, its
  ``token_mask`` is set and sample ``b`` is not masked; else ``c_r = 0`` (the last position of
  a row never counts: it predicts nothing).
* ``lse_r = logsumexp_v z[v]``: online softmax in base 2, ``m' = max(m, max x2)``,
  ``s' = s 2^(m - m') + sum 2^(x2 - m')`` with ``x2 = z log2(e)``, ``lse = (m + log2 s) ln 2``;
  or given by the caller (the KD pass's row logsumexps at temperature 1).
* ``nll_r = c_r (lse_r - z[y_r])``; ``correct_r = c_r [argmax_v z[v] == y_r]`` with the
  argmax's first index on ties (``torch.argmax``'s rule): per block the block max and the
  smallest index holding it, kept only when a later block's max is strictly larger.
* backward of ``sum_r nll_r`` with incoming scalar ``g``:
  ``dz[r, v] = g c_r (exp(z[v] - lse_r) - [v == y_r])``, 0 on rows that do not count.

Ids of counted targets are clamped into ``[0, V)`` before they index (the loss's input checks
reject out-of-range targets; the kernels never read out of bounds).
"""

from __future__ import annotations

import logging

import torch

from ._utils import LOG2E, MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, next_power_of_2, tl, use_triton

logger = logging.getLogger(__name__)

__all__ = [
    "CE_CONFIG",
    "RowCrossEntropy",
    "row_ce_backward",
    "row_ce_forward",
    "row_cross_entropy",
    "use_triton",
]

#: Block sizes and warps (GPU); small problems shrink the blocks to fit.
CE_CONFIG = {
    "fwd_block_v": 4096,
    "fwd_warps": 8,
    "bwd_block_v": 2048,
    "bwd_blocks": 4,
    "bwd_warps": 4,
}


def _block(key: str, V: int) -> int:
    """``CE_CONFIG[key]`` shrunk to the vocab (at least 16)."""
    return max(min(CE_CONFIG[key], next_power_of_2(V)), 16)


if tl is not None:
    # T and the id/mask strides follow the batch's length; the id and mask pointers may be
    # views at any offset, the lse a slice of a larger buffer: none of them may pick a variant
    # (a recompile mid-run). V and the logits' strides stay specialized, as in logit_rows: the
    # row strides are multiples of V (of 16 in real vocabularies, whatever T is), and the
    # vectorized loads rely on them.
    @lazy_jit(
        do_not_specialize=("T", "ids_stride_b", "ids_stride_t", "tm_stride_b", "tm_stride_t"),
        do_not_specialize_on_alignment=(
            "ids_ptr",
            "tmask_ptr",
            "smask_ptr",
            "lse_R_ptr",
            "target_R_ptr",
            "stats_R3_ptr",
        ),
    )
    def _ce_fwd_kernel(
        z_ptr,
        ids_ptr,
        tmask_ptr,
        smask_ptr,
        lse_R_ptr,
        target_R_ptr,
        stats_R3_ptr,
        T,
        V,
        stride_b,
        stride_t,
        ids_stride_b,
        ids_stride_t,
        tm_stride_b,
        tm_stride_t,
        HAS_TOKEN_MASK: tl.constexpr,
        HAS_SAMPLE_MASK: tl.constexpr,
        LSE_GIVEN: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row r = (b, t). Target y = ids[b, t + 1], counted c as the module
        # docstring says; target[r] = y if c else -1 (the backward's). One read of the row:
        # online lse (unless LSE_GIVEN: then lse[r] is read), running (max, first index).
        # stats[r] = (c (lse - z[y]), c [argmax == y], c).
        r = tl.program_id(0).to(tl.int64)
        b = r // T
        t = r % T
        has_next = t + 1 < T
        y = tl.load(ids_ptr + b * ids_stride_b + (t + 1) * ids_stride_t, mask=has_next, other=0)
        counted = has_next
        if HAS_TOKEN_MASK:
            tm = tl.load(
                tmask_ptr + b * tm_stride_b + (t + 1) * tm_stride_t, mask=has_next, other=0
            )
            counted = counted & (tm != 0)
        if HAS_SAMPLE_MASK:
            counted = counted & (tl.load(smask_ptr + b) != 0)
        y = tl.minimum(tl.maximum(y.to(tl.int64), 0), V - 1)
        row_ptr = z_ptr + b * stride_b + t * stride_t
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([], -1.0e30, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int32) + V
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            vm = v < V
            x = tl.load(row_ptr + v, mask=vm, other=float("-inf")).to(tl.float32)
            bmax = tl.reduce(x, 0, MAX_COMBINE)
            # the smallest index holding the block max, as V - max(V - v) (max only: the
            # interpreter reduces with Triton's own combine functions)
            hit = vm & (x == bmax)
            bidx = V - tl.reduce(tl.where(hit, V - v, 0), 0, MAX_COMBINE)
            take = bmax > best
            best_i = tl.where(take, bidx, best_i)
            best = tl.where(take, bmax, best)
            if not LSE_GIVEN:
                m_new = tl.maximum(m, bmax * 1.4426950408889634)
                s = s * tl.exp2(m - m_new) + tl.reduce(
                    tl.exp2(x * 1.4426950408889634 - m_new), 0, SUM_COMBINE
                )
                m = m_new
        if LSE_GIVEN:
            lse = tl.load(lse_R_ptr + r)
        else:
            lse = (m + tl.log2(s)) * 0.6931471805599453
            tl.store(lse_R_ptr + r, lse)
        z_y = tl.load(row_ptr + y).to(tl.float32)
        nll = tl.where(counted, lse - z_y, 0.0)
        hit_y = tl.where(counted & (best_i.to(tl.int64) == y), 1.0, 0.0)
        tl.store(target_R_ptr + r, tl.where(counted, y, -1).to(tl.int32))
        tl.store(stats_R3_ptr + 3 * r, nll)
        tl.store(stats_R3_ptr + 3 * r + 1, hit_y)
        tl.store(stats_R3_ptr + 3 * r + 2, tl.where(counted, 1.0, 0.0))

    @lazy_jit(
        do_not_specialize=("T",),
        do_not_specialize_on_alignment=("lse_R_ptr", "target_R_ptr", "g_ptr"),
    )
    def _ce_bwd_kernel(
        z_ptr,
        lse_R_ptr,
        target_R_ptr,
        g_ptr,
        dz_ptr,
        T,
        V,
        stride_b,
        stride_t,
        scale2,  # log2(e)
        BLOCK_V: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        # Program (row r, BLOCKS vocab blocks): dz[r, v] = g (2^(z log2e - lse log2e) - [v == y])
        # for a counted row (target y >= 0), 0 else; stored in dz's dtype (the logits').
        r = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BLOCKS * BLOCK_V
        y = tl.load(target_R_ptr + r)
        out_row = dz_ptr + r * V
        if y >= 0:
            row_ptr = z_ptr + (r // T) * stride_b + (r % T) * stride_t
            lse2 = tl.load(lse_R_ptr + r) * scale2
            g = tl.load(g_ptr).to(tl.float32)
            for i in range(0, BLOCKS):
                v = first + i * BLOCK_V + tl.arange(0, BLOCK_V)
                vm = v < V
                z = tl.load(row_ptr + v, mask=vm, other=0.0).to(tl.float32)
                p = tl.exp2(z * scale2 - lse2)
                dz = g * (p - tl.where(v == y, 1.0, 0.0))
                tl.store(out_row + v, dz.to(dz_ptr.dtype.element_ty), mask=vm)
        else:
            for i in range(0, BLOCKS):
                v = first + i * BLOCK_V + tl.arange(0, BLOCK_V)
                zero = tl.full((BLOCK_V,), 0.0, tl.float32)
                tl.store(out_row + v, zero.to(dz_ptr.dtype.element_ty), mask=v < V)


# --------------------------------------------------------------------------- host wrappers


def _check(z_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R) -> None:
    """The layouts the kernels read.

    Raises:
        ValueError: a shape or layout the kernels cannot take, naming the tensor and the fix.
    """
    if z_BTV.dim() != 3 or z_BTV.stride(-1) != 1:
        raise ValueError(
            f"logits must be [B, T, V] with a contiguous last dim, got shape {tuple(z_BTV.shape)} "
            f"strides {z_BTV.stride()}: call .contiguous() first"
        )
    B, T, _ = z_BTV.shape
    if tuple(input_ids_BT.shape) != (B, T):
        raise ValueError(f"input_ids is {tuple(input_ids_BT.shape)}, expected [{B}, {T}]")
    if token_mask_BT is not None and tuple(token_mask_BT.shape) != (B, T):
        raise ValueError(f"token_mask is {tuple(token_mask_BT.shape)}, expected [{B}, {T}]")
    if sample_mask_B is not None and tuple(sample_mask_B.shape) != (B,):
        raise ValueError(f"sample_mask is {tuple(sample_mask_B.shape)}, expected [{B}]")
    if lse_R is not None and (lse_R.dtype != torch.float32 or tuple(lse_R.shape) != (B * T,)):
        raise ValueError(
            f"lse_R must be [{B * T}] fp32 (the row logsumexps at temperature 1), got "
            f"{tuple(lse_R.shape)} {lse_R.dtype}"
        )


def row_ce_forward(
    z_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None,
    sample_mask_B: torch.Tensor | None,
    lse_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward: the per-row terms, summed.

    Args:
        z_BTV: [B, T, V] logits, last dim contiguous (row strides are free).
        input_ids_BT: [B, T] int token ids (any strides).
        token_mask_BT: [B, T] bool/int/float (nonzero counts), or None.
        sample_mask_B: [B] bool/int/float (nonzero counts), or None.
        lse_R: [B*T] fp32 row logsumexps of ``z`` (temperature 1), or None: computed here.

    Returns:
        ``(sums_3, lse_R, target_R)``: fp32 ``[3]`` = (nll sum, correct, counted tokens);
        the row logsumexps (``lse_R`` itself when given); int32 ``[B*T]`` targets, -1 on rows
        that do not count. The last two are what :func:`row_ce_backward` reads.
    """
    B, T, V = z_BTV.shape
    R = B * T
    device = z_BTV.device
    stats_R3 = torch.empty((R, 3), device=device, dtype=torch.float32)
    target_R = torch.empty(R, device=device, dtype=torch.int32)
    given = lse_R is not None
    if not given:
        lse_R = torch.empty(R, device=device, dtype=torch.float32)
    if R == 0:
        return stats_R3.sum(0), lse_R, target_R
    if V == 0:
        raise ValueError("logits have V = 0 columns: there is no target to predict")
    tm = token_mask_BT if token_mask_BT is not None else input_ids_BT  # any valid pointer
    _ce_fwd_kernel[(R,)](
        z_BTV,
        input_ids_BT,
        tm,
        sample_mask_B if sample_mask_B is not None else input_ids_BT,
        lse_R,
        target_R,
        stats_R3,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        input_ids_BT.stride(0),
        input_ids_BT.stride(1),
        tm.stride(0),
        tm.stride(1),
        HAS_TOKEN_MASK=token_mask_BT is not None,
        HAS_SAMPLE_MASK=sample_mask_B is not None,
        LSE_GIVEN=given,
        BLOCK_V=_block("fwd_block_v", V),
        num_warps=CE_CONFIG["fwd_warps"],
    )
    return stats_R3.sum(0), lse_R, target_R


def row_ce_backward(
    grad: torch.Tensor, z_BTV: torch.Tensor, lse_R: torch.Tensor, target_R: torch.Tensor
) -> torch.Tensor:
    """Triton backward of the nll sum: ``dz = g (softmax(z) - onehot(y))`` on counted rows.

    Args:
        grad: scalar gradient of the nll sum (read on the device: no host sync).
        z_BTV: the forward's logits.
        lse_R: [B*T] fp32 row logsumexps.
        target_R: [B*T] int32 targets, -1 on rows that do not count.

    Returns:
        dz_BTV, contiguous, in the logits' dtype.
    """
    B, T, V = z_BTV.shape
    dz_BTV = torch.empty((B, T, V), device=z_BTV.device, dtype=z_BTV.dtype)
    if B * T == 0 or V == 0:
        return dz_BTV
    block = _block("bwd_block_v", V)
    blocks = max(min(CE_CONFIG["bwd_blocks"], cdiv(V, block)), 1)
    g_1 = grad.reshape(1).to(torch.float32)
    _ce_bwd_kernel[(B * T, cdiv(V, block * blocks))](
        z_BTV,
        lse_R,
        target_R,
        g_1,
        dz_BTV,
        T,
        V,
        z_BTV.stride(0),
        z_BTV.stride(1),
        LOG2E,
        BLOCK_V=block,
        BLOCKS=blocks,
        num_warps=CE_CONFIG["bwd_warps"],
    )
    return dz_BTV


class RowCrossEntropy(torch.autograd.Function):
    """``apply(z_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R)`` ->
    ``(nll_sum, correct, num_tokens)``; only ``nll_sum`` has a gradient (to ``z_BTV``).

    Saves the logits, the row logsumexps and the int32 targets (no ``[B, T, V]`` buffer).
    """

    @staticmethod
    def forward(ctx, z_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R):
        sums_3, lse_R, target_R = row_ce_forward(
            z_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R
        )
        ctx.save_for_backward(z_BTV, lse_R, target_R)
        ctx.set_materialize_grads(False)  # the counts get no gradient: no zeros for them
        counts_2 = sums_3[1:]
        ctx.mark_non_differentiable(counts_2)
        return sums_3[0], counts_2

    @staticmethod
    def backward(ctx, grad_nll, grad_counts):
        if grad_nll is None:
            return None, None, None, None, None
        z_BTV, lse_R, target_R = ctx.saved_tensors
        return row_ce_backward(grad_nll, z_BTV, lse_R, target_R), None, None, None, None


def row_cross_entropy(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
    *,
    lse_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over the counted targets, by the Triton kernels.

    The contract of :func:`xtoken_core.losses.backends.reference.student_ce_loss` (which
    :func:`xtoken_core.losses.student_ce` falls back to where Triton does not run).

    Shape:
        logits_BTV: [B, T, V], fp32 / bf16 / fp16; last dim contiguous or it is copied (row
            strides are free, e.g. a vocab-sliced view).
        input_ids_BT: [B, T] int; the logits at t predict ``input_ids[:, t + 1]``.
        token_mask_BT: [B, T] or None; sample_mask_B: [B] or None (nonzero counts).
        lse_R: [B*T] fp32 row logsumexps of the logits at temperature 1, or None.
        nll_sum, correct, num_tokens: fp32 scalars; gradient: [B, T, V] in the logits dtype,
            0 on positions that do not count.

    Args:
        logits_BTV: student logits.
        input_ids_BT: student token ids.
        token_mask_BT: which targets count.
        sample_mask_B: which samples count.
        lse_R: the row logsumexps when already made (the KD pass at temperature 1): the
            forward then skips its exponentials (it still reads each row once, for the argmax).

    Returns:
        ``(nll_sum, correct, num_tokens)``; ``correct`` counts targets equal to the row's
        argmax (first index on ties, as ``torch.argmax``).

    Raises:
        ValueError: a shape that does not match the logits, a bad ``lse_R``, V = 0.
    """
    if logits_BTV.dim() == 3 and logits_BTV.stride(-1) != 1:
        logits_BTV = logits_BTV.contiguous()
    device = logits_BTV.device
    input_ids_BT = input_ids_BT.to(device)
    token_mask_BT = None if token_mask_BT is None else token_mask_BT.to(device)
    sample_mask_B = None if sample_mask_B is None else sample_mask_B.to(device)
    _check(logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R)
    nll_sum, counts_2 = RowCrossEntropy.apply(
        logits_BTV, input_ids_BT, token_mask_BT, sample_mask_B, lse_R
    )
    correct, num_tokens = counts_2.unbind()
    return nll_sum, correct, num_tokens
