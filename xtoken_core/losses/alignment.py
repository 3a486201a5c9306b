"""The alignment as the loss reads it: one teacher's alignment fields from a batch, the chunk ids
shifted to next-token targets, the valid chunks, and the rows of each valid chunk.

Every backend starts from these: the reference and CPU backends through :func:`valid_chunks`, the
kernel backend through its chunk plan (:mod:`xtoken_core.kernels.chunk_plan`, the device twin of
:func:`shift_chunk_ids`, :func:`chunk_validity` and :func:`chunk_rows`).

Legend (shape suffixes in this file):
    B batch, T tokens (either side), U teacher tokens, C chunk slots (``max_pairs``), K values per
    position, N valid chunks, R rows (``B*T``), S flattened ``[B, C]`` slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xtoken_core.losses.checks import DeferredChecks
    from xtoken_core.losses.config import CrossTokenizerLossConfig

__all__ = [
    "AlignmentView",
    "ChunkRows",
    "alignment_from_batch",
    "check_alignment_shapes",
    "check_chunk_ids",
    "chunk_mean_scatter",
    "chunk_row_index",
    "chunk_rows",
    "chunk_sizes",
    "chunk_validity",
    "shift_chunk_ids",
    "valid_chunk_mask",
    "valid_chunk_numbering",
    "valid_chunks",
]

#: Fields the losses cannot do without (the collator's ``alignment_<field>`` keys).
REQUIRED_ALIGNMENT_FIELDS = ("pair_valid", "student_chunk_id", "teacher_chunk_id")


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

    Teacher ``i`` reads its own ``teacher{i}_alignment_<field>`` keys when the batch has any
    (several teachers with different tokenizers; then it must have every required one), else
    the shared ``alignment_<field>``.

    Args:
        batch: the batch mapping.
        teacher_index: which teacher.

    Returns:
        An :class:`AlignmentView`.

    Raises:
        ValueError: a required field is missing, or chunk ids of a non-integer dtype.
    """

    # a teacher with alignment keys of its own has all of them: a missing one must not fall back
    # to another teacher's (the shared keys are teacher 0's)
    own = f"teacher{teacher_index}_alignment_"
    prefix = own if any(str(k).startswith(own) for k in batch) else "alignment_"

    def get(field: str) -> torch.Tensor | None:
        return batch.get(f"{prefix}{field}")

    missing = [f"{prefix}{f}" for f in REQUIRED_ALIGNMENT_FIELDS if get(f) is None]
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


def check_alignment_shapes(alignment: AlignmentView, B: int, T: int, U: int | None) -> None:
    """The cheap shape checks of one teacher's alignment against the logits.

    Args:
        alignment: the teacher's alignment.
        B: batch size.
        T: student tokens.
        U: teacher tokens (None: not checked).

    Raises:
        ValueError: a field whose shape does not fit the logits, naming it.
    """
    C = alignment.max_chunks
    s_ids, t_ids = alignment.student_chunk_id, alignment.teacher_chunk_id
    if alignment.pair_valid.dim() != 2 or alignment.pair_valid.shape[0] != B or C < 1:
        raise ValueError(
            f"alignment_pair_valid is {tuple(alignment.pair_valid.shape)}, expected "
            f"[{B}, C] with C >= 1"
        )
    if tuple(s_ids.shape) != (B, T):
        raise ValueError(
            f"alignment_student_chunk_id is {tuple(s_ids.shape)} but the student logits "
            f"are [{B}, {T}, V]; the alignment must come from the same batch"
        )
    if t_ids.dim() != 2 or t_ids.shape[0] != B or (U is not None and t_ids.shape[1] != U):
        raise ValueError(
            f"alignment_teacher_chunk_id is {tuple(t_ids.shape)} but the teacher logits "
            f"are [{B}, {U}, W]; the alignment must come from the same batch"
        )
    if (
        alignment.pair_is_correct is not None
        and alignment.pair_is_correct.shape != alignment.pair_valid.shape
    ):
        raise ValueError(
            f"alignment_pair_is_correct is {tuple(alignment.pair_is_correct.shape)}, "
            f"expected {tuple(alignment.pair_valid.shape)} like alignment_pair_valid"
        )


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


# --------------------------------------------------------------------------- valid chunks


def valid_chunk_mask(
    s_sizes_BC: torch.Tensor, t_sizes_BC: torch.Tensor, pair_valid_BC: torch.Tensor
) -> torch.Tensor:
    """Chunks that count: non-empty on both sides and ``pair_valid``.

    Args:
        s_sizes_BC: ``[B, C]`` student chunk sizes.
        t_sizes_BC: ``[B, C]`` teacher chunk sizes.
        pair_valid_BC: ``[B, C]`` bool (fold the sample mask and ``pair_is_correct`` in first).

    Returns:
        ``[B, C]`` bool.
    """
    return (s_sizes_BC > 0) & (t_sizes_BC > 0) & pair_valid_BC.bool()


def chunk_validity(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
) -> torch.Tensor:
    """The full validity gate of the loss math (docs/design.md), from (shifted) chunk ids alone.

    Args:
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        pair_valid_BC: ``[B, C]`` bool.
        sample_mask_B: ``[B]``; masked samples (0/False) have no valid chunk. None: all count.
        pair_is_correct_BC: ``[B, C]`` bool, needed with ``exact_token_match_only``.
        exact_token_match_only: keep only chunks whose two sides cover identical text.

    Returns:
        ``[B, C]`` bool.

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    C = pair_valid_BC.shape[1]
    mask_BC = pair_valid_BC.bool()
    if sample_mask_B is not None:
        mask_BC = mask_BC & sample_mask_B.bool().view(-1, 1)
    if exact_token_match_only:
        if pair_is_correct_BC is None:
            raise ValueError(
                "exact_token_match_only=True needs alignment_pair_is_correct in the batch"
            )
        mask_BC = mask_BC & pair_is_correct_BC.bool()
    return valid_chunk_mask(
        chunk_sizes(student_chunk_id_BT, C), chunk_sizes(teacher_chunk_id_BU, C), mask_BC
    )


def valid_chunks(
    alignment: AlignmentView,
    config: CrossTokenizerLossConfig,
    sample_mask_B: torch.Tensor | None,
    checks: DeferredChecks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shifted chunk ids and the valid chunks of one teacher (shapes checked already:
    :func:`check_alignment_shapes`).

    Args:
        alignment: the teacher's alignment.
        config: the loss settings (``check_inputs``, ``exact_token_match_only``).
        sample_mask_B: [B] or None.
        checks: where the id-range checks are queued (the ids are clamped so that nothing
            indexes out of bounds before they run); None: checked here (a host sync).

    Returns:
        ``(student_chunk_id_BT, teacher_chunk_id_BU, valid_BC)``: the shifted ids and the
        validity of :func:`chunk_validity`.

    Raises:
        ValueError: (without ``checks``) ids out of range.
    """
    C = alignment.max_chunks
    s_ids, t_ids = alignment.student_chunk_id, alignment.teacher_chunk_id
    if config.check_inputs:
        if checks is None:
            check_chunk_ids("alignment_student_chunk_id", s_ids, C)
            check_chunk_ids("alignment_teacher_chunk_id", t_ids, C)
        else:
            checks.id_range("alignment_student_chunk_id", s_ids, C)
            checks.id_range("alignment_teacher_chunk_id", t_ids, C)
            s_ids, t_ids = s_ids.clamp(-1, C - 1), t_ids.clamp(-1, C - 1)
    s_ids, t_ids = shift_chunk_ids(s_ids), shift_chunk_ids(t_ids)
    valid_BC = chunk_validity(
        s_ids,
        t_ids,
        alignment.pair_valid,
        sample_mask_B=sample_mask_B,
        pair_is_correct_BC=alignment.pair_is_correct,
        exact_token_match_only=config.exact_token_match_only,
    )
    return s_ids, t_ids, valid_BC


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
