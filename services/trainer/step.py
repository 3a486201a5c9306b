"""One optimizer step of the student over its micro-batches: forward, loss, backward, update."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from services.trainer.compile import mark_step
from services.trainer.student import Student
from xtoken_core.ops import transfer

logger = logging.getLogger(__name__)

# Legend: B samples, T student tokens, U teacher tokens, D hidden size, V student vocab,
# W teacher vocab (U_i, W_i: teacher i's).

# sync: the host at the step's boundary collectives (every rank's data and stop flags, the
# metrics' sum), waiting for the slowest rank; one rank only reads its metrics back
PHASES = ("data_wait", "sync", "teacher_wait", "forward", "loss", "backward", "optimizer")
# Slots of the per-step metric vector all-reduced over the DP group, per teacher of the loss (a
# loss of several teachers adds each one's own metrics): a fixed length, so that a rank without
# data in a step (it does not know the loss's metric names) joins the same reduce.
MAX_METRICS = 32


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a step.

    Attributes:
        keys: sample keys, in row order.
        batch: padded fields (``xtoken_core.data.sample.pad_samples``), on the CPU.
        teacher_logits: returns the ``[B, U, W']`` teacher logits, or a list of one
            ``[B, U_i, W_i']`` per teacher of a loss of several (blocks until the teachers are
            done; may raise to say the micro-batch must be dropped); None when the loss needs
            none.
        done: called after the micro-batch's backward was queued (releases its ring slot).
        context: the feed's bookkeeping (leases, request), opaque to the step.
        prefetch: called before the micro-batch's forward: starts moving the teacher logits to
            this GPU if they are ready elsewhere (a teacher on another GPU), or does nothing.
        on_device: ``batch``'s fields on the student's device, set by the step before it asks
            for the teacher logits (cached top-K targets are read from there: moved once, with
            the rest of the batch, and never waited for in the middle of the step).
    """

    keys: list[str]
    batch: dict[str, torch.Tensor]
    teacher_logits: Callable[[], torch.Tensor | list[torch.Tensor]] | None = None
    done: Callable[[], None] | None = None
    context: Any = None
    prefetch: Callable[[], None] | None = None
    on_device: dict[str, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """Real student tokens of the micro-batch."""
        return int(self.batch["input_lengths"].sum())


class StepResult:
    """What one optimizer step did (this rank's view; ``metrics`` are summed over DP ranks).

    The figures that come from the GPU (``metrics``, ``times``, ``skipped``) are read when first
    asked for: the step returns as soon as its work is queued, so the host can claim and queue
    the next step while the GPU finishes this one (the trainer writes a step's record after
    queuing the next). Reading them waits for this step's GPU work only.

    Attributes:
        step: the step number after this step.
        keys: sample keys this rank trained in the step.
        metrics: loss parts (global values), ``grad_norm``, ``lr``, ``tokens`` (all ranks).
        times: seconds per phase of :data:`PHASES` on this rank.
        skipped: True when the gradient was not finite and the update was skipped.
    """

    def __init__(
        self,
        step: int,
        keys: list[str],
        read: Callable[[], tuple[dict[str, float], dict[str, float], bool]],
    ) -> None:
        self.step = step
        self.keys = keys
        self._read: Callable[[], tuple] | None = read
        self._values: tuple[dict[str, float], dict[str, float], bool] | None = None

    @property
    def read(self) -> bool:
        """Whether the GPU figures were read already."""
        return self._values is not None

    def _get(self) -> tuple[dict[str, float], dict[str, float], bool]:
        if self._values is None:
            read, self._read = self._read, None
            self._values = read()
        return self._values

    @property
    def metrics(self) -> dict[str, float]:
        """Loss parts, ``grad_norm``, ``lr``, ``tokens`` (waits for the step's GPU work)."""
        return self._get()[0]

    @property
    def times(self) -> dict[str, float]:
        """Seconds per phase (waits for the step's GPU work)."""
        return self._get()[1]

    @property
    def skipped(self) -> bool:
        """Whether the update was skipped (waits for the step's GPU work)."""
        return self._get()[2]

    def __repr__(self) -> str:
        return f"StepResult(step={self.step}, keys={len(self.keys)}, read={self.read})"


class PhaseClock:
    """Seconds per phase of a step; on CUDA the GPU phases are timed by events read at its end.

    Args:
        device: the step's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # wall-clock time the step began (its data wait's start): the step records' ``started``,
        # whose differences are the steps' intervals however late each record is written
        self.started = time.time()
        self.host: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str, gpu: bool = False) -> Iterator[None]:
        """Time a phase (``gpu``: by CUDA events on a CUDA device, read in :meth:`seconds`); a
        profiler trace shows it as the range ``phase:<name>``."""
        with torch.profiler.record_function(f"phase:{name}"):
            if gpu and self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.events.append((name, start, end))
                return
            t0 = time.perf_counter()
            yield
            self.host[name] += time.perf_counter() - t0

    def seconds(self) -> dict[str, float]:
        """Seconds per phase (call after the step's host sync)."""
        out = dict(self.host)
        for name, start, end in self.events:  # after the step's sync: no extra wait
            out[name] += start.elapsed_time(end) / 1000.0
        return out


@dataclasses.dataclass(frozen=True)
class LossTeacher:
    """One teacher as the loss reads it.

    Attributes:
        projection: its projection file (student rows, this teacher's columns).
        vocab: its vocab size (the columns of its logits the loss reads).
        weight: the weight of its KD term.
        tokenizer: its tokenizer's name (named in a message).
        key: the setting that names its projection (``loss.projection``,
            ``extra_teachers[0].projection``), named in a message.
    """

    projection: str
    vocab: int
    weight: float = 1.0
    tokenizer: str = ""
    key: str = "loss.projection"


def build_loss(
    loss: Any,
    *,
    student_vocab: int,
    teachers: Sequence[LossTeacher],
    tokenizers: Sequence[Any] | None = None,
) -> Any:
    """The loss of the ``loss`` section with its teachers, after checking each teacher's
    projection file against the run.

    One teacher gives the loss of ``loss`` with its vocab and weight; several give it one
    projection, weight and vocab per teacher, in order (``loss`` names teacher 0's projection).

    Args:
        loss: the trainer's loss section (a ``CrossTokenizerLossConfig``), left as it is.
        student_vocab: the student model's vocab size (every projection's rows).
        teachers: the loss's teachers, teacher 0 first.
        tokenizers: the run's tokenizers, the student's then each teacher's; each file's
            recorded tokenizers must be its pair's and it must have usable rows
            (:func:`~xtoken_core.data.projection.check_projection_tokenizers`). None: only the
            vocab sizes are checked.

    Raises:
        ValueError: a projection built for other tokenizers or vocab sizes, or with no usable
            row (names the setting of that projection).
    """
    from xtoken_core.data.projection import check_projection_tokenizers, parse_projection_file
    from xtoken_core.losses import CrossTokenizerLoss
    from xtoken_core.models import check_vocab

    for i, teacher in enumerate(teachers):
        path = teacher.projection
        # teacher 0's file is "projection" as it always was; a further one names its key
        label = "projection" if i == 0 else teacher.key
        if tokenizers is not None:  # a trainer started by hand gets the check `xtoken run` does
            try:
                check_projection_tokenizers(path, tokenizers[0], tokenizers[1 + i])
            except ValueError as e:
                if i == 0:
                    raise
                raise type(e)(f"{teacher.key}: {e}") from None
        _, _, rows, cols = parse_projection_file(path)
        check_vocab(f"{label} {path!r} (student rows)", student_vocab, rows)
        if cols > teacher.vocab:
            raise ValueError(
                f"{label} {path!r} has {cols} teacher columns but the teacher vocab is "
                f"{teacher.vocab}: build it for this teacher tokenizer ({teacher.tokenizer!r}) "
                "with `xtoken projection build`"
            )
    if len(teachers) == 1:
        (only,) = teachers
        config = dataclasses.replace(
            loss, teacher_vocab_size=only.vocab, teacher_weights=(only.weight,)
        )
    else:
        config = dataclasses.replace(
            loss,
            projection=[t.projection for t in teachers],
            teacher_weights=[t.weight for t in teachers],
            teacher_vocab_size=[t.vocab for t in teachers],
        )
    return CrossTokenizerLoss(config)


class StudentStep:
    """One optimizer step of the student over this rank's micro-batches (docs/design.md, "The
    student step"); it builds nothing, the student made every choice of backend.

    The global denominators over every micro-batch of every rank (:meth:`count_valid`, one
    all-reduce), then per micro-batch the student forward, the teacher logits, the loss and its
    backward (gradients synchronized on the last micro-batch only), then gradient clipping, a
    non-finite check, AdamW and the schedule. A rank with no data in a step runs one empty
    micro-batch (zero loss) so the gradient all-reduce still meets every rank; under FSDP every
    rank runs as many micro-batches as the busiest one (empty ones to fill), since each forward
    and backward gathers the sharded parameters. Gradients are summed over ranks, never averaged:
    the loss is already divided by the global denominators.

    Args:
        student: the student.
        loss_fn: the distillation loss (:func:`build_loss`), or None: the student's CE alone.
        grad_clip: clip the global gradient norm to this (0: off).
    """

    def __init__(self, student: Student, loss_fn: Any, *, grad_clip: float = 0.0) -> None:
        self.student = student
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.head = None  # the fused output head: the output layer and the loss by blocks
        if student.lm_head is not None:
            from xtoken_core.losses import FusedHead

            self.head = FusedHead(loss_fn, student.fused_head_rows)
        self._skipped_steps = 0
        self._unread: StepResult | None = None  # the last step, its GPU figures not read yet
        self._metric_names: list[str] = []  # the loss's metrics, from the last step with data
        teachers = 1 if loss_fn is None else loss_fn.config.num_teachers
        self.metric_slots = MAX_METRICS * teachers

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped for a non-finite gradient (reads the last step's)."""
        self.settle()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.settle()
        self._skipped_steps = value

    def settle(self) -> None:
        """Read the last step's GPU figures (waits for its GPU work)."""
        if self._unread is not None:
            unread, self._unread = self._unread, None
            unread._get()

    def count_valid(self, micro_batches: Sequence[MicroBatch]) -> dict[str, torch.Tensor]:
        """Global denominators of a step (collective over the DP group), on this rank's device.

        Counted from the micro-batches' CPU fields: the host needs no value from the GPU, so the
        previous step's kernels still run while the next one is prepared."""
        from xtoken_core.data.packing import document_targets
        from xtoken_core.losses import dp_all_reduce_sum

        device = self.student.device
        if self.loss_fn is not None and micro_batches:
            batches = [document_targets(mb.batch) for mb in micro_batches]
            return self.loss_fn.count_valid(batches, device)
        counts = {}
        if self.loss_fn is not None:  # a rank without data joins the same all-reduces, in order
            n = self.loss_fn.config.num_teachers
            chunks = torch.zeros(n, dtype=torch.float32, device=device)
            counts["global_valid_chunks"] = dp_all_reduce_sum(chunks)
        tokens = torch.zeros((), dtype=torch.float32)
        for mb in micro_batches:
            b = document_targets(mb.batch)
            mask = b["token_mask"][:, 1:].bool() & b["sample_mask"].bool()[:, None]
            tokens += mask.sum()
        counts["global_valid_tokens"] = dp_all_reduce_sum(transfer.to_device(tokens, device))
        return counts

    def run(self, micro_batches: Sequence[MicroBatch], clock: Any = None) -> StepResult:
        """One optimizer step over this rank's micro-batches (collective over the DP group).

        Args:
            micro_batches: this rank's micro-batches (may be empty when the rank has no data).
            clock: a phase clock already holding this step's data wait (the trainer's), or None.

        Returns:
            The step result.
        """
        from xtoken_core.data.packing import document_targets

        student = self.student
        clock = clock or PhaseClock(student.device)
        # the padded fields go to the device once (the micro-batch steps read them there); the
        # counts come from the CPU fields. Packed rows: the loss sees no target across documents
        targets = [document_targets(mb.batch) for mb in micro_batches]
        batches = [self.to_device(b) for b in targets]
        counts = self.count_valid(micro_batches)
        counts = {k: v.to(student.device, non_blocking=True) for k, v in counts.items()}
        sums: dict[str, torch.Tensor] = {}
        # None: an empty micro-batch (no data on this rank, or fewer micro-batches than another
        # rank under FSDP, whose forwards and backwards are collectives)
        runs: list[MicroBatch | None] = list(micro_batches) or [None]
        runs += [None] * (student.micro_batches_per_rank(len(runs)) - len(runs))
        for i, mb in enumerate(runs):
            with student.gradient_sync(last=i == len(runs) - 1):
                if mb is None:
                    self._empty_backward()
                    continue
                batch = mb.on_device = batches[i]
                # with the fused head the forward stops at the hidden states; the output layer
                # runs in the loss phase, its backward too (the head makes dh and dW there)
                forward = student.forward if self.head is None else student.hidden
                if mb.prefetch is not None:
                    mb.prefetch()
                if student.cuda_graphs:
                    mark_step()
                with clock.phase("forward", gpu=True):
                    mask, position_ids = student.attention(batch, mb.batch["token_mask"])
                    out = forward(batch["input_ids"], mask, position_ids)
                teacher = None
                if mb.teacher_logits is not None:
                    with clock.phase("teacher_wait"):
                        teacher = mb.teacher_logits()
                with clock.phase("loss", gpu=True):
                    if self.head is None:
                        loss, metrics = self.loss(out, batch, counts, teacher)
                    else:
                        loss, metrics = self._head_loss(out, targets[i], counts, teacher)
                with clock.phase("backward", gpu=True):
                    (loss * student.loss_scale).backward()
                del out, teacher
                if mb.done is not None:
                    mb.done()
                for k, v in metrics.items():
                    # every figure is over the global denominators, so the step's value is the
                    # sum over micro-batches and ranks; the total chunk count is left out of the
                    # records (a loss of several teachers counts each one's, which stay)
                    if k != "num_valid_chunks":
                        sums[k] = sums.get(k, 0.0) + v.detach().float()
        lr = float(student.optimizer.param_groups[0]["lr"])  # this step's (the schedule moves on)
        with clock.phase("optimizer", gpu=True):
            finite_1, grad_norm = self._update()
        with clock.phase("sync"):
            read_metrics = self._reduce_metrics(sums, micro_batches, grad_norm, finite_1)
        self.settle()  # the step before's figures (long done): at most one step is unread
        student.step += 1
        student.compiles.after_step()
        step = student.step

        def read() -> tuple[dict[str, float], dict[str, float], bool]:
            metrics, finite = read_metrics()
            metrics["lr"] = lr
            if not finite:
                self._skipped_steps += 1
                logger.warning(
                    "[trainer] step %d: gradient norm is %s, update skipped (%d skipped so far)",
                    step,
                    metrics["grad_norm"],
                    self._skipped_steps,
                )
            return metrics, clock.seconds(), not finite

        result = StepResult(step, [k for mb in micro_batches for k in mb.keys], read)
        self._unread = result
        return result

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch's padded fields on the student's device, through pinned memory on a GPU:
        a copy from pageable memory would hold the host until the step before's kernels ran
        (``xtoken_core.ops.transfer``), idling the GPU while the host then queues this step."""
        return {k: transfer.to_device(v, self.student.device) for k, v in batch.items()}

    def loss(self, logits_BTV, batch, counts, teacher_logits) -> tuple[torch.Tensor, dict]:
        """A micro-batch's loss and metrics from the student's logits (the student's CE alone
        without a distillation loss)."""
        if self.loss_fn is None:
            from xtoken_core.losses import student_ce  # the row kernels on CUDA

            nll, correct, _ = student_ce(
                logits_BTV, batch["input_ids"], batch["token_mask"], batch["sample_mask"]
            )
            denom = counts["global_valid_tokens"].clamp_min(1.0)
            ce = nll / denom
            return ce, {"loss": ce.detach(), "ce_loss": ce.detach(), "accuracy": correct / denom}
        return self.loss_fn(logits_BTV, teacher_logits, batch, **counts)

    def _head_loss(self, hidden_BTD, batch, counts, teacher_logits) -> tuple[torch.Tensor, dict]:
        """The loss by the fused head (``batch``: the CPU fields, read on the host)."""
        with self.student.train_autocast():  # the output layer's matmul in the forward's dtype
            return self.head(
                hidden_BTD, self.student.lm_head.weight, teacher_logits, batch, **counts
            )

    def _empty_backward(self) -> None:
        student = self.student
        ids = student.pads(1, 2)
        if student.cuda_graphs:
            mark_step()
        logits = student.forward(ids, *student.filler_attention(ids))
        (logits.float().sum() * 0.0).backward()

    def _update(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The update (skipped where the gradient is not finite); returns ``(finite, norm)``,
        0-d tensors, without reading them on the host (the fused update decides on the GPU)."""
        student = self.student
        if student.master is not None:
            student.master.collect()
        params = [p for p in student.state_model.parameters() if p.grad is not None]
        clip = self.grad_clip or float("inf")
        optimizer = student.optimizer
        if student.clip_in_adamw:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            finite_1 = torch.isfinite(grad_norm)
            # the fused AdamW divides each gradient by grad_scale and skips the whole update
            # (state and step count included) where found_inf is set, as it does for GradScaler:
            # clipping and the finite check cost no pass over the gradients of their own and no
            # host sync before the update is queued
            coef = (clip / (grad_norm.float() + 1e-6)).clamp(max=1.0)
            # 0-d, as GradScaler's: the kernel takes the step counts back by found_inf
            grad_scale, found_inf = coef.reciprocal(), (~finite_1).float()
            if student.fused_update:  # the update and the bf16 copy in one pass
                student.master.update(optimizer, grad_scale=grad_scale, found_inf=found_inf)
            else:
                optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
                optimizer.step()
                student.publish()  # unchanged masters where the update was skipped
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            finite_1 = torch.isfinite(grad_norm)
            if bool(finite_1):  # a host sync per step (FSDP's sharded norm)
                optimizer.step()
                student.publish()
        student.zero_grads()
        student.scheduler.step()
        return finite_1.detach(), grad_norm.detach()

    def _reduce_metrics(
        self, sums, micro_batches, grad_norm: torch.Tensor, finite_1: torch.Tensor
    ) -> Callable[[], tuple[dict[str, float], bool]]:
        """Sum the step's metrics over the DP group (on the device, no host wait) and queue
        their copy to the host; returns the function that reads ``(metrics, finite)``."""
        from xtoken_core.kernels._utils import read_later
        from xtoken_core.losses import dp_all_reduce_sum

        if sums:
            self._metric_names = sorted(sums)
        names = self._metric_names
        slots = self.metric_slots
        assert len(sums) <= slots, f"{len(sums)} loss metrics > {slots} slots (MAX_METRICS)"
        device = self.student.device
        device = device if device.type == "cuda" else torch.device("cpu")
        vec = torch.zeros(slots + 2, dtype=torch.float32, device=device)  # no data: zeros
        if sums:
            vec[: len(sums)] = torch.stack(
                [sums[n].to(device, torch.float32) for n in sorted(sums)]
            )
        counts = [float(sum(mb.num_tokens for mb in micro_batches)), float(len(micro_batches))]
        vec[-2:] = transfer.to_device(torch.tensor(counts, dtype=torch.float32), device)
        if self.student.world_size > 1:
            vec = dp_all_reduce_sum(vec)
        # the norm and the finite flag are the same on every rank (summed gradients): not summed
        read = read_later(vec, grad_norm.float().reshape(1), finite_1.float().reshape(1))

        def values() -> tuple[dict[str, float], bool]:
            got = read()
            out = {n: float(got[i]) for i, n in enumerate(names)}
            out["tokens"] = float(got[slots])
            out["micro_batches"] = float(got[slots + 1])
            out["grad_norm"] = float(got[slots + 2])
            return out, bool(got[slots + 3])

        return values
