"""MoE routing: top-k expert indices -> local multihot mask and probs, fused in Triton.

Shape legend (letters scoped to this file):
    N  tokens
    K  top-k slots per token (``topk``)
    E  local experts (``num_of_local_experts``)

Contract (NeMo/Megatron ``fused_indices_to_multihot``): ``indices_NK`` names the expert of every
top-k slot; an index that is -1 (or any negative value) or ``>= E`` belongs to another rank and is
dropped. The outputs are ``multihot_NE`` (bool: token routed to local expert e) and ``probs_NE``
(the slot's routing probability at its expert column, 0 elsewhere). The forward also builds the
inverse position map ``position_NE`` (the slot k that landed on expert e, -1 if none), which the
backward uses to gather ``grad_probs_NE`` back to ``grad_probs_indices_NK`` (0 for dropped slots).

Duplicates (one token naming the same local expert in two slots, which a real top-k never does):
the FIRST slot wins. Its probability is written, it gets the gradient, and later duplicate slots
are treated as dropped (zero gradient). This keeps every output well defined and deterministic.

Math of the forward kernel, per tile of tokens x experts:
    position[n, e] = min{k : indices[n, k] == e}   (-1 if no such k)
    probs[n, e]    = probs_indices[n, position[n, e]]   (0 if position is -1)
computed by walking k from K-1 down to 0 and overwriting on a hit, so the smallest k wins without
any scatter (every output element is written exactly once, coalesced, no barrier needed).
Backward kernel, per tile of tokens x slots (a gather, N*K loads instead of N*E):
    grad_indices[n, k] = grad[n, e] if 0 <= e = indices[n, k] < E and position[n, e] == k else 0
"""

from __future__ import annotations

import logging

import torch

from xtoken_core.kernels._utils import cdiv, interpret_mode, lazy_jit, tl, triton

logger = logging.getLogger(__name__)

__all__ = [
    "IndicesToMultihot",
    "TorchIndicesToMultihotOp",
    "TritonIndicesToMultihotOp",
    "fused_indices_to_multihot",
    "indices_to_multihot_backward",
    "indices_to_multihot_forward",
    "indices_to_multihot_reference",
    "position_map_dtype",
]

# Forward tiles hold about this many (token, expert) elements; big enough to amortize the
# per-program set-up, small enough to keep a few programs per SM at 4096 tokens.
_FWD_TILE_ELEMS = 2048
_FWD_MAX_BLOCK_E = 128
_BWD_TILE_ELEMS = 1024


def position_map_dtype(topk: int) -> torch.dtype:
    """Dtype of the saved position map: int8 when every slot index fits, else int32.

    Args:
        topk: K, the number of slots per token.

    Returns:
        ``torch.int8`` for ``topk <= 127`` (a quarter of the bytes of int32), else ``torch.int32``.
    """
    return torch.int8 if topk <= 127 else torch.int32


def _validate(
    indices_NK: torch.Tensor, probs_indices_NK: torch.Tensor, num_of_local_experts
) -> None:
    if isinstance(num_of_local_experts, bool) or not isinstance(num_of_local_experts, int):
        raise ValueError(
            f"num_of_local_experts must be an int >= 1, got {num_of_local_experts!r}; "
            "pass the number of experts on this rank"
        )
    if num_of_local_experts < 1:
        raise ValueError(
            f"num_of_local_experts must be >= 1, got {num_of_local_experts}; "
            "pass the number of experts on this rank"
        )
    if indices_NK.dim() != 2:
        raise ValueError(
            f"indices must be 2-D [tokens, topk], got shape {tuple(indices_NK.shape)}; "
            "flatten the batch and sequence axes first"
        )
    if (
        indices_NK.dtype.is_floating_point
        or indices_NK.dtype.is_complex
        or indices_NK.dtype == torch.bool
    ):
        raise ValueError(
            f"indices must have an integer dtype, got {indices_NK.dtype}; "
            "pass the top-k expert ids (e.g. from torch.topk(...).indices)"
        )
    if probs_indices_NK.shape != indices_NK.shape:
        raise ValueError(
            f"probs_indices shape {tuple(probs_indices_NK.shape)} must equal indices shape "
            f"{tuple(indices_NK.shape)}; pass the probabilities of the same top-k slots"
        )
    if not probs_indices_NK.dtype.is_floating_point:
        raise ValueError(
            f"probs_indices must be floating point, got {probs_indices_NK.dtype}; "
            "pass the routing probabilities"
        )
    if probs_indices_NK.device != indices_NK.device:
        raise ValueError(
            f"indices on {indices_NK.device} but probs_indices on {probs_indices_NK.device}; "
            "put both on one device"
        )


# --------------------------------------------------------------------------------------------
# Reference (the obviously-correct PyTorch version; also the CPU fallback)
# --------------------------------------------------------------------------------------------


def indices_to_multihot_reference(
    indices_NK: torch.Tensor, probs_indices_NK: torch.Tensor, num_of_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unfused PyTorch conversion; differentiable w.r.t. ``probs_indices_NK`` through autograd.

    Args:
        indices_NK: [N, K] integer expert ids; negative or ``>= E`` means not local.
        probs_indices_NK: [N, K] floating routing probabilities of the same slots.
        num_of_local_experts: E >= 1.

    Returns:
        ``(multihot_NE bool, probs_NE same dtype as probs_indices_NK, position_NE)`` where
        ``position_NE`` has dtype :func:`position_map_dtype` and holds the winning slot or -1.

    Raises:
        ValueError: on a bad shape, dtype, device or expert count.
    """
    _validate(indices_NK, probs_indices_NK, num_of_local_experts)
    E = num_of_local_experts
    N, K = indices_NK.shape
    device = indices_NK.device
    idx_NK = indices_NK.long()
    local_NK = (idx_NK >= 0) & (idx_NK < E)
    # A slot is a duplicate when an earlier slot of the same token names the same expert.
    same_NKK = idx_NK[:, :, None] == idx_NK[:, None, :]
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=device).tril(diagonal=-1)
    duplicate_NK = (same_NKK & earlier_KK).any(dim=-1)
    keep_NK = local_NK & ~duplicate_NK
    # Dropped slots go to a spare column E that is sliced off, so scatter stays well defined.
    column_NK = torch.where(keep_NK, idx_NK, torch.full_like(idx_NK, E))
    probs_NE = probs_indices_NK.new_zeros(N, E + 1).scatter(1, column_NK, probs_indices_NK)[:, :E]
    multihot_NE = torch.zeros(N, E + 1, dtype=torch.bool, device=device)
    multihot_NE = multihot_NE.scatter(1, column_NK, keep_NK)[:, :E].contiguous()
    slot_NK = torch.arange(K, device=device).expand(N, K)
    position_NE = torch.full((N, E + 1), -1, dtype=torch.long, device=device)
    position_NE = position_NE.scatter(1, column_NK, slot_NK)[:, :E]
    return multihot_NE, probs_NE, position_NE.to(position_map_dtype(K)).contiguous()


# --------------------------------------------------------------------------------------------
# Triton kernels (jitted per mode at launch: TRITON_INTERPRET may change between calls). They call
# only builtins of ``triton.language`` (no ``tl.zeros``/``tl.sum``...), as LazyJit requires.
# --------------------------------------------------------------------------------------------

if tl is not None:

    @lazy_jit
    def indices_to_multihot_fwd_kernel(
        indices_ptr,
        probs_in_ptr,
        multihot_ptr,
        probs_out_ptr,
        position_ptr,
        num_tokens,
        E: tl.constexpr,
        K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        t_T = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        e_E = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        t_ok_T = t_T < num_tokens
        position_TE = tl.full((BLOCK_T, BLOCK_E), -1, tl.int32)
        probs_TE = tl.full((BLOCK_T, BLOCK_E), 0.0, tl.float32)
        # Walk slots from last to first and overwrite on a hit: the first slot wins duplicates.
        for k in tl.static_range(K - 1, -1, -1):
            idx_T = tl.load(indices_ptr + t_T * K + k, mask=t_ok_T, other=-1)
            p_T = tl.load(probs_in_ptr + t_T * K + k, mask=t_ok_T, other=0.0).to(tl.float32)
            hit_TE = idx_T[:, None] == e_E[None, :]
            position_TE = tl.where(hit_TE, k, position_TE)
            probs_TE = tl.where(hit_TE, p_T[:, None], probs_TE)
        out_TE = t_T[:, None] * E + e_E[None, :]
        ok_TE = t_ok_T[:, None] & (e_E < E)[None, :]
        tl.store(multihot_ptr + out_TE, (position_TE >= 0).to(tl.int8), mask=ok_TE)
        tl.store(
            probs_out_ptr + out_TE,
            probs_TE.to(probs_out_ptr.dtype.element_ty),
            mask=ok_TE,
        )
        tl.store(
            position_ptr + out_TE,
            position_TE.to(position_ptr.dtype.element_ty),
            mask=ok_TE,
        )

    @lazy_jit
    def multihot_to_indices_bwd_kernel(
        grad_probs_ptr,
        indices_ptr,
        position_ptr,
        grad_in_ptr,
        num_tokens,
        E: tl.constexpr,
        K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t_T = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        k_K = tl.arange(0, BLOCK_K)
        ok_TK = (t_T < num_tokens)[:, None] & (k_K < K)[None, :]
        slot_TK = t_T[:, None] * K + k_K[None, :]
        idx_TK = tl.load(indices_ptr + slot_TK, mask=ok_TK, other=-1)
        local_TK = ok_TK & (idx_TK >= 0) & (idx_TK < E)
        column_TK = t_T[:, None] * E + tl.where(local_TK, idx_TK, 0)
        position_TK = tl.load(position_ptr + column_TK, mask=local_TK, other=-1).to(tl.int32)
        won_TK = local_TK & (position_TK == k_K[None, :])
        grad_TK = tl.load(grad_probs_ptr + column_TK, mask=won_TK, other=0.0)
        tl.store(grad_in_ptr + slot_TK, grad_TK.to(grad_in_ptr.dtype.element_ty), mask=ok_TK)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def indices_to_multihot_forward(
    indices_NK: torch.Tensor, probs_indices_NK: torch.Tensor, num_of_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward: one launch writes the multihot mask, the probs and the position map.

    Args:
        indices_NK: [N, K] integer expert ids (int32 or int64 on the kernel path).
        probs_indices_NK: [N, K] floating routing probabilities.
        num_of_local_experts: E >= 1.

    Returns:
        ``(multihot_NE bool, probs_NE, position_NE)`` as in :func:`indices_to_multihot_reference`.

    Raises:
        ValueError: on a bad shape, dtype, device or expert count.
        ImportError: when triton is not installed.
    """
    _validate(indices_NK, probs_indices_NK, num_of_local_experts)
    E = num_of_local_experts
    N, K = indices_NK.shape
    device = indices_NK.device
    multihot_NE = torch.empty(N, E, dtype=torch.bool, device=device)
    probs_NE = torch.empty(N, E, dtype=probs_indices_NK.dtype, device=device)
    position_NE = torch.empty(N, E, dtype=position_map_dtype(K), device=device)
    if N == 0:
        return multihot_NE, probs_NE, position_NE
    if K == 0:
        return multihot_NE.zero_(), probs_NE.zero_(), position_NE.fill_(-1)
    if indices_NK.dtype not in (torch.int32, torch.int64):
        indices_NK = indices_NK.long()
    indices_NK = indices_NK.contiguous()
    probs_indices_NK = probs_indices_NK.contiguous()
    block_e = min(_next_pow2(E), _FWD_MAX_BLOCK_E)
    block_t = max(1, _FWD_TILE_ELEMS // block_e)
    block_t = min(block_t, _next_pow2(N))
    grid = (cdiv(N, block_t), cdiv(E, block_e))
    indices_to_multihot_fwd_kernel[grid](
        indices_NK,
        probs_indices_NK,
        multihot_NE.view(torch.int8),
        probs_NE,
        position_NE,
        N,
        E=E,
        K=K,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return multihot_NE, probs_NE, position_NE


def indices_to_multihot_backward(
    grad_probs_NE: torch.Tensor,
    indices_NK: torch.Tensor,
    position_NE: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton backward: gather ``grad_probs_NE`` back to the top-k slots.

    Args:
        grad_probs_NE: [N, E] gradient of ``probs_NE``.
        indices_NK: [N, K] the forward's expert ids.
        position_NE: [N, E] the forward's position map.
        out_dtype: dtype of the result (default: ``grad_probs_NE.dtype``).

    Returns:
        grad_probs_indices_NK: [N, K]; 0 for dropped and duplicate slots.

    Raises:
        ValueError: when the shapes disagree.
        ImportError: when triton is not installed.
    """
    N, K = indices_NK.shape
    if grad_probs_NE.shape != position_NE.shape or grad_probs_NE.shape[0] != N:
        raise ValueError(
            f"grad_probs shape {tuple(grad_probs_NE.shape)}, position map shape "
            f"{tuple(position_NE.shape)} and indices shape {tuple(indices_NK.shape)} disagree; "
            "pass the tensors of one forward call"
        )
    E = grad_probs_NE.shape[1]
    out_dtype = grad_probs_NE.dtype if out_dtype is None else out_dtype
    grad_NK = torch.empty(N, K, dtype=out_dtype, device=grad_probs_NE.device)
    if N == 0 or K == 0:
        return grad_NK.zero_()
    if indices_NK.dtype not in (torch.int32, torch.int64):
        indices_NK = indices_NK.long()
    block_k = _next_pow2(K)
    block_t = min(max(1, _BWD_TILE_ELEMS // block_k), _next_pow2(N))
    grid = (cdiv(N, block_t),)
    multihot_to_indices_bwd_kernel[grid](
        grad_probs_NE.contiguous(),
        indices_NK.contiguous(),
        position_NE.contiguous(),
        grad_NK,
        N,
        E=E,
        K=K,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
    )
    return grad_NK


class IndicesToMultihot(torch.autograd.Function):
    """autograd.Function over the Triton kernels; ``indices`` and ``E`` get no gradient."""

    @staticmethod
    def forward(ctx, indices_NK, probs_indices_NK, num_of_local_experts):
        """Shape: [N, K], [N, K], E -> multihot [N, E] bool, probs [N, E]."""
        multihot_NE, probs_NE, position_NE = indices_to_multihot_forward(
            indices_NK, probs_indices_NK, num_of_local_experts
        )
        ctx.save_for_backward(indices_NK, position_NE)
        # The multihot output never has a gradient: do not let autograd fill a zero [N, E] for it.
        ctx.set_materialize_grads(False)
        ctx.probs_dtype = probs_indices_NK.dtype
        ctx.mark_non_differentiable(multihot_NE)
        return multihot_NE, probs_NE

    @staticmethod
    def backward(ctx, grad_multihot_NE, grad_probs_NE):
        """Shape: grad probs [N, E] -> grad probs_indices [N, K] (multihot grad is ignored)."""
        del grad_multihot_NE
        indices_NK, position_NE = ctx.saved_tensors
        if grad_probs_NE is None:
            return None, None, None
        grad_NK = indices_to_multihot_backward(
            grad_probs_NE, indices_NK, position_NE, out_dtype=ctx.probs_dtype
        )
        return None, grad_NK, None


def _triton_usable(device: torch.device) -> bool:
    return triton is not None and (
        device.type == "cuda" or (device.type == "cpu" and interpret_mode())
    )


def fused_indices_to_multihot(
    indices: torch.Tensor, probs_indices: torch.Tensor, num_of_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert MoE top-k routing to a local multihot mask and per-expert probabilities.

    Uses the Triton kernels on CUDA/ROCm tensors when triton is installed, otherwise the PyTorch
    reference (same results, same gradient).

    Example (K=2, E=4)::

        indices       = [[0, 1], [1, 2]]       probs_indices = [[0.1, 0.2], [0.3, 0.4]]
        multihot      = [[1, 1, 0, 0], [0, 1, 1, 0]]
        probs         = [[0.1, 0.2, 0.0, 0.0], [0.0, 0.3, 0.4, 0.0]]

    Shape:
        indices [N, K] int, probs_indices [N, K] float -> multihot [N, E] bool, probs [N, E]
        (dtype of probs_indices). Backward: grad probs [N, E] -> grad probs_indices [N, K].

    Args:
        indices: [N, K] expert ids; -1 (any negative) or ``>= E`` means "not on this rank".
        probs_indices: [N, K] routing probabilities of those slots.
        num_of_local_experts: E >= 1.

    Returns:
        ``(multihot [N, E] bool, probs [N, E])``.

    Raises:
        ValueError: on a bad shape, dtype, device or expert count.
    """
    _validate(indices, probs_indices, num_of_local_experts)
    if indices.device.type == "cuda" and _triton_usable(indices.device):
        return IndicesToMultihot.apply(indices, probs_indices, num_of_local_experts)
    multihot_NE, probs_NE, _ = indices_to_multihot_reference(
        indices, probs_indices, num_of_local_experts
    )
    return multihot_NE, probs_NE


class TorchIndicesToMultihotOp:
    """Registry op: the PyTorch reference, any device."""

    backend_name = "torch"

    def __call__(self, indices, probs_indices, num_of_local_experts):
        """Shape: [N, K], [N, K], E -> (multihot [N, E] bool, probs [N, E])."""
        multihot_NE, probs_NE, _ = indices_to_multihot_reference(
            indices, probs_indices, num_of_local_experts
        )
        return multihot_NE, probs_NE


class TritonIndicesToMultihotOp:
    """Registry op: the fused Triton kernels.

    Raises:
        ImportError: at construction when triton is not installed (the registry falls through).
    """

    backend_name = "triton"

    def __init__(self) -> None:
        if triton is None:  # fail at construction, not at the first call
            raise ImportError("triton is not installed: the torch backend serves this op")

    def __call__(self, indices, probs_indices, num_of_local_experts):
        """Shape: [N, K], [N, K], E -> (multihot [N, E] bool, probs [N, E])."""
        return IndicesToMultihot.apply(indices, probs_indices, num_of_local_experts)
