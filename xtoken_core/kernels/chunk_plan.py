"""Chunk plan of the fused KD path: shifted ids, validity, valid-chunk numbering, row groups.

:func:`plan_chunks` turns the raw alignment (chunk ids of both sides, ``pair_valid`` and the
optional masks) into everything the fused loss kernels index with, on the device and without a
host sync; it replaces ~50 small PyTorch ops (shift, clamp, chunk sizes, validity, the
valid-chunk numbering, and per side a sort + searchsorted). Same results as
:func:`xtoken_core.losses.alignment.shift_chunk_ids`,
:func:`~xtoken_core.losses.alignment.chunk_validity` and
:func:`~xtoken_core.losses.alignment.chunk_rows` (a stable sort: rows keep their order).

Legend (shape suffixes):
    B batch, T student tokens, U teacher tokens, C chunk slots, S flattened ``[B, C]`` slots,
    R rows of one side (``B*T`` or ``B*U``), A rows of both sides (``B*T + B*U``).

* ``_plan_slots_kernel`` (one program): raw id range per side, shifted ids
  (``shifted[b, t] = clamp(raw[b, t + 1], -1, C - 1)``, -1 at ``t = T - 1``), chunk sizes
  (integer atomics: exact), then per slot in ``[B, C]`` order
  ``valid = pair_valid & sample_mask[b] & (pair_is_correct) & size_s > 0 & size_t > 0``, the
  valid-chunk number (running prefix count) and each side's row offsets (running prefix of
  the valid chunks' sizes).
* ``_plan_rows_kernel`` (program per side, sample, block of chunk slots): each row's valid
  chunk and its place in the stable counting sort, ``order[offsets[n] + rank] = row`` with
  ``rank`` = earlier rows of the same chunk; the program of slot block 0 places the rows of no
  valid chunk after all valid rows, in row order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ._utils import MAX_COMBINE, SUM_COMBINE, cdiv, lazy_jit, next_power_of_2, tl

logger = logging.getLogger(__name__)

__all__ = ["ChunkPlan", "plan_chunks"]

#: Block sizes: rows and slots per step of the one-program slot pass (wide steps: it is one
#: program), and its warps; rows x slots per tile of the row pass, and its warps.
PLAN_CONFIG = {"block": 4096, "warps": 16, "rows_block_t": 128, "rows_block_c": 32, "rows_warps": 8}

if tl is not None:
    _BIG = tl.constexpr(1 << 62)  # id-range sentinels (globals read by a kernel are constexpr)

    @lazy_jit(
        do_not_specialize=("B", "T", "U", "C"),
        do_not_specialize_on_alignment=(
            "raw_s_ptr",
            "raw_t_ptr",
            "pair_valid_S_ptr",
            "sample_mask_B_ptr",
            "pair_correct_S_ptr",
            "shift_A_ptr",
            "size_2S_ptr",
            "segmap_S_ptr",
            "valid_S_ptr",
            "offsets_2S1_ptr",
            "sizes_2S_ptr",
            "vbefore_2B1_ptr",
            "stats_5_ptr",
        ),
    )
    def _plan_slots_kernel(
        raw_s_ptr,
        raw_t_ptr,
        pair_valid_S_ptr,
        sample_mask_B_ptr,
        pair_correct_S_ptr,
        shift_A_ptr,
        size_2S_ptr,
        segmap_S_ptr,
        valid_S_ptr,
        offsets_2S1_ptr,
        sizes_2S_ptr,
        vbefore_2B1_ptr,
        stats_5_ptr,
        B,
        T,
        U,
        C,
        HAS_SAMPLE_MASK: tl.constexpr,
        EXACT_ONLY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        S = B * C
        offs = tl.arange(0, BLOCK)
        for s0 in range(0, 2 * S, BLOCK):
            s = s0 + offs
            tl.store(size_2S_ptr + s, tl.full((BLOCK,), 0, tl.int32), mask=s < 2 * S)
        tl.debug_barrier()
        # Per side (0 student, 1 teacher): raw range, shifted + clamped ids, chunk sizes.
        for side in tl.static_range(2):
            L = T if side == 0 else U
            base = 0 if side == 0 else B * T
            raw_ptr = raw_s_ptr if side == 0 else raw_t_ptr
            lo = tl.full([], _BIG, tl.int64)
            hi = tl.full([], -_BIG, tl.int64)
            for r0 in range(0, B * L, BLOCK):
                r = (r0 + offs).to(tl.int64)
                rm = r < B * L
                raw = tl.load(raw_ptr + r, mask=rm, other=0).to(tl.int64)
                lo = tl.minimum(lo, -tl.reduce(tl.where(rm, -raw, -_BIG), 0, MAX_COMBINE))
                hi = tl.maximum(hi, tl.reduce(tl.where(rm, raw, -_BIG), 0, MAX_COMBINE))
                t = r % L
                nxt = tl.load(raw_ptr + r + 1, mask=rm & (t < L - 1), other=-1).to(tl.int64)
                cid = tl.minimum(tl.maximum(nxt, -1), C - 1)
                tl.store(shift_A_ptr + base + r, cid, mask=rm)
                counted = rm & (cid >= 0)
                slot = side * S + (r // L) * C + tl.maximum(cid, 0)
                tl.atomic_add(size_2S_ptr + slot, tl.full((BLOCK,), 1, tl.int32), mask=counted)
            tl.store(stats_5_ptr + 2 * side, lo)
            tl.store(stats_5_ptr + 2 * side + 1, hi)
        tl.debug_barrier()
        # Per slot in [B, C] order: validity, number, offsets of both sides.
        n_run = tl.full([], 0, tl.int64)
        s_run = tl.full([], 0, tl.int64)
        t_run = tl.full([], 0, tl.int64)
        for s0 in range(0, S, BLOCK):
            s = (s0 + offs).to(tl.int64)
            sm = s < S
            b = s // C
            size_s = tl.load(size_2S_ptr + s, mask=sm, other=0, cache_modifier=".cg")
            size_t = tl.load(size_2S_ptr + S + s, mask=sm, other=0, cache_modifier=".cg")
            ok = tl.load(pair_valid_S_ptr + s, mask=sm, other=0) != 0
            if HAS_SAMPLE_MASK:
                ok = ok & (tl.load(sample_mask_B_ptr + b, mask=sm, other=0) != 0)
            if EXACT_ONLY:
                ok = ok & (tl.load(pair_correct_S_ptr + s, mask=sm, other=0) != 0)
            valid = sm & ok & (size_s > 0) & (size_t > 0)
            v64 = valid.to(tl.int64)
            rows_s = tl.where(valid, size_s, 0).to(tl.int64)
            rows_t = tl.where(valid, size_t, 0).to(tl.int64)
            num = n_run + tl.associative_scan(v64, 0, SUM_COMBINE) - 1
            off_s = s_run + tl.associative_scan(rows_s, 0, SUM_COMBINE) - rows_s
            off_t = t_run + tl.associative_scan(rows_t, 0, SUM_COMBINE) - rows_t
            tl.store(segmap_S_ptr + s, tl.where(valid, num, -1), mask=sm)
            tl.store(valid_S_ptr + s, valid, mask=sm)
            nn = tl.maximum(num, 0)
            tl.store(offsets_2S1_ptr + nn, off_s, mask=valid)
            tl.store(offsets_2S1_ptr + (S + 1) + nn, off_t, mask=valid)
            tl.store(sizes_2S_ptr + nn, size_s.to(tl.float32), mask=valid)
            tl.store(sizes_2S_ptr + S + nn, size_t.to(tl.float32), mask=valid)
            first = sm & (s % C == 0)  # rows of valid chunks before sample b, per side
            tl.store(vbefore_2B1_ptr + b, off_s, mask=first)
            tl.store(vbefore_2B1_ptr + (B + 1) + b, off_t, mask=first)
            n_run += tl.reduce(v64, 0, SUM_COMBINE)
            s_run += tl.reduce(rows_s, 0, SUM_COMBINE)
            t_run += tl.reduce(rows_t, 0, SUM_COMBINE)
        tl.store(offsets_2S1_ptr + n_run, s_run)
        tl.store(offsets_2S1_ptr + (S + 1) + n_run, t_run)
        tl.store(vbefore_2B1_ptr + B, s_run)
        tl.store(vbefore_2B1_ptr + (B + 1) + B, t_run)
        tl.store(stats_5_ptr + 4, n_run)

    @lazy_jit(
        do_not_specialize=("B", "T", "U", "C"),
        do_not_specialize_on_alignment=(
            "shift_A_ptr",
            "segmap_S_ptr",
            "offsets_2S1_ptr",
            "vbefore_2B1_ptr",
            "nidx_A_ptr",
            "order_A_ptr",
        ),
    )
    def _plan_rows_kernel(
        shift_A_ptr,
        segmap_S_ptr,
        offsets_2S1_ptr,
        vbefore_2B1_ptr,
        nidx_A_ptr,
        order_A_ptr,
        B,
        T,
        U,
        C,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # Program (slot block, sample b, side). match[t, c] = (row t is in valid chunk c0 + c);
        # rank of row t = rows of its chunk seen in earlier tiles (run[c]) + inclusive column
        # prefix of match at t, minus 1. Rows of no valid chunk (slot block 0 only) go after
        # the N chunks' rows: offsets[N] + (invalid rows of samples < b) + their rank in b.
        cb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        side = tl.program_id(2)
        S = B * C
        L = tl.where(side == 0, T, U).to(tl.int64)
        base = tl.where(side == 0, 0, B * T).to(tl.int64)
        off_ptr = offsets_2S1_ptr + side * (S + 1)
        vb_ptr = vbefore_2B1_ptr + side * (B + 1)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        seg_c = tl.load(segmap_S_ptr + b * C + c, mask=cm, other=-1)
        has_c = seg_c >= 0
        start_c = tl.load(off_ptr + tl.maximum(seg_c, 0), mask=has_c, other=0)
        run = tl.full((BLOCK_C,), 0, tl.int64)
        n_total = tl.load(vb_ptr + B)  # rows of all valid chunks of this side
        inv_base = n_total + b * L - tl.load(vb_ptr + b)
        inv_run = tl.full([], 0, tl.int64)
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(0, L, BLOCK_T):
            t = t0 + offs_t
            tm = t < L
            r = b * L + t
            cid = tl.load(shift_A_ptr + base + r, mask=tm, other=-1)
            c0 = cb * BLOCK_C
            in_block = tm & (cid >= c0) & (cid < c0 + BLOCK_C)
            if tl.reduce(in_block.to(tl.int32), 0, MAX_COMBINE) > 0:  # most tiles: no id here
                match = (cid[:, None] == c[None, :]) & has_c[None, :] & tm[:, None]
                m64 = match.to(tl.int64)
                incl = tl.associative_scan(m64, 0, SUM_COMBINE)
                rank = tl.reduce(tl.where(match, incl - 1 + run[None, :], 0), 1, SUM_COMBINE)
                start = tl.reduce(tl.where(match, start_c[None, :], 0), 1, SUM_COMBINE)
                seg = tl.reduce(tl.where(match, seg_c[None, :], 0), 1, SUM_COMBINE)
                hit = tl.reduce(m64, 1, SUM_COMBINE) > 0
                tl.store(nidx_A_ptr + base + r, seg, mask=hit)
                tl.store(order_A_ptr + base + start + rank, r, mask=hit)
                run += tl.reduce(m64, 0, SUM_COMBINE)
            if cb == 0:
                seg_r = tl.load(
                    segmap_S_ptr + b * C + tl.maximum(cid, 0), mask=tm & (cid >= 0), other=-1
                )
                none = tm & (seg_r < 0)
                n64 = none.to(tl.int64)
                inv_rank = inv_run + tl.associative_scan(n64, 0, SUM_COMBINE) - 1
                tl.store(nidx_A_ptr + base + r, tl.full((BLOCK_T,), -1, tl.int64), mask=none)
                tl.store(order_A_ptr + base + inv_base + inv_rank, r, mask=none)
                inv_run += tl.reduce(n64, 0, SUM_COMBINE)


# --------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk ids, validity and the valid-chunk rows of both sides (device tensors, no N yet).

    The row groups are sized for every slot (N is known on the host only after the caller's
    readback of ``stats_5[4]``); :meth:`rows` slices them to N.

    Attributes:
        student_chunk_id_BT: int64 [B, T] shifted student ids, clamped to ``[-1, C)``.
        teacher_chunk_id_BU: int64 [B, U] shifted teacher ids, clamped.
        valid_BC: bool [B, C], :func:`~xtoken_core.losses.alignment.chunk_validity`.
        stats_5: int64 [5], raw ``(student min, max, teacher min, max)`` before the shift (min >
            max for no ids) and N, the valid-chunk count.
        nidx_2: per side int64 [R] valid-chunk index of each row (-1 = none).
        order_2: per side int64 [R] rows sorted by valid chunk, stable, rows of none last.
        offsets_2: per side int64 [S + 1], the first N + 1 entries are the chunk row offsets.
        sizes_2: per side fp32 [S], the first N entries are the chunk sizes.
    """

    student_chunk_id_BT: torch.Tensor
    teacher_chunk_id_BU: torch.Tensor
    valid_BC: torch.Tensor
    stats_5: torch.Tensor
    nidx_2: tuple[torch.Tensor, torch.Tensor]
    order_2: tuple[torch.Tensor, torch.Tensor]
    offsets_2: tuple[torch.Tensor, torch.Tensor]
    sizes_2: tuple[torch.Tensor, torch.Tensor]

    def rows(self, side: int, num_valid: int | None) -> tuple[torch.Tensor, ...]:
        """One side's ``(nidx_R, order_R, offsets_N1, sizes_N)`` for N valid chunks.

        Args:
            side: 0 student, 1 teacher.
            num_valid: N, read back from ``stats_5[4]``; None: every slot (S + 1 offsets, S
                sizes), of which only the first N (+ 1) are written, for kernels that read N
                on the device.

        Returns:
            The fields of :class:`xtoken_core.losses.alignment.ChunkRows`, in order.
        """
        if num_valid is None:
            return self.nidx_2[side], self.order_2[side], self.offsets_2[side], self.sizes_2[side]
        return (
            self.nidx_2[side],
            self.order_2[side],
            self.offsets_2[side][: num_valid + 1],
            self.sizes_2[side][:num_valid],
        )


def plan_chunks(
    student_chunk_id_BT: torch.Tensor,
    teacher_chunk_id_BU: torch.Tensor,
    pair_valid_BC: torch.Tensor,
    *,
    sample_mask_B: torch.Tensor | None = None,
    pair_is_correct_BC: torch.Tensor | None = None,
    exact_token_match_only: bool = False,
) -> ChunkPlan:
    """The chunk plan of one micro-batch and teacher, computed on the device (no host sync).

    Args:
        student_chunk_id_BT: [B, T] raw (unshifted) integer student chunk ids, -1 = none.
        teacher_chunk_id_BU: [B, U] raw teacher chunk ids.
        pair_valid_BC: [B, C] bool, C >= 1.
        sample_mask_B: [B] (0/False drops the sample) or None.
        pair_is_correct_BC: [B, C] bool, used with ``exact_token_match_only``.
        exact_token_match_only: keep only the chunks with ``pair_is_correct``.

    Returns:
        :class:`ChunkPlan` on the ids' device. Ids outside ``[-1, C)`` are clamped (the range
        is in ``stats_5`` for the caller's check).

    Raises:
        ValueError: ``exact_token_match_only`` without ``pair_is_correct_BC``.
    """
    if exact_token_match_only and pair_is_correct_BC is None:
        raise ValueError("exact_token_match_only=True needs alignment_pair_is_correct in the batch")
    B, T = student_chunk_id_BT.shape
    U = teacher_chunk_id_BU.shape[1]
    C = pair_valid_BC.shape[1]
    device = student_chunk_id_BT.device
    S, R_s, R_t = B * C, B * T, B * U
    raw_s = student_chunk_id_BT.contiguous()
    raw_t = teacher_chunk_id_BU.to(device).contiguous()
    # One int64 buffer for every integer output: shifted ids, nidx, order (A each), segmap (S),
    # offsets (2 x (S + 1)), rows before each sample (2 x (B + 1)), stats (5).
    A = R_s + R_t
    ints = torch.empty(3 * A + S + 2 * (S + 1) + 2 * (B + 1) + 5, dtype=torch.int64, device=device)
    shift_A, nidx_A, order_A, rest = ints.split([A, A, A, ints.numel() - 3 * A])
    segmap_S, offsets_2S1, vbefore_2B1, stats_5 = rest.split([S, 2 * (S + 1), 2 * (B + 1), 5])
    size_2S = torch.empty(2 * S, dtype=torch.int32, device=device)
    valid_BC = torch.empty((B, C), dtype=torch.bool, device=device)
    sizes_2S = torch.empty(2 * S, dtype=torch.float32, device=device)
    pair_valid_S = pair_valid_BC.to(device).reshape(-1).contiguous()
    sample = sample_mask_B.to(device).contiguous() if sample_mask_B is not None else pair_valid_S
    correct = (
        pair_is_correct_BC.to(device).reshape(-1).contiguous()
        if exact_token_match_only
        else pair_valid_S
    )
    _plan_slots_kernel[(1,)](
        raw_s,
        raw_t,
        pair_valid_S,
        sample,
        correct,
        shift_A,
        size_2S,
        segmap_S,
        valid_BC,
        offsets_2S1,
        sizes_2S,
        vbefore_2B1,
        stats_5,
        B,
        T,
        U,
        C,
        HAS_SAMPLE_MASK=sample_mask_B is not None,
        EXACT_ONLY=bool(exact_token_match_only),
        BLOCK=min(PLAN_CONFIG["block"], max(next_power_of_2(max(A, S)), 16)),
        num_warps=PLAN_CONFIG["warps"],
    )
    if B > 0 and max(T, U) > 0:
        block_c = min(PLAN_CONFIG["rows_block_c"], max(next_power_of_2(C), 16))
        block_t = min(PLAN_CONFIG["rows_block_t"], max(next_power_of_2(max(T, U)), 16))
        _plan_rows_kernel[(cdiv(C, block_c), B, 2)](
            shift_A,
            segmap_S,
            offsets_2S1,
            vbefore_2B1,
            nidx_A,
            order_A,
            B,
            T,
            U,
            C,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            num_warps=PLAN_CONFIG["rows_warps"],
        )
    nidx_s, nidx_t = nidx_A.split([R_s, R_t])
    order_s, order_t = order_A.split([R_s, R_t])
    shift_s, shift_t = shift_A.split([R_s, R_t])
    return ChunkPlan(
        student_chunk_id_BT=shift_s.view(B, T),
        teacher_chunk_id_BU=shift_t.view(B, U),
        valid_BC=valid_BC,
        stats_5=stats_5,
        nidx_2=(nidx_s, nidx_t),
        order_2=(order_s, order_t),
        offsets_2=tuple(offsets_2S1.split([S + 1, S + 1])),
        sizes_2=tuple(sizes_2S.split([S, S])),
    )
