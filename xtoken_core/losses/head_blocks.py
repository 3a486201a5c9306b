"""Row blocks of a micro-batch for the fused output head: the student rows cut into blocks that
hold whole chunks of every teacher, and each block's own loss batch (the alignment re-based to it).

The fused head (:mod:`xtoken_core.losses.fused_head`) computes the student logits one block at a
time; the chunk terms are exact only when no chunk is split between two blocks, on either side.
Everything here is pure index work on the host (CPU tensors in, CPU tensors out).

Row targets. The logits of flat row ``r = b * T + p`` belong to the chunk of token ``p + 1``
(:func:`~xtoken_core.losses.alignment.shift_chunk_ids`) and predict ``input_ids[b, p + 1]``. A block
batch is one sample of ``L + 1`` positions laid out so that the loss's own shift gives row ``j``
of the block (flat row ``rows_L[j]``) exactly those targets: position 0 holds nothing, position
``j + 1`` holds the targets of row ``j``, and the block's logits get one filler row at the end
(its targets would be position ``L + 1``: none). Rows of several samples sit side by side: every
row carries its own targets, so nothing leaks across a sample boundary.

Teacher side of a block (teacher ``i``): the teacher rows of the block's valid chunks, in flat
order, between two filler rows: ``[fill, rows..., fill]``, whose raw chunk ids are
``[-1, K, ids...]`` (after the shift, the first filler row is in chunk slot ``K``, a slot with
``pair_valid`` False and no student row, so it never counts; the last one is in none). The filler
row is the head's to choose: P-KL puts there the column-wise max of the rows that pick its
``vocab_topk`` teacher columns over the whole micro-batch, so that each block picks the columns
the whole micro-batch picks (the first filler row is a picking row under either
``topk_columns`` rule, the last one under "all").

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, C chunk slots, R flat student rows (B*T),
    Q flat teacher rows (B*U), N rows that reach the loss, L rows of a block, K chunks of a
    block, G teacher rows of a block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xtoken_core.losses.alignment import alignment_from_batch, shift_chunk_ids

__all__ = ["RowBlock", "block_batch", "block_ends", "cut_allowed", "plan_blocks", "row_targets"]


@dataclass(frozen=True)
class RowTargets:
    """What every flat student row of a micro-batch feeds (CPU).

    Attributes:
        B: samples.
        T: student tokens.
        ce_R: bool [R], the row's CE target counts (token mask of ``p + 1``, sample mask).
        target_ids_R: int64 [R], the row's CE target (``input_ids[b, p + 1]``, 0 where none).
        keys: per teacher, int64 [R] chunk key ``b * C + c`` of the row's shifted chunk, -1 none.
        teacher_keys: per teacher, int64 [Q] the same key of each flat teacher row.
        valid_keys: per teacher, bool [B * C], the chunk slot is ``pair_valid`` in an unmasked
            sample.
        correct_keys: per teacher, bool [B * C] ``pair_is_correct``, or None.
        num_slots: per teacher, C.
    """

    B: int
    T: int
    ce_R: torch.Tensor
    target_ids_R: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    teacher_keys: tuple[torch.Tensor, ...]
    valid_keys: tuple[torch.Tensor, ...]
    correct_keys: tuple[torch.Tensor | None, ...]
    num_slots: tuple[int, ...]


@dataclass(frozen=True)
class RowBlock:
    """One block: its student rows, its teachers' rows and its loss batch (CPU).

    Attributes:
        rows_L: int64 [L] flat student rows ``b * T + p``, ascending.
        teacher_rows: per teacher, int64 [G + 2] flat teacher rows ``b * U + u`` of the block's
            teacher logits; -1 marks the two filler rows (first and last).
        batch: the block's loss batch, one sample: ``input_ids``, ``token_mask`` [1, L + 1] and
            per teacher ``teacher{i}_alignment_{student_chunk_id [1, L + 1], teacher_chunk_id
            [1, G + 2], pair_valid [1, K + 1], pair_is_correct [1, K + 1]}`` (raw ids).
    """

    rows_L: torch.Tensor
    teacher_rows: tuple[torch.Tensor, ...]
    batch: dict[str, torch.Tensor]


def _cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().cpu()


def row_targets(batch: Mapping[str, Any], num_teachers: int) -> RowTargets:
    """The per-row targets of a micro-batch (the shifts and masks the loss applies).

    Args:
        batch: flat batch with ``alignment_*`` keys (per teacher ``teacher{i}_alignment_*``)
            when ``num_teachers > 0``, and ``input_ids`` (optional with teachers), ``token_mask``
            [B, T] and ``sample_mask`` [B] (optional).
        num_teachers: teachers of the loss (0: the CE alone).

    Returns:
        :class:`RowTargets`.

    Raises:
        ValueError: no ``input_ids`` and no teacher (nothing says how many rows there are).
    """
    input_ids = _cpu(batch.get("input_ids"))
    alignments = [alignment_from_batch(batch, i) for i in range(num_teachers)]
    if alignments:
        B, T = alignments[0].student_chunk_id.shape
    elif input_ids is not None:
        B, T = input_ids.shape
    else:
        raise ValueError("a CE-only head needs input_ids in the batch")
    sample_B = _cpu(batch.get("sample_mask"))
    sample_B = torch.ones(B, dtype=torch.bool) if sample_B is None else sample_B.bool()
    ce_BT = torch.zeros(B, T, dtype=torch.bool)
    target_BT = torch.zeros(B, T, dtype=torch.long)
    if input_ids is not None:
        token_mask = _cpu(batch.get("token_mask"))
        mask_BT = torch.ones(B, T, dtype=torch.bool) if token_mask is None else token_mask.bool()
        ce_BT[:, :-1] = mask_BT[:, 1:] & sample_B.view(-1, 1)
        target_BT[:, :-1] = input_ids[:, 1:].long()
    keys, teacher_keys, valid_keys, correct_keys, slots = [], [], [], [], []
    for a in alignments:
        C = a.max_chunks
        s_BT = shift_chunk_ids(_cpu(a.student_chunk_id))
        t_BU = shift_chunk_ids(_cpu(a.teacher_chunk_id))
        keys.append(_chunk_keys(s_BT, C))
        teacher_keys.append(_chunk_keys(t_BU, C))
        valid_keys.append((_cpu(a.pair_valid) & sample_B.view(-1, 1)).reshape(-1))
        pc = _cpu(a.pair_is_correct)
        correct_keys.append(None if pc is None else pc.reshape(-1))
        slots.append(C)
    return RowTargets(
        B=B,
        T=T,
        ce_R=ce_BT.reshape(-1),
        target_ids_R=target_BT.reshape(-1),
        keys=tuple(keys),
        teacher_keys=tuple(teacher_keys),
        valid_keys=tuple(valid_keys),
        correct_keys=tuple(correct_keys),
        num_slots=tuple(slots),
    )


def _chunk_keys(shifted_BX: torch.Tensor, C: int) -> torch.Tensor:
    """Flat ``b * C + c`` of every shifted id ``c >= 0``, -1 elsewhere (ids past C as well:
    the loss's own checks refuse them)."""
    B = shifted_BX.shape[0]
    base_B1 = torch.arange(B).view(-1, 1) * C
    ok_BX = (shifted_BX >= 0) & (shifted_BX < C)
    return torch.where(ok_BX, base_B1 + shifted_BX, -1).reshape(-1)


def live_rows(targets: RowTargets) -> torch.Tensor:
    """Rows whose logits reach the loss: a CE target, or a chunk of some teacher.

    The other rows (padding, the last row of a sample without a chunk) get no gradient and
    add nothing; the head skips them.

    Returns:
        int64 [N] flat rows, ascending.
    """
    live_R = targets.ce_R.clone()
    for key_R in targets.keys:
        live_R |= key_R >= 0
    return live_R.nonzero().view(-1)


def cut_allowed(targets: RowTargets, rows_N: torch.Tensor) -> torch.Tensor:
    """Where a block may end: before row ``k`` of ``rows_N`` when no chunk of any teacher has
    rows on both sides.

    Args:
        targets: the micro-batch's :class:`RowTargets`.
        rows_N: the rows the blocks cover (:func:`live_rows`), ascending.

    Returns:
        bool [N + 1]: entry k says a block may end before ``rows_N[k]`` (0 and N always may).
    """
    N = rows_N.numel()
    open_N1 = torch.zeros(N + 1, dtype=torch.long)
    pos_N = torch.arange(N)
    for key_R in targets.keys:
        key_N = key_R[rows_N]
        has_N = key_N >= 0
        if not bool(has_N.any()):
            continue
        keys, inverse = torch.unique(key_N[has_N], return_inverse=True)
        first = torch.full((keys.numel(),), N, dtype=torch.long)
        last = torch.full((keys.numel(),), -1, dtype=torch.long)
        first.scatter_reduce_(0, inverse, pos_N[has_N], "amin")
        last.scatter_reduce_(0, inverse, pos_N[has_N], "amax")
        # a chunk whose rows span positions first..last is open at every cut first+1..last
        diff = torch.zeros(N + 2, dtype=torch.long)
        diff.index_add_(0, first + 1, torch.ones_like(first))
        diff.index_add_(0, last + 1, -torch.ones_like(last))
        open_N1 += torch.cumsum(diff, 0)[: N + 1]
    return open_N1 == 0


def block_ends(allowed_N1: torch.Tensor, target_rows: int) -> list[tuple[int, int]]:
    """Greedy blocks of about ``target_rows`` rows: each ends at the last allowed cut at or below
    its start + ``target_rows``, or, when a chunk is longer than that, at the first allowed cut
    after it.

    Args:
        allowed_N1: bool [N + 1] from :func:`cut_allowed`.
        target_rows: rows per block wanted (>= 1).

    Returns:
        ``[(start, stop), ...]`` positions into the rows, covering ``0..N`` in order; one
        ``(0, 0)`` block when N is 0.

    Raises:
        ValueError: ``target_rows < 1``.
    """
    if target_rows < 1:
        raise ValueError(f"target_rows={target_rows} must be >= 1")
    N = allowed_N1.numel() - 1
    cuts = np.flatnonzero(allowed_N1.numpy())
    if N == 0:
        return [(0, 0)]
    out, start = [], 0
    while start < N:
        want = start + target_rows
        if want >= N:
            stop = N
        else:
            i = int(np.searchsorted(cuts, want, side="right")) - 1  # last cut <= want
            stop = int(cuts[i])
            if stop <= start:  # a chunk longer than a block: grow to its end
                stop = int(cuts[np.searchsorted(cuts, want, side="right")])
        out.append((start, stop))
        start = stop
    return out


def block_batch(targets: RowTargets, rows_L: torch.Tensor) -> RowBlock:
    """The loss batch of one block (the layout of the module docstring).

    Args:
        targets: the micro-batch's :class:`RowTargets`.
        rows_L: the block's flat student rows, ascending, holding whole chunks.

    Returns:
        :class:`RowBlock`.
    """
    L = rows_L.numel()
    none_1 = torch.full((1,), -1, dtype=torch.long)
    batch = {
        "input_ids": torch.cat([torch.zeros(1, dtype=torch.long), targets.target_ids_R[rows_L]])[
            None
        ],
        "token_mask": torch.cat([torch.zeros(1, dtype=torch.bool), targets.ce_R[rows_L]])[None],
    }
    teacher_rows = []
    for i, key_R in enumerate(targets.keys):
        key_L = key_R[rows_L]
        has_L = key_L >= 0
        keys_K, inverse = torch.unique(key_L[has_L], return_inverse=True)
        K = keys_K.numel()
        ids_L = torch.full((L,), -1, dtype=torch.long)
        ids_L[has_L] = inverse
        valid_K = targets.valid_keys[i][keys_K]
        # the teacher rows of the block's valid chunks (others could not count: no gather)
        t_key_Q = targets.teacher_keys[i]
        rows_G = torch.isin(t_key_Q, keys_K[valid_K]).nonzero().view(-1)
        t_ids_G = torch.searchsorted(keys_K, t_key_Q[rows_G])
        sentinel_1 = torch.full((1,), K, dtype=torch.long)
        prefix = f"teacher{i}_alignment_"
        batch[prefix + "student_chunk_id"] = torch.cat([none_1, ids_L])[None]
        batch[prefix + "teacher_chunk_id"] = torch.cat([none_1, sentinel_1, t_ids_G])[None]
        no_1 = torch.zeros(1, dtype=torch.bool)
        batch[prefix + "pair_valid"] = torch.cat([valid_K, no_1])[None]
        correct = targets.correct_keys[i]
        if correct is not None:
            batch[prefix + "pair_is_correct"] = torch.cat([correct[keys_K], no_1])[None]
        teacher_rows.append(torch.cat([none_1, rows_G, none_1]))
    return RowBlock(rows_L=rows_L, teacher_rows=tuple(teacher_rows), batch=batch)


def plan_blocks(
    batch: Mapping[str, Any], num_teachers: int, target_rows: int | None
) -> list[RowBlock]:
    """Cut a micro-batch into row blocks of about ``target_rows`` rows that split no chunk.

    Args:
        batch: the micro-batch (see :func:`row_targets`); read on the host.
        num_teachers: teachers of the loss (0: CE alone, any cut is allowed).
        target_rows: rows per block wanted; None: one block.

    Returns:
        The blocks, covering every row that reaches the loss once, in order (at least one).
    """
    targets = row_targets(batch, num_teachers)
    rows_N = live_rows(targets)
    allowed_N1 = cut_allowed(targets, rows_N)
    size = max(rows_N.numel(), 1) if target_rows is None else target_rows
    return [block_batch(targets, rows_N[a:b]) for a, b in block_ends(allowed_N1, size)]
