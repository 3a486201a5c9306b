"""AdamW's update of fp32 master weights with the write of their low-precision compute copy, in
one pass over each parameter.

A student trained with bf16 parameters and fp32 masters updates in two passes per step: the
optimizer's (torch's fused AdamW: the master, its gradient and both moments read, the master and
the moments written, 28 bytes per parameter) and the copy of every master into the bf16
parameter the forward reads (6 bytes more). Here one kernel per parameter does both: it writes
the bf16 value from the fresh master while it still holds it, 30 bytes per parameter, and runs
each parameter's update as one long elementwise pass.

Every parameter of a call goes in **one launch** (as torch's multi-tensor ``_foreach`` kernels
do): a table of the tensors' addresses and a map from each program to its parameter and block.
A launch per parameter (~300 for a 1.7B student) costs the host more than the GPU takes to run
them, and the next step's forward then waits for the host. The map is cached by the parameters'
sizes, the address table by the addresses (the same tensors every step: one copy to the device
the first time).

Math per element, as ``torch.optim.AdamW`` (``fused=True``, no amsgrad, not maximizing) with
``grad_scale`` and ``found_inf`` (the trainer's clip and finite check), step ``t`` already
counted:

* ``g = grad / grad_scale``; nothing is written anywhere when ``found_inf`` is set;
* ``p = p - lr * weight_decay * p``;
* ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g * g``;
* ``p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``;
* the bf16 compute copy gets ``p`` rounded to the nearest even.

fp32 throughout; ``beta^t`` is ``exp(t log beta)``, which may differ from torch's ``pow`` in the
last bits of the bias corrections.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._utils import cdiv, lazy_jit, tl, use_triton

__all__ = ["ADAMW_BLOCK", "adamw_publish_"]

#: Elements per program (16 per thread of 8 warps: wide loads, few programs).
ADAMW_BLOCK = 4096


@lazy_jit
def _adamw_publish_kernel(
    addr_ptr,
    owner_ptr,
    first_ptr,
    numel_ptr,
    scale_ptr,
    inf_ptr,
    n_params,
    lr,
    beta1,
    beta2,
    log_beta1,
    log_beta2,
    eps,
    weight_decay,
    G_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    ALIGNED: tl.constexpr,
    N16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program -> (parameter i, its block b); addr_ptr is int64 [6, n_params]: the master, the
    # gradient, both moments, the compute copy (as int16) and the step of every parameter
    pid = tl.program_id(0)
    i = tl.load(owner_ptr + pid).to(tl.int64)
    b = (pid - tl.load(first_ptr + i)).to(tl.int64)
    n = tl.load(numel_ptr + i)
    if N16:  # every size a multiple of 16 (checked on the host): the mask keeps wide accesses
        n = tl.multiple_of(n, 16)
    p_ptr = tl.load(addr_ptr + i).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(addr_ptr + n_params + i).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(addr_ptr + 2 * n_params + i).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(addr_ptr + 3 * n_params + i).to(tl.pointer_type(tl.float32))
    c_ptr = tl.load(addr_ptr + 4 * n_params + i).to(tl.pointer_type(tl.int16))
    step_ptr = tl.load(addr_ptr + 5 * n_params + i).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # every tensor starts on 16 bytes (checked on the host): wide loads and stores
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        c_ptr = tl.multiple_of(c_ptr, 16)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    if HAS_INF:  # a step skipped: no element read or written
        n = tl.where(tl.load(inf_ptr) == 0, n, 0)
    mask = offs < n
    t = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp(t * log_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p - (lr / bias1) * (m / denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    # the bf16 copy, rounded to nearest even on the bits (as PyTorch's cast; Triton's
    # interpreter would truncate), stored through its int16 view
    bits = p.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    tl.store(c_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


def _check(params: Sequence[torch.Tensor], *lists: Sequence[torch.Tensor]) -> None:
    """``lists``: the gradients, first and second moments, steps and compute copies."""
    if any(len(x) != len(params) for x in lists):
        raise ValueError(
            "adamw_publish_ needs one gradient, moment pair, step and compute copy per parameter, "
            f"got {len(params)} parameters and {[len(x) for x in lists]}"
        )
    grads, exp_avgs, exp_avg_sqs, _, computes = lists
    for i, (p, g, m, v, c) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, computes)):
        if p.dtype != torch.float32 or m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(f"parameter {i}: the master and its moments must be float32")
        if not (p.shape == g.shape == m.shape == v.shape == c.shape):
            raise ValueError(
                f"parameter {i}: shapes {tuple(p.shape)}, grad {tuple(g.shape)}, moments "
                f"{tuple(m.shape)} {tuple(v.shape)}, compute {tuple(c.shape)} differ"
            )
        if c.dtype != torch.bfloat16:
            raise ValueError(f"parameter {i}: the compute copy is {c.dtype}, not bfloat16")
        if not all(x.is_contiguous() for x in (p, g, m, v, c)):
            raise ValueError(f"parameter {i}: every tensor must be contiguous")
    for i, t in enumerate(lists[3]):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(
                f"parameter {i}: its step is {t.dtype} of {t.numel()} elements, not a float32 "
                "scalar (torch's fused AdamW state)"
            )


def adamw_publish_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    computes: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step of fp32 masters, in place, writing each one's compute copy (module doc).

    Args:
        params: the fp32 masters (updated).
        grads: their gradients, any float dtype.
        exp_avgs, exp_avg_sqs: fp32 first and second moments (updated).
        steps: each parameter's step count, a float32 0-d tensor already counting this step.
        computes: the bf16 compute copies (written: the new master, rounded).
        lr, beta1, beta2, eps, weight_decay: AdamW's settings of the parameters' group.
        grad_scale: 0-d tensor the gradients are divided by (None: 1).
        found_inf: 0-d tensor; nonzero skips the update (nothing written).

    Raises:
        ValueError: lists of different lengths, a master or moment not float32, shapes that
            differ, a compute copy that is not bf16, a tensor that is not contiguous, a step
            that is not a float32 scalar.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, computes)
    if not params:
        return
    if not use_triton(params[0]):
        _reference(params, grads, exp_avgs, exp_avg_sqs, steps, computes, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                   found_inf=found_inf)  # fmt: skip
        return
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            by_dtype.setdefault(grads[i].dtype, []).append(i)
    log_beta1, log_beta2 = math.log(beta1), math.log(beta2)
    for g_dtype, idx in by_dtype.items():  # one launch per gradient dtype (one, in a trainer)
        owner, first, numel, addrs, aligned, n16 = _launch_tables(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], [computes[i] for i in idx], [steps[i] for i in idx],
        )  # fmt: skip
        _adamw_publish_kernel[(owner.numel(),)](
            addrs, owner, first, numel,
            grad_scale if grad_scale is not None else numel,
            found_inf if found_inf is not None else numel,
            len(idx), float(lr), float(beta1), float(beta2), log_beta1, log_beta2, float(eps),
            float(weight_decay),
            G_DTYPE=_TL_DTYPES[g_dtype], HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None, ALIGNED=aligned, N16=n16, BLOCK=ADAMW_BLOCK,
            num_warps=8,
        )  # fmt: skip


#: the gradient dtypes the kernel reads
_TL_DTYPES = (
    {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if tl is not None
    else {}
)

# the launch tables last built, on their device: the program map by the sizes, the address
# table by the addresses (a trainer passes the same tensors every step); a few entries
_MAPS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = {}
_ADDRS: dict[tuple, tuple[torch.Tensor, bool]] = {}
_CACHED = 8


def _launch_tables(
    params, grads, exp_avgs, exp_avg_sqs, computes, steps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool, bool]:
    """The grouped launch's tables on the parameters' device: ``owner`` (int32, the parameter
    of each program), ``first`` (int32, each parameter's first program), ``numel`` (int64),
    ``addrs`` (int64 ``[6, P]``: master, gradient, moments, compute copy, step), whether every
    tensor but the steps starts on 16 bytes, and whether every size is a multiple of 16."""
    device = params[0].device
    sizes = (device, tuple(p.numel() for p in params))
    tables = _MAPS.get(sizes)
    if tables is None:
        blocks = torch.tensor([cdiv(n, ADAMW_BLOCK) for n in sizes[1]], dtype=torch.int64)
        first = torch.cumsum(blocks, 0) - blocks
        owner = torch.repeat_interleave(torch.arange(len(blocks)), blocks)
        tables = (
            owner.to(device=device, dtype=torch.int32),
            first.to(device=device, dtype=torch.int32),
            torch.tensor(sizes[1], dtype=torch.int64, device=device),
            all(n % 16 == 0 for n in sizes[1]),
        )
        _remember(_MAPS, sizes, tables)
    key = (device, *(t.data_ptr() for ts in (params, grads, exp_avgs, exp_avg_sqs, computes,
                                             steps) for t in ts))  # fmt: skip
    entry = _ADDRS.get(key)
    if entry is None:
        addrs = torch.tensor(key[1:], dtype=torch.int64).view(6, len(params)).to(device)
        aligned = all(a % 16 == 0 for a in key[1 : 1 + 5 * len(params)])
        entry = (addrs, aligned)
        _remember(_ADDRS, key, entry)
    owner, first, numel, n16 = tables
    addrs, aligned = entry
    return owner, first, numel, addrs, aligned, n16


def _remember(cache: dict, key: tuple, value) -> None:
    if len(cache) >= _CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _reference(
    params, grads, exp_avgs, exp_avg_sqs, steps, computes, *, lr, beta1, beta2, eps,
    weight_decay, grad_scale, found_inf,
) -> None:  # fmt: skip
    """The same update in PyTorch ops (a CPU without the interpreter)."""
    if found_inf is not None and bool(found_inf):
        return
    with torch.no_grad():
        _reference_steps(params, grads, exp_avgs, exp_avg_sqs, steps, computes, lr=lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         grad_scale=grad_scale)  # fmt: skip


def _reference_steps(
    params, grads, exp_avgs, exp_avg_sqs, steps, computes, *, lr, beta1, beta2, eps,
    weight_decay, grad_scale,
) -> None:  # fmt: skip
    for p, g, m, v, t, c in zip(params, grads, exp_avgs, exp_avg_sqs, steps, computes):
        g = g.float()
        if grad_scale is not None:
            g = g / grad_scale.float()
        t = t.float()
        bias1 = 1.0 - torch.exp(t * math.log(beta1))
        bias2_sqrt = torch.sqrt(1.0 - torch.exp(t * math.log(beta2)))
        p.sub_(lr * weight_decay * p)
        m.mul_(beta1).add_((1.0 - beta1) * g)
        v.mul_(beta2).add_((1.0 - beta2) * g * g)
        p.sub_((lr / bias1) * (m / (v.sqrt() / bias2_sqrt + eps)))
        c.copy_(p)
