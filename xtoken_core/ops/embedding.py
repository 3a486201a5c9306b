"""NativeEmbeddingOp: token-embedding row gather with a deterministic, sort-based backward.

Shape legend (letters scoped to this file):
    V  vocabulary rows of the table
    H  hidden size (row width)
    M  gathered ids (all ids of the batch, flattened)
    U  distinct ids among them

Forward is ``out = weight[ids]``: a lossless row gather, so ``forward`` (weight dtype) and
``forward_fp32`` (fp32 rows) are bitwise equal to direct indexing. ``forward_fp32`` upcasts only
the gathered rows, chunk by chunk, never the table: its extra memory is the fp32 output plus one
bounded chunk.

Backward: ``grad_weight[v] = sum of grad_out rows whose id is v``. PyTorch's embedding backward
accumulates those rows with atomics on GPUs, so collisions (padding, frequent tokens) make the
result order-dependent. Here the rows are stably sorted by id and each id's segment is summed by
a fixed pairwise tree (gathers and element-wise adds on distinct rows, no atomics, no scatter-add),
in fp32 (fp64 for fp64 tables), then cast to the weight dtype: bitwise reproducible on every
device, with or without ``torch.use_deterministic_algorithms(True)``. Rows of ids that do not occur
get exactly zero (dense gradient, the default) or are absent (``sparse_grad=True``: a coalesced
sparse COO gradient holding only the used rows).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["NativeEmbeddingOp", "embedding_reference", "segment_sum_rows"]

# forward_fp32 converts at most this many bytes of weight-dtype rows at a time, so its transient
# memory beyond the fp32 output stays bounded whatever the number of ids.
_UPCAST_CHUNK_BYTES = 16 * 1024 * 1024


def embedding_reference(ids: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """The obviously-correct gather: ``weight_VH[ids.long()]`` (autograd via PyTorch).

    Args:
        ids: integer ids of any shape.
        weight_VH: [V, H] table.

    Returns:
        [*ids.shape, H] rows in the weight dtype.
    """
    return weight_VH[ids.long()]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_sum_rows(
    ids_M: torch.Tensor, rows_MH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the rows that share an id, in a fixed order (deterministic, no atomics).

    Rows are stably sorted by id; within each id's segment, rows are added by a pairwise tree
    (round s adds the row at rank r+s into rank r for r divisible by 2s), so the order of every
    addition is a function of the ids alone.

    Args:
        ids_M: [M] integer ids.
        rows_MH: [M, H] rows to sum; accumulated in fp32 (fp64 if the rows are fp64).

    Returns:
        ``(unique_ids_U int64 ascending, sums_UH)`` with ``sums_UH`` in the accumulation dtype.

    Raises:
        ValueError: when ``ids_M`` and ``rows_MH`` disagree on M.
    """
    if ids_M.dim() != 1 or rows_MH.dim() != 2 or ids_M.shape[0] != rows_MH.shape[0]:
        raise ValueError(
            f"ids shape {tuple(ids_M.shape)} and rows shape {tuple(rows_MH.shape)} disagree; "
            "pass [M] ids and [M, H] rows"
        )
    device = rows_MH.device
    acc_dtype = _accumulate_dtype(rows_MH.dtype)
    M = ids_M.shape[0]
    if M == 0:
        return ids_M.long(), rows_MH.new_zeros(0, rows_MH.shape[1], dtype=acc_dtype)
    sorted_ids_M, order_M = torch.sort(ids_M.long(), stable=True)
    rows_MH = rows_MH.index_select(0, order_M).to(acc_dtype)
    unique_ids_U, counts_U = torch.unique_consecutive(sorted_ids_M, return_counts=True)
    starts_U = torch.cumsum(counts_U, 0) - counts_U
    segment_M = torch.repeat_interleave(
        torch.arange(len(counts_U), device=device), counts_U, output_size=M
    )
    rank_M = torch.arange(M, device=device) - starts_U[segment_M]
    count_M = counts_U[segment_M]
    max_count = int(counts_U.max())
    step = 1
    while step < max_count:
        # Rank r (r divisible by 2*step) takes in rank r+step of its segment. Only those rows
        # are touched (half as many each round: O(M*H) in all); they are distinct, so the
        # index_copy_ never collides and its result does not depend on launch order.
        active_M = ((rank_M % (2 * step)) == 0) & (rank_M + step < count_M)
        dst = active_M.nonzero().squeeze(1)
        summed = rows_MH.index_select(0, dst) + rows_MH.index_select(0, dst + step)
        rows_MH.index_copy_(0, dst, summed)
        step *= 2
    return unique_ids_U, rows_MH.index_select(0, starts_U)


class _DeterministicGather(torch.autograd.Function):
    """Row gather whose weight gradient is a sorted segment sum (see module docstring)."""

    @staticmethod
    def forward(ctx, ids_M, weight_VH, out_dtype, sparse_grad):
        rows_MH = _gather_rows(ids_M, weight_VH, out_dtype)
        ctx.save_for_backward(ids_M)
        ctx.weight_shape = weight_VH.shape
        ctx.weight_dtype = weight_VH.dtype
        ctx.sparse_grad = sparse_grad
        return rows_MH

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows_MH):
        (ids_M,) = ctx.saved_tensors
        V, H = ctx.weight_shape
        unique_ids_U, sums_UH = segment_sum_rows(ids_M, grad_rows_MH)
        sums_UH = sums_UH.to(ctx.weight_dtype)
        if ctx.sparse_grad:
            grad_VH = torch.sparse_coo_tensor(
                unique_ids_U[None], sums_UH, (V, H), is_coalesced=True, check_invariants=False
            )
        else:
            grad_VH = sums_UH.new_zeros(V, H).index_copy_(0, unique_ids_U, sums_UH)
        return None, grad_VH, None, None


def _gather_rows(ids_M: torch.Tensor, weight_VH: torch.Tensor, out_dtype: torch.dtype):
    if out_dtype == weight_VH.dtype:
        return weight_VH.index_select(0, ids_M)
    M, H = ids_M.shape[0], weight_VH.shape[1]
    out_MH = torch.empty(M, H, dtype=out_dtype, device=weight_VH.device)
    chunk = max(1, _UPCAST_CHUNK_BYTES // max(1, H * weight_VH.element_size()))
    for start in range(0, M, chunk):
        stop = min(M, start + chunk)
        out_MH[start:stop].copy_(weight_VH.index_select(0, ids_M[start:stop]))
    return out_MH


class NativeEmbeddingOp:
    """Token embedding ``out = weight[ids]`` in pure PyTorch: the ground-truth backend.

    Pure: neither ``ids`` nor ``weight`` is changed in place. Ids may have any integer dtype
    (int8/16/32/64, uint8...). The weight gradient reaches only the rows of ids that occur and is
    bitwise reproducible (sort-based segment sum, see the module docstring).

    Args:
        sparse_grad: return the weight gradient as a coalesced sparse COO tensor holding only the
            used rows (default: a dense [V, H] gradient, exactly zero on unused rows).
        validate_ids: check that every id lies in ``[0, V)`` (one device sync); turn off only where
            the ids are known to be in range.
    """

    backend_name = "torch"

    def __init__(self, *, sparse_grad: bool = False, validate_ids: bool = True) -> None:
        self.sparse_grad = sparse_grad
        self.validate_ids = validate_ids

    def _check(self, ids: torch.Tensor, weight_VH: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor) or not isinstance(weight_VH, torch.Tensor):
            raise ValueError(
                f"ids and weight must be tensors, got {type(ids).__name__} and "
                f"{type(weight_VH).__name__}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"ids must have an integer dtype, got {ids.dtype}; pass token ids "
                "(int8/16/32/64 or uint8)"
            )
        if weight_VH.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D [vocab, hidden] table, got shape {tuple(weight_VH.shape)}"
            )
        if ids.device != weight_VH.device:
            raise ValueError(
                f"ids on {ids.device} but weight on {weight_VH.device}; move the ids to the "
                "weight's device"
            )
        if self.validate_ids and ids.numel() > 0:
            vocab = weight_VH.shape[0]
            lo, hi = (int(x) for x in torch.aminmax(ids.reshape(-1).long()))
            if lo < 0 or hi >= vocab:
                raise ValueError(
                    f"token id out of range: max id {hi}, min id {lo}, vocab size {vocab}; ids "
                    f"must lie in [0, {vocab - 1}] (check the tokenizer matches the table)"
                )

    def _run(self, ids: torch.Tensor, weight_VH: torch.Tensor, out_dtype: torch.dtype):
        self._check(ids, weight_VH)
        ids_M = ids.reshape(-1).long()
        rows_MH = _DeterministicGather.apply(ids_M, weight_VH, out_dtype, self.sparse_grad)
        return rows_MH.view(*ids.shape, weight_VH.shape[1])

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gather rows in the weight's dtype.

        Shape:
            ids [*], weight [V, H] -> out [*, H] (weight dtype).

        Args:
            ids: integer token ids of any shape and integer dtype.
            weight: [V, H] embedding table.

        Returns:
            The gathered rows, bitwise equal to ``weight[ids.long()]``.

        Raises:
            ValueError: non-integer ids, a non-2-D table, mismatched devices, or an id outside
                ``[0, V)`` (the message names the max id and the vocab size).
        """
        return self._run(ids, weight, weight.dtype)

    def forward_fp32(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gather rows and upcast only them to fp32 (the table is never copied).

        Shape:
            ids [*], weight [V, H] -> out [*, H] float32.

        Args:
            ids: integer token ids of any shape and integer dtype.
            weight: [V, H] embedding table of any floating dtype.

        Returns:
            fp32 rows, bitwise equal to ``weight[ids.long()].float()``.

        Raises:
            ValueError: as :meth:`forward`.
        """
        return self._run(ids, weight, torch.float32)

    __call__ = forward
