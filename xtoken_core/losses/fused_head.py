"""The fused output layer + loss head: the student loss from the last hidden states and the output
weight, without ever holding the whole ``[B*T, V]`` logits.

The head walks blocks of student rows that hold whole chunks of every teacher
(:mod:`xtoken_core.losses.head_blocks`). Per block it computes the block's logits
``h @ W^T``, the block's share of the loss by the ordinary
:class:`~xtoken_core.losses.loss.CrossTokenizerLoss` (or the student CE alone) over the
micro-batch's *global* denominators, so that the shares sum to the loss of the whole micro-batch,
and, still inside the forward, the gradients: ``dz = d(share)/d(logits)`` by autograd, then
``dh = dz @ W`` and ``dW += dz^T @ h``; the block is freed before the next. The backward of
:class:`FusedHeadFunction` only scales the kept ``dh`` and ``dW`` by the incoming gradient.
This is the shape of Liger-Kernel's fused-linear losses and of Cut Cross-Entropy, which work on
one vocabulary; here the blocks follow the chunks of the cross-tokenizer losses.

What is global in a mode is made once over the micro-batch before the blocks:

* the valid-chunk and CE-token denominators (the local counts when the caller gives none);
* P-KL's ``vocab_topk`` teacher columns (the ids with the largest max-logit over the rows the
  ``topk_columns`` rule names): the column-wise max of those rows goes into every block as a
  filler teacher row, so each block picks the same columns (exact: a max is a selection);
* ``dynamic_scaling`` (``|ce| / |kd|`` of the whole micro-batch) does not split over blocks:
  the head runs it as one block (exact, without the memory saving).

Every other term is per chunk or per row. Rows whose logits reach no term (padding) are skipped.
The metrics are the loss's (with several teachers each one's own too), summed over the
blocks (each is already over a global denominator).

Shape:
    hidden ``[B, T, D]`` and weight ``[V, D]`` in, scalar loss out; gradients ``[B, T, D]`` and
    ``[V, D]`` in their inputs' dtypes. The logits of a block are ``[L + 1, V]`` in the matmul
    dtype (the autocast dtype under autocast, else the hidden states' dtype); ``dW`` is summed
    in fp32.

Legend (shape suffixes in this file):
    B batch, T student tokens, D hidden size, V student vocab, R flat student rows (B*T),
    L rows of a block, U teacher tokens, W teacher vocab (padded width), Q flat teacher rows
    (B*U), G teacher rows of a block.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from xtoken_core.losses.alignment import (
    alignment_from_batch,
    check_alignment_shapes,
    check_chunk_ids,
    shift_chunk_ids,
    valid_chunks,
)
from xtoken_core.losses.backends import student_ce
from xtoken_core.losses.checks import DeferredChecks, check_target_range, counted_targets
from xtoken_core.losses.head_blocks import RowBlock, plan_blocks
from xtoken_core.losses.loss import CrossTokenizerLoss, ce_token_count
from xtoken_core.ops.transfer import to_device

__all__ = ["DEFAULT_BLOCK_ROWS", "FusedHead", "FusedHeadFunction"]

logger = logging.getLogger(__name__)

#: Rows per block by default: a ``[4096, 151936]`` bf16 block of logits is 1.2 GB (as fast as 8,192
#: rows and 1.04-1.25x faster than 1,024 in the student-step benchmark, one H200).
DEFAULT_BLOCK_ROWS = 4096


class FusedHead:
    """The student's loss from hidden states and the output weight, one row block at a time.

    Usage (per micro-batch, like :class:`~xtoken_core.losses.loss.CrossTokenizerLoss`)::

        head = FusedHead(loss_fn)                          # loss_fn None: the student CE alone
        loss, metrics = head(hidden_BTD, lm_head.weight, teacher_logits, batch, **counts)
        loss.backward()                                    # dh, dW kept from the forward

    Args:
        loss_fn: the cross-tokenizer loss whose config and backends the blocks use; None: the
            student CE alone (``global_valid_tokens`` over the micro-batches of the step).
        block_rows: rows per block wanted (a block ends on the last chunk boundary at or below
            it; a chunk longer than that makes its block longer).

    Raises:
        ValueError: ``block_rows < 1``.
    """

    def __init__(self, loss_fn: CrossTokenizerLoss | None, block_rows: int = DEFAULT_BLOCK_ROWS):
        if block_rows < 1:
            raise ValueError(f"block_rows={block_rows} must be >= 1")
        self.loss_fn = loss_fn
        self.block_rows = block_rows

    @property
    def num_teachers(self) -> int:
        """Teachers of the loss (0 for the CE alone)."""
        return 0 if self.loss_fn is None else self.loss_fn.config.num_teachers

    def __call__(
        self,
        hidden_BTD: torch.Tensor,
        weight_VD: torch.Tensor,
        teacher_logits: torch.Tensor | Sequence[torch.Tensor] | None,
        batch: Mapping[str, Any],
        *,
        global_valid_chunks: torch.Tensor | float | Sequence[float] | None = None,
        global_valid_tokens: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch, equal to the loss of ``hidden @ weight^T``.

        Args:
            hidden_BTD: ``[B, T, D]`` last hidden states (gradient flows here).
            weight_VD: ``[V, D]`` output weight (gradient flows here; a tied embedding's
                weight is fine).
            teacher_logits: ``[B, U, W']`` or one per teacher (constants); None with no
                teacher.
            batch: the micro-batch fields of :meth:`CrossTokenizerLoss.__call__` (read on the
                host: a CPU batch costs no device sync).
            global_valid_chunks: as for :class:`CrossTokenizerLoss`; None: this micro-batch's.
            global_valid_tokens: as for :class:`CrossTokenizerLoss`; None: this micro-batch's.

        Returns:
            ``(loss, metrics)``: the scalar loss and the loss's detached metrics summed over
            the blocks.

        Raises:
            ValueError: shapes that do not fit, chunk ids out of range, and whatever
                :class:`CrossTokenizerLoss` refuses in a block.
        """
        if hidden_BTD.dim() != 3 or weight_VD.dim() != 2:
            raise ValueError(
                f"hidden is {tuple(hidden_BTD.shape)} and weight {tuple(weight_VD.shape)}; "
                "expected [B, T, D] and [V, D]"
            )
        if hidden_BTD.shape[-1] != weight_VD.shape[-1]:
            raise ValueError(
                f"hidden size {hidden_BTD.shape[-1]} differs from the weight's "
                f"{weight_VD.shape[-1]}; pass the output layer's [V, D] weight"
            )
        B, T, _ = hidden_BTD.shape
        teachers = self._teacher_list(teacher_logits)
        self._check_alignment(batch, B, T, teachers)
        self._check_targets(batch, weight_VD.shape[0])
        dtype = hidden_BTD.dtype
        if torch.is_autocast_enabled(hidden_BTD.device.type):
            dtype = torch.get_autocast_dtype(hidden_BTD.device.type)
        counts = self._counts(batch, global_valid_chunks, global_valid_tokens, hidden_BTD.device)
        one_block = self.loss_fn is not None and self.loss_fn.config.dynamic_scaling
        blocks = plan_blocks(batch, self.num_teachers, None if one_block else self.block_rows)
        fillers = self._fillers(batch, teachers, dtype)
        run = _Run(self, blocks, teachers, fillers, counts, dtype, hidden_BTD.device)
        loss = FusedHeadFunction.apply(hidden_BTD.reshape(B * T, -1), weight_VD, run)
        return loss, run.metrics

    # ------------------------------------------------------------------ before the blocks

    def _teacher_list(self, teacher_logits) -> list[torch.Tensor]:
        if self.loss_fn is None:
            return []
        if teacher_logits is None:
            raise ValueError("the loss needs teacher logits; pass them (or use the CE alone)")
        return self.loss_fn._teacher_logits(teacher_logits, dense=True)  # whole rows a block

    def _check_alignment(self, batch, B: int, T: int, teachers: list[torch.Tensor]) -> None:
        """The shape and id-range checks the blocks can no longer make (a split batch hides a
        wrong length or an id past the slots)."""
        if self.loss_fn is None:
            ids = batch.get("input_ids")
            if ids is None or tuple(ids.shape) != (B, T):
                shape = None if ids is None else tuple(ids.shape)
                raise ValueError(f"input_ids is {shape}, expected [{B}, {T}] like the hidden")
            return
        if "input_ids" not in batch and self.loss_fn.config.ce_weight > 0:
            raise ValueError(
                "batch has no input_ids but ce_weight > 0; add them or set ce_weight=0"
            )
        if not self.loss_fn.config.check_inputs:
            return
        for i, z_t in enumerate(teachers):
            alignment = alignment_from_batch(batch, i)
            if z_t.dim() != 3 or z_t.shape[0] != B:
                raise ValueError(f"teacher logits {i} are {tuple(z_t.shape)}, expected [{B}, U, W]")
            check_alignment_shapes(alignment, B, T, z_t.shape[1])
            C = alignment.max_chunks
            check_chunk_ids("alignment_student_chunk_id", alignment.student_chunk_id.cpu(), C)
            check_chunk_ids("alignment_teacher_chunk_id", alignment.teacher_chunk_id.cpu(), C)

    def _check_targets(self, batch, V: int) -> None:
        """The CE targets' range, on the host: the blocks' own check is read after the last
        block, and a backend that indexes with the ids unclamped (the reference) would fail
        first without naming them."""
        ids_BT = batch.get("input_ids")
        if self.loss_fn is None or not self.loss_fn.config.check_inputs or ids_BT is None:
            return
        counted_BT = counted_targets(
            ids_BT.shape, batch.get("token_mask"), batch.get("sample_mask"), ids_BT.device
        )
        targets = ids_BT[counted_BT]
        if targets.numel():
            check_target_range(int(targets.min()), int(targets.max()), V)

    def _counts(self, batch, global_valid_chunks, global_valid_tokens, device) -> dict:
        """The global denominators every block divides by: the caller's, or this micro-batch's
        own (what the loss takes when given none)."""
        if global_valid_tokens is None and "input_ids" not in batch:
            global_valid_tokens = 0.0  # no CE term (the loss refuses that when ce_weight > 0)
        if global_valid_tokens is None:
            global_valid_tokens = ce_token_count(batch, *batch["input_ids"].shape)
        counts = {"global_valid_tokens": to_device(torch.as_tensor(global_valid_tokens), device)}
        if self.loss_fn is not None:
            if global_valid_chunks is None:
                cfg = self.loss_fn.config
                global_valid_chunks = torch.stack(
                    [
                        valid_chunks(alignment_from_batch(batch, i), cfg, batch.get("sample_mask"))[
                            2
                        ]
                        .sum()
                        .float()
                        .cpu()
                        for i in range(cfg.num_teachers)
                    ]
                )
            counts["global_valid_chunks"] = to_device(torch.as_tensor(global_valid_chunks), device)
        return counts

    def _fillers(self, batch, teachers: list[torch.Tensor], dtype) -> list[torch.Tensor]:
        """Each teacher's filler row ``[W']``: P-KL with top-k columns, the column-wise max of
        the rows that pick the columns over the micro-batch; else zeros (never counted)."""
        fillers = []
        cfg = None if self.loss_fn is None else self.loss_fn.config
        for i, z_t in enumerate(teachers):
            W = cfg.teacher_vocab_size[i] or z_t.shape[-1]
            if not self.loss_fn.mode.picks_columns(W):
                fillers.append(z_t.new_zeros(z_t.shape[-1]))
                continue
            with torch.no_grad():
                z_BUW = z_t.detach()
                # rows with a (shifted) teacher chunk id pick; under "all" every row does
                rows_Q = shift_chunk_ids(alignment_from_batch(batch, i).teacher_chunk_id)
                rows_Q = to_device(rows_Q.reshape(-1), z_t.device)
                if cfg.topk_columns == "all":
                    rows_Q = torch.zeros_like(rows_Q)
                # the kernel where the loss's backend takes these logits, else a masked amax
                max_W = self.loss_fn.backend_for(z_BUW, [z_BUW]).column_max(z_BUW, rows_Q)
                # -inf only where no row picks (finite logits): no chunk counts, any row does
                max_W = torch.where(torch.isinf(max_W), torch.zeros_like(max_W), max_W)
                fillers.append(max_W.to(z_t.dtype))
        return fillers


class _Run:
    """One call's blocks and what each needs (the non-tensor argument of the Function)."""

    def __init__(self, head, blocks, teachers, fillers, counts, dtype, device) -> None:
        self.head = head
        # every block's index tensors on the device before the first block's kernels are queued,
        # through pinned memory (a copy from pageable host memory waits for every queued kernel)
        self.staged: list[_Staged] = [_stage(block, device) for block in blocks]
        self.teachers = teachers
        self.fillers = fillers
        self.counts = counts
        self.dtype = dtype
        self.metrics: dict[str, torch.Tensor] = {}
        # the blocks' input checks, read once after the last block (a read per block would make
        # the host wait for each block's kernels before it queues the next block's)
        loss_fn = head.loss_fn
        on = loss_fn is not None and loss_fn.config.check_inputs
        self.checks = _BlockChecks() if on else None

    def block_loss(self, logits_LV: torch.Tensor, staged: _Staged) -> torch.Tensor:
        """The block's share of the loss (its metrics added to :attr:`metrics`)."""
        batch = staged.batch
        loss_fn = self.head.loss_fn
        if loss_fn is None:
            nll, correct, _ = student_ce(logits_LV[None], batch["input_ids"], batch["token_mask"])
            denom = self.counts["global_valid_tokens"].to(torch.float32).clamp_min(1.0)
            loss = nll / denom
            metrics = {"loss": loss.detach(), "ce_loss": loss.detach(), "accuracy": correct / denom}
        else:
            teacher_blocks = [
                _teacher_block(z_t, fill_W, rows)
                for z_t, fill_W, rows in zip(
                    self.teachers, self.fillers, staged.teacher_rows, strict=True
                )
            ]
            loss, metrics = loss_fn(
                logits_LV[None], teacher_blocks, batch, **self.counts, checks=self.checks
            )
        for k, v in metrics.items():
            self.metrics[k] = v if k not in self.metrics else self.metrics[k] + v
        return loss


class _Staged(NamedTuple):
    """A block's index tensors and loss batch on the device."""

    rows_L: torch.Tensor
    teacher_rows: list[torch.Tensor]
    batch: dict[str, torch.Tensor]


def _stage(block: RowBlock, device: torch.device) -> _Staged:
    return _Staged(
        to_device(block.rows_L, device),
        [to_device(rows, device) for rows in block.teacher_rows],
        {k: to_device(v, device) for k, v in block.batch.items()},
    )


class _BlockChecks(DeferredChecks):
    """The blocks' input checks, held and read once after the last block; the CE targets are
    not queued per block (the head checked the whole micro-batch's on the host)."""

    def __init__(self) -> None:
        super().__init__(hold=True)

    def ce_targets(self, input_ids_BT, token_mask_BT, sample_mask_B, V: int) -> None:
        return None


def _teacher_block(
    z_BUW: torch.Tensor, fill_W: torch.Tensor, rows_G2: torch.Tensor
) -> torch.Tensor:
    """``[1, G + 2, W']`` teacher logits of a block: the filler row, the block's rows, the filler
    row (``rows_G2`` marks the fillers with -1). The rows are gathered straight into the
    result's inner rows: one copy of the block's teacher logits, not a gather and a concatenation."""
    z_QW = z_BUW.detach().reshape(-1, z_BUW.shape[-1])
    block_GW = z_QW.new_empty(rows_G2.shape[0], z_QW.shape[1])
    torch.index_select(z_QW, 0, rows_G2[1:-1], out=block_GW[1:-1])
    block_GW[0] = fill_W
    block_GW[-1] = fill_W
    return block_GW[None]


def _block_logits(h_LD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """``[L + 1, V]``: ``h_L @ W^T`` and the filler row's logits (a zero hidden state's: zeros).
    The matmul runs on the block's ``L`` rows alone, written into the first rows of the result
    (at L = 4,096 on an H200, cuBLAS took 1.09x as long for L + 1 rows)."""
    L = h_LD.shape[0]
    logits_LV = h_LD.new_empty(L + 1, w_VD.shape[0])
    torch.mm(h_LD, w_VD.t(), out=logits_LV[:L])
    logits_LV[L].zero_()
    return logits_LV


def _add_outer(acc_VD: torch.Tensor, dz_LV: torch.Tensor, h_LD: torch.Tensor) -> None:
    """``acc += dz^T @ h`` in place. On a cuda device with half-precision blocks the matmul adds
    into the fp32 sum itself (cuBLAS with an fp32 output), so no ``[V, D]`` product is written in
    half precision and read back for the add; elsewhere the product, then the add."""
    if acc_VD.is_cuda and acc_VD.dtype == torch.float32 and dz_LV.dtype != torch.float32:
        torch.addmm(acc_VD, dz_LV.t(), h_LD, out_dtype=torch.float32, out=acc_VD)
    else:
        acc_VD.add_(dz_LV.t() @ h_LD)


class FusedHeadFunction(torch.autograd.Function):
    """``loss(hidden @ weight^T)`` with the gradients made block by block in the forward.

    Forward: per block ``z = h_L @ W^T`` (one filler row appended), the block's loss share,
    ``dz = d share / dz`` (autograd on the block alone), ``dh_L = dz @ W``, ``dW += dz^T @ h_L``
    (fp32); the block's logits are freed. Backward: ``(dh, dW) * grad_loss``, scaled in place
    (the graph is used once, as a training step uses it).
    """

    @staticmethod
    def forward(ctx: Any, hidden_RD: torch.Tensor, weight_VD: torch.Tensor, run: _Run):
        device = hidden_RD.device
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = run.dtype
        with torch.autocast(device.type, enabled=False):
            h_RD = hidden_RD.detach().to(dtype)
            w_VD = weight_VD.detach().to(dtype)
            d_hidden_RD = torch.zeros_like(hidden_RD) if need_h else None
            # fp32 sums (fp64 kept): the loss's dtype, and dW's over the blocks
            loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            d_weight_VD = (
                torch.zeros(w_VD.shape, dtype=loss_dtype, device=device) if need_w else None
            )
            total = torch.zeros((), dtype=loss_dtype, device=device)
            for staged in run.staged:
                rows_L = staged.rows_L
                h_LD = h_RD.index_select(0, rows_L)
                logits_LV = _block_logits(h_LD, w_VD).requires_grad_()
                with torch.enable_grad():
                    share = run.block_loss(logits_LV, staged)
                total = total + share.detach().to(loss_dtype)
                if not (need_h or need_w) or not share.requires_grad:
                    continue
                (dz_LV,) = torch.autograd.grad(share, logits_LV, allow_unused=True)
                del logits_LV, share
                if dz_LV is None:
                    continue
                dz_LV = dz_LV[:-1]  # the filler row's gradient is 0
                if need_h:
                    d_hidden_RD.index_copy_(0, rows_L, (dz_LV @ w_VD).to(hidden_RD.dtype))
                if need_w:
                    _add_outer(d_weight_VD, dz_LV, h_LD)
                del dz_LV
            if run.checks is not None:
                run.checks.finish()
        ctx.d_hidden = d_hidden_RD
        ctx.d_weight = None if d_weight_VD is None else d_weight_VD.to(weight_VD.dtype)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor):
        d_hidden, d_weight = ctx.d_hidden, ctx.d_weight
        ctx.d_hidden = ctx.d_weight = None  # the kept gradients leave with this call
        if d_hidden is not None:
            d_hidden.mul_(grad_loss.to(d_hidden.dtype))
        if d_weight is not None:
            d_weight.mul_(grad_loss.to(d_weight.dtype))
        return d_hidden, d_weight, None
