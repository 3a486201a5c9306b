"""The log-partition of each row of logits and the log of the mass outside its top K, in one
pass over the logits as they are (bf16 or fp32), given the row's top-K values.

The top-K encode of teacher targets (``xtoken_core.wire.topk.encode_topk``) needs per row the
log-partition ``lse = logsumexp(z)`` and the rest ``log(sum of exp(z) outside the top K) - lse``.
Done with PyTorch ops it copies the row to fp32, takes two log-sum-exps and scatters ``-inf``
over the top K (~9 GB of memory traffic for 4,096 rows of a 129,280-id vocab). Here one program
per row reads the logits once, with the row's largest value ``m`` and its K-th ``thr`` known
from the top K:

* ``s_all = sum(exp(z - m))``; ``lse = m + log(s_all)``;
* ``s_rest = sum(exp(z - m) for z < thr) + (ties left out) * exp(thr - m)``, where the ties
  left out are the row's values equal to ``thr`` beyond those the top K holds;
* ``rest = log(s_rest) - log(s_all)``: summed from the small terms themselves, so it stays
  exact when the top K hold nearly all the mass (``log(1 - sum p)`` would cancel).

A row at ``-inf`` outside its top K gives ``rest = -inf``, as the log-sum-exp of nothing; a row
all ``-inf`` gives ``lse = rest = -inf``.
"""

from __future__ import annotations

import torch

from ._utils import SUM_COMBINE, lazy_jit, tl, use_triton

__all__ = ["row_lse_rest"]

#: Logits per loop iteration of a row's program.
_BLOCK_W = 4096


@lazy_jit
def _row_lse_rest_kernel(
    z_ptr,
    top_ptr,
    lse_ptr,
    rest_ptr,
    W,
    K,
    stride_z,
    stride_top,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    top = tl.load(top_ptr + row * stride_top + ks, mask=ks < K, other=float("inf"))
    top = top.to(tl.float32)
    m = tl.load(top_ptr + row * stride_top).to(tl.float32)  # the largest value
    m = tl.where(m == float("-inf"), 0.0, m)  # a row all -inf: every term 0, no NaN
    thr = tl.load(top_ptr + row * stride_top + K - 1).to(tl.float32)  # the K-th
    kept_ties = tl.reduce((top == thr).to(tl.float32), 0, SUM_COMBINE)
    s_all = tl.full((BLOCK_W,), 0.0, tl.float32)
    s_below = tl.full((BLOCK_W,), 0.0, tl.float32)
    ties = tl.full((BLOCK_W,), 0.0, tl.float32)
    for start in range(0, W, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        z = tl.load(z_ptr + row * stride_z + cols, mask=cols < W, other=float("-inf"))
        z = z.to(tl.float32)
        e = tl.exp(z - m)
        s_all += e
        s_below += tl.where(z < thr, e, 0.0)
        ties += (z == thr).to(tl.float32)
    total = tl.reduce(s_all, 0, SUM_COMBINE)
    below = tl.reduce(s_below, 0, SUM_COMBINE)
    left_out = tl.reduce(ties, 0, SUM_COMBINE) - kept_ties
    rest_sum = below + left_out * tl.exp(thr - m)
    log_total = tl.log(total)
    tl.store(lse_ptr + row, m + log_total)
    rest = tl.where(total > 0, tl.log(rest_sum) - log_total, float("-inf"))
    tl.store(rest_ptr + row, rest)


def row_lse_rest(z_nW: torch.Tensor, top_nK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-partition and the log of its mass outside the top K (module doc).

    Args:
        z_nW: ``[n, W]`` logits, any float dtype, the last dim contiguous.
        top_nK: ``[n, K]`` the row's K largest values of ``z_nW``, in decreasing order (as
            ``torch.topk`` gives them, in ``z_nW``'s dtype or fp32).

    Returns:
        ``(lse_n, rest_n)``, fp32 ``[n]`` each.

    Raises:
        ValueError: shapes that do not pair up, or an empty K.
    """
    if z_nW.dim() != 2 or top_nK.dim() != 2 or z_nW.shape[0] != top_nK.shape[0]:
        raise ValueError(
            f"row_lse_rest needs logits [n, W] and their top values [n, K], got "
            f"{tuple(z_nW.shape)} and {tuple(top_nK.shape)}"
        )
    n, K = top_nK.shape
    if not 1 <= K <= z_nW.shape[1]:
        raise ValueError(f"top values of K={K} for rows of {z_nW.shape[1]} logits")
    if not use_triton(z_nW):
        return _reference(z_nW, top_nK)
    if z_nW.stride(-1) != 1:
        z_nW = z_nW.contiguous()
    top_nK = top_nK.contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=z_nW.device)
    rest = torch.empty(n, dtype=torch.float32, device=z_nW.device)
    if n:
        W = z_nW.shape[1]
        _row_lse_rest_kernel[(n,)](
            z_nW, top_nK, lse, rest, W, K, z_nW.stride(0), top_nK.stride(0),
            BLOCK_W=min(_BLOCK_W, 1 << max(W - 1, 0).bit_length()),
            BLOCK_K=1 << max(K - 1, 0).bit_length(), num_warps=8,
        )  # fmt: skip
    return lse, rest


def _reference(z_nW: torch.Tensor, top_nK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sums in PyTorch ops (a CPU without the interpreter)."""
    z = z_nW.float()
    top = top_nK.float()
    m, thr = top[:, :1], top[:, -1:]
    m = torch.where(torch.isneginf(m), 0.0, m)  # a row all -inf: every term 0, no NaN
    e = torch.exp(z - m)
    total = e.sum(-1)
    left_out = (z == thr).sum(-1) - (top == thr).sum(-1)
    rest_sum = torch.where(z < thr, e, 0.0).sum(-1) + left_out * torch.exp(thr - m).squeeze(-1)
    log_total = total.log()
    rest = torch.where(total > 0, rest_sum.log() - log_total, float("-inf"))
    return m.squeeze(-1) + log_total, rest
