"""Loss plumbing: fp32 sparse matmul, DP counts, chunk ids and rows, alignment view, projections.

Legend (shape suffixes in this file):
    B batch, T tokens (either side), C chunk slots (``max_pairs``), N non-zeros (projections)
    or valid chunks (chunk rows), R rows (``B*T``), S flattened ``[B, C]`` slots,
    V student vocab, W teacher vocab, K top-k slots of a dense projection row,
    X columns of the dense operand of a sparse matmul.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.amp import custom_bwd, custom_fwd

logger = logging.getLogger(__name__)

#: The flat alignment fields a batch carries (``alignment_<field>``), see docs/design.md, "The byte alignment".
ALIGNMENT_FIELDS = (
    "pair_valid",
    "pair_is_correct",
    "student_chunk_id",
    "teacher_chunk_id",
    "num_chunks",
    "student_exact_partition_mask",
    "teacher_exact_partition_mask",
)
#: Fields the losses cannot do without.
REQUIRED_ALIGNMENT_FIELDS = ("pair_valid", "student_chunk_id", "teacher_chunk_id")


# --------------------------------------------------------------------------- fp32 sparse mm


@functools.cache
def _fp32_sparse_mm_function(device_type: str) -> type[torch.autograd.Function]:
    """One autograd Function per device type: ``custom_fwd`` binds the device type at definition."""

    class _Fp32SparseMM(torch.autograd.Function):
        @staticmethod
        @custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx: Any, sparse_M_VW: torch.Tensor, dense_VX: torch.Tensor) -> torch.Tensor:
            # Outside autocast cast_inputs is a no-op: follow the dense dtype (float64 gradcheck).
            sparse_M_VW = sparse_M_VW.to(dense_VX.dtype)
            ctx.save_for_backward(sparse_M_VW)
            return torch.sparse.mm(sparse_M_VW.t(), dense_VX)

        @staticmethod
        @custom_bwd(device_type=device_type)
        def backward(ctx: Any, grad_WX: torch.Tensor) -> tuple[None, torch.Tensor]:
            (sparse_M_VW,) = ctx.saved_tensors
            # The projection is frozen: no gradient for it.
            return None, torch.sparse.mm(sparse_M_VW, grad_WX.to(sparse_M_VW.dtype))

    _Fp32SparseMM.__name__ = f"Fp32SparseMM_{device_type}"
    return _Fp32SparseMM


class Fp32SparseMM:
    """``M.t() @ dense`` with a sparse frozen ``M`` that stays in fp32 inside bf16 autocast.

    PyTorch has no bf16 sparse-mm kernel, and ``loss.backward()`` runs inside the caller's
    autocast, so disabling autocast around the forward alone is not enough.
    ``custom_fwd(cast_inputs=float32)`` / ``custom_bwd`` make both passes run in fp32. The
    device type that autocast keys on is taken from the dense input. No gradient reaches ``M``.
    Outside autocast the dense dtype is kept (float64 stays float64, for gradcheck).
    """

    @staticmethod
    def apply(sparse_M_VW: torch.Tensor, dense_VX: torch.Tensor) -> torch.Tensor:
        """Compute ``sparse_M.t() @ dense``.

        Args:
            sparse_M_VW: sparse COO ``[V, W]`` matrix (frozen).
            dense_VX: dense ``[V, X]``.

        Returns:
            Dense ``[W, X]`` (fp32 under autocast, else the dense dtype).
        """
        return _fp32_sparse_mm_function(dense_VX.device.type).apply(sparse_M_VW, dense_VX)


# --------------------------------------------------------------------------- distributed


def dp_all_reduce_sum(local: torch.Tensor | float | int) -> torch.Tensor:
    """Sum a count across the data-parallel (default) process group.

    Args:
        local: a scalar (or small) tensor or number; it is not modified.

    Returns:
        A fresh float32 tensor on the input's device holding the sum over ranks; a copy of the
        local value when torch.distributed is not initialized.
    """
    if isinstance(local, torch.Tensor):
        out = local.detach().to(torch.float32).clone()
    else:
        out = torch.tensor(float(local), dtype=torch.float32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


# --------------------------------------------------------------------------- chunk ids


def shift_chunk_ids(chunk_id_BT: torch.Tensor) -> torch.Tensor:
    """Shift chunk ids to next-token targets: the logits at p predict token p+1.

    Args:
        chunk_id_BT: ``[B, T]`` int64 chunk ids, -1 = no chunk.

    Returns:
        ``[B, T]`` with ``shifted[:, p] = chunk_id[:, p + 1]`` and ``shifted[:, -1] = -1``.
    """
    shifted_BT = torch.full_like(chunk_id_BT, -1)
    shifted_BT[:, :-1] = chunk_id_BT[:, 1:]
    return shifted_BT


def chunk_sizes(chunk_id_BT: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Count the positions of every chunk (cheap scatter, no one-hot).

    Args:
        chunk_id_BT: ``[B, T]`` int64 ids in ``[-1, num_chunks)``; -1 is counted nowhere.
        num_chunks: number of chunk slots C.

    Returns:
        ``[B, C]`` float32 sizes.
    """
    B = chunk_id_BT.shape[0]
    counts_BC1 = torch.zeros(B, num_chunks + 1, dtype=torch.float32, device=chunk_id_BT.device)
    counts_BC1.scatter_add_(1, chunk_id_BT + 1, torch.ones_like(chunk_id_BT, dtype=torch.float32))
    return counts_BC1[:, 1:]


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


def check_chunk_ids(name: str, chunk_id_BT: torch.Tensor, num_chunks: int) -> None:
    """Raise unless every id lies in ``[-1, num_chunks)``.

    Args:
        name: tensor name for the message.
        chunk_id_BT: ``[B, T]`` chunk ids.
        num_chunks: number of chunk slots C.

    Raises:
        ValueError: an id is out of range or the dtype is not an integer type.
    """
    if chunk_id_BT.is_floating_point() or chunk_id_BT.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {chunk_id_BT.dtype}")
    if chunk_id_BT.numel() == 0:
        return
    lo, hi = int(chunk_id_BT.min()), int(chunk_id_BT.max())
    if lo < -1 or hi >= num_chunks:
        raise ValueError(
            f"{name} has ids in [{lo}, {hi}] but must lie in [-1, {num_chunks}) "
            f"(num_chunks = alignment_pair_valid.shape[1] = {num_chunks}); "
            "re-run the aligner or widen alignment_pair_valid"
        )


# --------------------------------------------------------------------------- valid-chunk rows


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


def valid_chunk_numbering(valid_BC: torch.Tensor) -> torch.Tensor:
    """Number the valid chunks 0..N-1 in ``[B, C]`` order.

    Args:
        valid_BC: [B, C] bool.

    Returns:
        segmap_S int64 [B*C]: the valid-chunk index of each slot, -1 where not valid.
    """
    flat_S = valid_BC.reshape(-1)
    return torch.where(flat_S, torch.cumsum(flat_S, 0) - 1, -1)


def chunk_row_index(
    chunk_id_BT: torch.Tensor, valid_BC: torch.Tensor, segmap_S: torch.Tensor | None = None
) -> torch.Tensor:
    """Valid-chunk index of every row (the ``nidx_R`` of :class:`ChunkRows`, without the sort).

    Args:
        chunk_id_BT: [B, T] shifted chunk ids in [-1, C).
        valid_BC: [B, C] bool.
        segmap_S: :func:`valid_chunk_numbering` of ``valid_BC`` on the ids' device; None:
            computed here.

    Returns:
        nidx_R int64 [B*T], -1 for rows of no valid chunk.
    """
    B = chunk_id_BT.shape[0]
    C = valid_BC.shape[1]
    device = chunk_id_BT.device
    if segmap_S is None:
        segmap_S = valid_chunk_numbering(valid_BC.to(device))
    cid_BT = chunk_id_BT.long()
    seg_BT = torch.arange(B, device=device).view(-1, 1) * C + cid_BT.clamp(min=0)
    return torch.where(cid_BT >= 0, segmap_S[seg_BT], -1).reshape(-1).contiguous()


def chunk_rows(
    chunk_id_BT: torch.Tensor,
    valid_BC: torch.Tensor,
    num_valid: int,
    segmap_S: torch.Tensor | None = None,
) -> ChunkRows:
    """Group the rows of the valid chunks (no host sync besides what the caller did).

    Args:
        chunk_id_BT: [B, T] shifted chunk ids in [-1, C).
        valid_BC: [B, C] bool.
        num_valid: N, ``valid_BC.sum()``.
        segmap_S: :func:`valid_chunk_numbering` of ``valid_BC`` on the ids' device, when the
            caller shares it between both sides; None: computed here.

    Returns:
        :class:`ChunkRows`.
    """
    device = chunk_id_BT.device
    nidx_R = chunk_row_index(chunk_id_BT, valid_BC, segmap_S)
    key_R = torch.where(nidx_R >= 0, nidx_R, num_valid)
    sorted_R, order_R = torch.sort(key_R, stable=True)
    offsets_N1 = torch.searchsorted(sorted_R, torch.arange(num_valid + 1, device=device))
    sizes_N = (offsets_N1[1:] - offsets_N1[:-1]).to(torch.float32)
    return ChunkRows(nidx_R, order_R.contiguous(), offsets_N1.contiguous(), sizes_N)


# --------------------------------------------------------------------------- alignment view


@dataclass(frozen=True)
class AlignmentView:
    """The alignment fields of one teacher, read from a flat batch.

    Attributes:
        pair_valid: ``[B, C]`` bool.
        pair_is_correct: ``[B, C]`` bool or None.
        student_chunk_id: ``[B, T_s]`` int64, -1 = none.
        teacher_chunk_id: ``[B, T_t]`` int64, -1 = none.
        num_chunks: ``[B]`` int64 or None.
    """

    pair_valid: torch.Tensor
    pair_is_correct: torch.Tensor | None
    student_chunk_id: torch.Tensor
    teacher_chunk_id: torch.Tensor
    num_chunks: torch.Tensor | None

    @property
    def max_chunks(self) -> int:
        """Number of chunk slots C (``pair_valid.shape[1]``)."""
        return int(self.pair_valid.shape[1])


def alignment_from_batch(batch: Mapping[str, Any], teacher_index: int = 0) -> AlignmentView:
    """Read one teacher's alignment from the flat ``alignment_*`` keys of a batch.

    Teacher ``i`` reads ``teacher{i}_alignment_<field>`` when the batch has it (several teachers
    with different tokenizers), else the shared ``alignment_<field>``.

    Args:
        batch: the batch mapping.
        teacher_index: which teacher.

    Returns:
        An :class:`AlignmentView`.

    Raises:
        ValueError: a required field is missing, or chunk ids of a non-integer dtype.
    """

    def get(field: str) -> torch.Tensor | None:
        for key in (f"teacher{teacher_index}_alignment_{field}", f"alignment_{field}"):
            if key in batch:
                return batch[key]
        return None

    missing = [f"alignment_{f}" for f in REQUIRED_ALIGNMENT_FIELDS if get(f) is None]
    if missing:
        raise ValueError(
            f"batch lacks {missing} (teacher {teacher_index}); batches must carry the collator's "
            "alignment_* keys"
        )
    for field in ("student_chunk_id", "teacher_chunk_id"):
        ids = get(field)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            # .long() would truncate 2.7 to chunk 2: the ids were mangled on the way here
            raise ValueError(
                f"alignment_{field} (teacher {teacher_index}) has dtype {ids.dtype}; chunk ids "
                "must be an integer tensor (int64 from the aligner): keep them integer when "
                "padding or moving the batch"
            )
    return AlignmentView(
        pair_valid=get("pair_valid").bool(),
        pair_is_correct=None if get("pair_is_correct") is None else get("pair_is_correct").bool(),
        student_chunk_id=get("student_chunk_id").long(),
        teacher_chunk_id=get("teacher_chunk_id").long(),
        num_chunks=get("num_chunks"),
    )


# --------------------------------------------------------------------------- projections


def sparse_projection_from_topk(
    indices_VK: torch.Tensor,
    likelihoods_VK: torch.Tensor,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> torch.Tensor:
    """Build the sparse ``M[V, W]`` from a dense top-k projection, dropping -1 entries.

    Args:
        indices_VK: ``[V_rows, K]`` int teacher ids, -1 = no entry.
        likelihoods_VK: ``[V_rows, K]`` float weights.
        student_vocab_size: V, must be ``>= V_rows``.
        teacher_vocab_size: W, must exceed every teacher id.

    Returns:
        Coalesced float32 sparse COO ``[V, W]`` on the indices' device.

    Raises:
        ValueError: the projection is wider than the vocabularies or the shapes differ.
    """
    if indices_VK.shape != likelihoods_VK.shape or indices_VK.dim() != 2:
        raise ValueError(
            f"projection indices {tuple(indices_VK.shape)} and likelihoods "
            f"{tuple(likelihoods_VK.shape)} must both be [V_s, K]"
        )
    rows = indices_VK.shape[0]
    if rows > student_vocab_size:
        raise ValueError(
            f"projection has {rows} student rows but the student vocab is {student_vocab_size}; "
            "use the projection built for this student tokenizer"
        )
    keep_VK = indices_VK >= 0
    if keep_VK.any() and int(indices_VK.max()) >= teacher_vocab_size:
        raise ValueError(
            f"projection references teacher id {int(indices_VK.max())} but the teacher vocab is "
            f"{teacher_vocab_size}; set teacher_vocab_size or use the matching projection"
        )
    row_VK = torch.arange(rows, device=indices_VK.device).unsqueeze(1).expand_as(indices_VK)
    coords_2N = torch.stack([row_VK[keep_VK], indices_VK[keep_VK].long()])
    values_N = likelihoods_VK[keep_VK].to(torch.float32)
    return torch.sparse_coo_tensor(
        coords_2N,
        values_N,
        (student_vocab_size, teacher_vocab_size),
        check_invariants=False,  # ids validated above
    ).coalesce()
