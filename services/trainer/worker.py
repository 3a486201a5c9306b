"""Trainer worker logic: the student, its optimizer and schedule, the loss, and one optimizer step.

``TrainerWorker`` is built and tested without sockets: a step takes micro-batches that already
hold their padded fields and a way to get their teacher logits (main.py's feed fills those from
the queue and the logit ring). Data parallel needs an initialized process group (the shell's);
with one process the worker runs as is.

One step (docs/design.md, "The student step"): the global denominators over every micro-batch of every rank
(``count_valid``, one all-reduce), then per micro-batch the student forward, the teacher logits,
the loss and its backward (gradients synchronized on the last micro-batch only), then gradient
clipping, a non-finite check, AdamW and the schedule. A rank with no data in a step runs one
empty micro-batch (zero loss) so the gradient all-reduce still meets every rank; under FSDP every
rank runs as many micro-batches as the busiest one (empty ones to fill), since each forward and
backward gathers the sharded parameters. Gradients are summed over ranks, never averaged: the
loss is already divided by the global denominators.

Legend: B samples, T student tokens, U teacher tokens, V student vocab, W teacher vocab.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from services.trainer.compile import (
    compile_student,
    compiled_graphs,
    compiled_kernels,
    decoder_layers,
    mark_step,
    uncompile,
    warm_lengths,
)
from services.trainer.config import TrainerConfig
from services.trainer.precision import MasterWeights, fp32_allreduce_hook, resolve_param_dtype
from xtoken_core.models.dtypes import resolve_dtype

logger = logging.getLogger(__name__)

# sync: the host at the step's boundary collectives (every rank's data and stop flags, the
# metrics' sum), waiting for the slowest rank; one rank only reads its metrics back
PHASES = ("data_wait", "sync", "teacher_wait", "forward", "loss", "backward", "optimizer")
# Slots of the per-step metric vector all-reduced over the DP group: a fixed length, so that a
# rank without data in a step (it does not know the loss's metric names) joins the same reduce.
MAX_METRICS = 32


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a step.

    Attributes:
        keys: sample keys, in row order.
        batch: padded fields (``xtoken_core.data.sample.pad_samples``), on the CPU.
        teacher_logits: returns ``[B, U, W']`` teacher logits (blocks until the teacher is done;
            may raise to say the micro-batch must be dropped); None when the loss needs none.
        done: called after the micro-batch's backward was queued (releases its ring slot).
        context: the feed's bookkeeping (leases, request), opaque to the worker.
        prefetch: called before the micro-batch's forward: starts moving the teacher logits to
            this GPU if they are ready elsewhere (a teacher on another GPU), or does nothing.
    """

    keys: list[str]
    batch: dict[str, torch.Tensor]
    teacher_logits: Callable[[], torch.Tensor] | None = None
    done: Callable[[], None] | None = None
    context: Any = None
    prefetch: Callable[[], None] | None = None

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


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then a cosine decay to ``min_lr_ratio`` at ``max_steps``.

    Args:
        warmup_steps: steps of the linear warmup.
        max_steps: last step of the decay (0: constant after warmup).
        min_lr_ratio: final multiplier.

    Returns:
        The multiplier of the base learning rate at a step.
    """

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if max_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class PhaseClock:
    """Seconds per phase of a step; on CUDA the GPU phases are timed by events read at its end.

    Args:
        device: the step's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str, gpu: bool = False) -> Iterator[None]:
        """Time a phase (``gpu``: by CUDA events on a CUDA device, read in :meth:`seconds`)."""
        if gpu and self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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


class TrainerWorker:
    """The student side of distillation.

    Args:
        config: the trainer settings.
        rank: data-parallel rank.
        world_size: data-parallel size (> 1 needs an initialized process group).
        device: this rank's device (default: ``config.device``).
        model: an already built student (tests); default ``load_model(config.student)``.

    Raises:
        ValueError: vocab mismatches between the student, its tokenizer and the projection.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        from xtoken_core.data.collator import resolve_pad_id
        from xtoken_core.models import check_vocab, load_model, model_vocab_size
        from xtoken_core.tokenizers import load_tokenizer

        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device or config.device)
        self.autocast_dtype = resolve_dtype(config.dtype, str(self.device))
        self.param_dtype = resolve_param_dtype(config.param_dtype, self.device)
        self.compiled = self.device.type == "cuda" if config.compile is None else config.compile
        student_tok = load_tokenizer(config.student_tokenizer)
        teacher_tok = load_tokenizer(config.teacher_tokenizer)
        self.student_pad_id = resolve_pad_id(student_tok)
        self.teacher_pad_id = resolve_pad_id(teacher_tok)
        self.student_tokenizer = student_tok
        torch.manual_seed(config.seed)
        if model is None:
            model = load_model(
                config.student,
                vocab_size=config.vocab_size or student_tok.vocab_size,
                dtype=torch.float32,
                device=self.device,
                seed=config.seed,
            )
        self.vocab = model_vocab_size(model)
        check_vocab(f"student model {config.student!r}", self.vocab, student_tok.vocab_size)
        self.loss_fn = None
        if config.loss.uses_teacher:
            self.loss_fn = self._build_loss(teacher_tok.vocab_size, (student_tok, teacher_tok))
        # the fp32 model: the optimizer's parameters (directly, or as the masters of a bf16
        # compute copy), the checkpoint, the eval and the export
        self.module = model.to(self.device).train()
        self.master: MasterWeights | None = None
        compute = self.module
        fsdp = world_size > 1 and config.parallel == "fsdp"  # FSDP2 casts by its own policy
        if self.param_dtype != torch.float32 and not fsdp:
            compute = copy.deepcopy(self.module).to(self.param_dtype)
            self.master = MasterWeights(self.module, compute, accumulate_in_hooks=world_size == 1)
        if config.pack:  # packed rows: document-boundary attention (compiled as such below)
            from xtoken_core.models.documents import packed_attention, use_packed_attention

            use_packed_attention(compute, packed_attention(config.packed_attention, self.device))
        if config.activation_checkpointing:
            _checkpoint_activations(compute)
        self.cuda_graphs = self._resolve_cuda_graphs()
        if self.compiled:
            self.compiled = compile_student(compute, cuda_graphs=self.cuda_graphs) > 0
        self.cuda_graphs = self.cuda_graphs and self.compiled
        self.compute = compute  # what the forward and backward run on
        self.head, self._backbone, self._lm_head = self._build_head(compute)
        self.model = self._parallelize(compute)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lr_lambda(config.optim.warmup_steps, config.max_steps, config.optim.min_lr_ratio),
        )
        self.step = 0
        self._skipped_steps = 0
        self._unread: StepResult | None = None  # the last step, its GPU figures not read yet
        self._metric_names: list[str] = []  # the loss's metrics, from the last step with data
        self.compile_s: float | None = None  # the start-up step's seconds (warm_up)
        self._graphs_warm: int | None = None  # Dynamo's graph count after the start-up step
        # Triton's kernel count after the first step (whose loss compiles the loss's kernels)
        self._kernels_warm: int | None = None

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

    # ------------------------------------------------------------------ set-up

    def _resolve_cuda_graphs(self) -> bool:
        """Whether the compiled layers replay as CUDA graphs (``trainer.cuda_graphs``; None: where
        they can run).

        A replay writes its outputs into buffers the next replay reuses, so a gradient must leave
        them before the next micro-batch: on one process the fp32 master weights' hooks take each
        one at once; under DDP autograd adds each into the reducer's bucket, which holds it for
        the run (:mod:`services.trainer.precision`). FSDP's gradients stay where autograd put
        them, and an fp32 model has no masters.
        Activation checkpointing recomputes a layer's forward inside the backward, which keeps a
        recorded graph's input alive where the recording saw it freed: Inductor's CUDA graph trees
        stop the run at the first replay ("graph recording observed an input tensor
        deallocate", pytorch/pytorch#154306).

        Raises:
            ValueError: ``cuda_graphs: true`` where it cannot run (names the setting to change).
        """
        if self.config.cuda_graphs is False:
            return False
        why = None
        if self.device.type != "cuda":
            why = f"the trainer runs on {self.device}, not a cuda device"
        elif not self.compiled:
            why = "trainer.compile is off"
        elif self.world_size > 1 and self.config.parallel != "ddp":
            why = f"parallel {self.config.parallel} (CUDA graphs need one process or ddp)"
        elif self.master is None:
            why = "the parameters are float32 (CUDA graphs need trainer.param_dtype bfloat16)"
        elif self.config.activation_checkpointing:
            why = (
                "trainer.activation_checkpointing is on (its recomputed forward breaks the replay)"
            )
        if why and self.config.cuda_graphs:
            raise ValueError(f"trainer.cuda_graphs: {why}; set trainer.cuda_graphs: false")
        return why is None

    def _build_loss(self, teacher_vocab: int, tokenizers: tuple[Any, Any] | None = None) -> Any:
        """The loss of ``config.loss`` after checking its projection file against the run.

        Args:
            teacher_vocab: the teacher tokenizer's vocab size.
            tokenizers: the run's ``(student, teacher)`` tokenizers; the file's recorded
                tokenizers must be these and it must have usable rows
                (:func:`~xtoken_core.data.projection.check_projection_tokenizers`). None: only
                the vocab sizes are checked.

        Raises:
            ValueError: a projection built for other tokenizers or vocab sizes, or with no
                usable row.
        """
        from xtoken_core.data.projection import check_projection_tokenizers, parse_projection_file
        from xtoken_core.losses import CrossTokenizerLoss
        from xtoken_core.models import check_vocab

        lc = self.config.loss
        if tokenizers is not None:  # a trainer started by hand gets the check `xtoken run` does
            check_projection_tokenizers(lc.projection, *tokenizers)
        _, _, rows, cols = parse_projection_file(lc.projection)
        check_vocab(f"projection {lc.projection!r} (student rows)", self.vocab, rows)
        teacher_width = self.config.teacher_vocab_size or teacher_vocab
        if cols > teacher_width:
            raise ValueError(
                f"projection {lc.projection!r} has {cols} teacher columns but the teacher vocab is "
                f"{teacher_width}: build it for this teacher tokenizer "
                f"({self.config.teacher_tokenizer!r}) with `xtoken projection build`"
            )
        return CrossTokenizerLoss(dataclasses.replace(lc, teacher_vocab_size=teacher_width))

    def _build_head(self, compute: torch.nn.Module) -> tuple[Any, Any, Any]:
        """``(head, backbone, lm_head)`` of the fused output head (``config.fused_head``), or
        Nones: the step then takes the model's logits.

        Raises:
            ValueError: ``fused_head: true`` where it cannot run (several processes, a model
                with no plain linear output layer).
        """
        from xtoken_core.losses.fused_head import FusedHead
        from xtoken_core.models import split_lm_head

        if not self.config.fused_head:
            return None, None, None
        why = None
        if self.world_size > 1:
            # DDP's reducer and FSDP's gathers run in the wrapped model's forward, which the
            # backbone-only forward bypasses
            why = f"it runs in one process (this run has {self.world_size})"
        else:
            try:
                backbone, lm_head = split_lm_head(compute)
            except ValueError as e:
                backbone, lm_head, why = None, None, str(e)
            if lm_head is not None and getattr(lm_head, "bias", None) is not None:
                why = "the student's output layer has a bias"
        if why is not None:
            raise ValueError(f"fused_head: {why}; set trainer.fused_head: false")
        return FusedHead(self.loss_fn), backbone, lm_head

    @property
    def state_model(self) -> torch.nn.Module:
        """The model whose parameters the optimizer steps (the checkpoint's model)."""
        return self.module if self.master is not None else self.model

    def publish(self) -> None:
        """Copy the fp32 masters into the compute copy (after a checkpoint was loaded)."""
        if self.master is not None:
            self.master.publish()

    def _parallelize(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.world_size == 1:
            return module
        if self.config.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # the mesh of the trainer's device: without one FSDP2 shards onto CUDA whenever the
            # machine has it, also for a CPU trainer (its logits then land on another device)
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            # sharded fp32 parameters, gathered in the compute dtype, gradients reduced in fp32
            policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
            if self.param_dtype == torch.float32:
                policy = MixedPrecisionPolicy()
            sharded = [
                fully_shard(layer, mesh=mesh, mp_policy=policy) for layer in decoder_layers(module)
            ]
            sharded.append(fully_shard(module, mesh=mesh, mp_policy=policy))
            for m in sharded:  # per FSDP module: these setters do not recurse
                # the loss is already divided by the global denominators: the ranks' gradients
                # must be summed, where FSDP2 averages them by default (gradients, their norm and
                # so the clipping 1/world_size off); a plain SUM, not the PREMUL_SUM(1) that a
                # factor alone picks, which only NCCL has
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        if self.master is not None:  # the bf16 gradients: views of the buckets for the run
            self.master.hold_grads()
        ddp = DistributedDataParallel(
            module, device_ids=ids, gradient_as_bucket_view=self.master is not None
        )
        if self.master is not None and self.world_size > 2:
            # bf16 gradients summed in fp32 over the ranks; two ranks' sum is one bf16 addition
            # (rounded once), the number the fp32 sum rounds to, at half the bytes
            ddp.register_comm_hook(None, fp32_allreduce_hook)
        return ddp

    def _build_optimizer(self) -> torch.optim.Optimizer:
        oc = self.config.optim
        decay, no_decay = [], []
        for p in self.state_model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": oc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # clipping and the finite check inside the fused kernel (_optimizer_step), on the GPU and
        # the CPU alike; FSDP's gradients are sharded DTensors, clipped by clip_grad_norm_
        fsdp = self.world_size > 1 and self.config.parallel == "fsdp"
        self._clip_in_adamw = not fsdp
        fused = self.device.type == "cuda" or not fsdp
        return torch.optim.AdamW(
            groups, lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, fused=fused
        )

    # ------------------------------------------------------------------ batches

    def count_valid(self, micro_batches: Sequence[MicroBatch]) -> dict[str, torch.Tensor]:
        """Global denominators of a step (collective over the DP group), on this rank's device.

        Counted from the micro-batches' CPU fields: the host needs no value from the GPU, so the
        previous step's kernels still run while the next one is prepared."""
        from xtoken_core.data.packing import document_targets
        from xtoken_core.losses.utils import dp_all_reduce_sum

        if self.loss_fn is not None and micro_batches:
            batches = [document_targets(mb.batch) for mb in micro_batches]
            return self.loss_fn.count_valid(batches, self.device)
        counts = {}
        if self.loss_fn is not None:  # a rank without data joins the same all-reduces, in order
            n = self.loss_fn.config.num_teachers
            chunks = torch.zeros(n, dtype=torch.float32, device=self.device)
            counts["global_valid_chunks"] = dp_all_reduce_sum(chunks)
        tokens = torch.zeros((), dtype=torch.float32, device=self.device)
        for mb in micro_batches:
            b = document_targets(mb.batch)
            mask = b["token_mask"][:, 1:].bool() & b["sample_mask"].bool()[:, None]
            tokens += mask.sum().to(self.device)
        counts["global_valid_tokens"] = dp_all_reduce_sum(tokens)
        return counts

    # ------------------------------------------------------------------ step

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        if self.world_size == 1 or last:
            if self.config.parallel == "fsdp" and self.world_size > 1:
                self.model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.config.parallel == "fsdp":
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda" and self.autocast_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def _train_autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for the training forward: only over fp32 parameters (the eager baseline);
        bf16 parameters compute in bf16 without it."""
        if self.param_dtype != torch.float32:
            return contextlib.nullcontext()
        return self._autocast()

    def _forward(
        self, input_ids_BT: torch.Tensor, mask_BT: Any, position_ids_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The student's ``[B, T, V]`` logits (``mask_BT`` None: causal attention alone; packed
        rows: the document mask and the positions restarting per document)."""
        kwargs = {} if position_ids_BT is None else {"position_ids": position_ids_BT}
        with self._train_autocast():
            return self.model(
                input_ids=input_ids_BT, attention_mask=mask_BT, use_cache=False, **kwargs
            ).logits

    def _hidden(
        self, input_ids_BT: torch.Tensor, mask_BT: Any, position_ids_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The backbone's ``[B, T, D]`` last hidden states (the fused head's input)."""
        with self._train_autocast():
            return self._backbone(input_ids_BT, mask_BT, position_ids_BT)

    def _attention(self, batch: dict[str, torch.Tensor], cpu_mask_BT: torch.Tensor) -> tuple:
        """``(attention_mask, position_ids)`` of a micro-batch's forward.

        Packed rows: the document mask (:mod:`xtoken_core.models.documents`) and the positions
        restarting per document. Otherwise no positions, and no mask when every row is right
        padded: under causal attention no real token attends to a pad, so the fused causal
        kernels serve every such batch (one graph).
        """
        if "position_ids" in batch:
            from xtoken_core.models.documents import document_attention_mask

            position_ids_BT = batch["position_ids"].long()
            mask = document_attention_mask(
                self.compute.config, position_ids_BT, self._forward_dtype()
            )
            return mask, position_ids_BT
        if _is_prefix_mask(cpu_mask_BT):
            return None, None
        return batch["token_mask"].long(), None

    def _forward_dtype(self) -> torch.dtype:
        """The dtype the attention computes in (an additive mask's dtype)."""
        if self.param_dtype != torch.float32:
            return self.param_dtype
        return self.autocast_dtype if self.device.type == "cuda" else torch.float32

    # ------------------------------------------------------------------ start-up step

    def warm_up(self) -> float | None:
        """One forward and backward at ``micro_batch x max_length`` before training: compiles the
        student (once per run), and shows at start that a step's activations fit in memory.

        A student that ``torch.compile`` cannot handle runs eagerly, with one warning. CPU runs
        without compile skip it (the demo starts at once).

        Returns:
            Seconds the step took (compile included), or None when skipped.

        Raises:
            StartupOutOfMemory: the step does not fit the device (names the settings to lower).
        """
        if not (self.compiled or self.device.type == "cuda"):
            return None
        length = self.config.max_length or 128
        # the longest first (the memory check), then the shorter ones that need graphs of their
        # own (services/trainer/compile.py); eager needs the longest only
        lengths = warm_lengths(length) if self.compiled else [length]
        # CUDA graph trees run a function's first call in a length as a warm-up and record it at
        # the second: two steps per length, so that a run's first steps replay
        repeats = 2 if self.cuda_graphs else 1
        t0 = time.perf_counter()
        try:
            for n in lengths:
                for _ in range(repeats):
                    self._warm_step(self._pad_ids(n))
        except torch.OutOfMemoryError as e:
            raise self._out_of_memory(length) from e
        except Exception as e:  # Dynamo / Inductor failures have many types
            if is_allocation_failure(e):  # out of memory inside a library: not compile's fault
                raise self._out_of_memory(length) from e
            if not self.compiled:
                raise
            logger.warning(
                "[trainer] torch.compile failed on the student (%s: %s); training eagerly. Set "
                "trainer.compile: false to skip the attempt",
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            uncompile(self.compute)
            self.compiled = self.cuda_graphs = False
            self._zero_grads()
            try:
                self._warm_step(self._pad_ids(length))
            except torch.OutOfMemoryError as oom:
                raise self._out_of_memory(length) from oom
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_s = time.perf_counter() - t0
        self._graphs_warm = compiled_graphs()
        return self.compile_s

    def _pad_ids(self, length: int) -> torch.Tensor:
        shape = (self.config.micro_batch, length)
        return torch.full(shape, self.student_pad_id, dtype=torch.long, device=self.device)

    def _warm_attention(self, ids_BT: torch.Tensor) -> tuple:
        """``(attention_mask, position_ids)`` of a start-up (or empty) forward: none, or with
        ``pack`` two documents per row, so that the graphs built are those of packed rows."""
        if not self.config.pack:
            return None, None
        from xtoken_core.models.documents import document_attention_mask

        T = ids_BT.shape[1]
        half = T // 2
        positions_T = torch.cat([torch.arange(half), torch.arange(T - half)]).to(self.device)
        position_ids_BT = positions_T.expand(ids_BT.shape[0], T)
        mask = document_attention_mask(self.compute.config, position_ids_BT, self._forward_dtype())
        return mask, position_ids_BT

    def _warm_step(self, ids_BT: torch.Tensor) -> None:
        if self.cuda_graphs:
            mark_step()
        mask, position_ids = self._warm_attention(ids_BT)
        with self._sync(last=False):
            if self.head is not None:  # the head's blocks of logits, not the whole logits
                self._warm_head(ids_BT, mask, position_ids)
            else:
                logits_BTV = self._forward(ids_BT, mask, position_ids)
                (logits_BTV.sum() * 0.0).backward()
                del logits_BTV
        self._zero_grads()

    def _warm_head(self, ids_BT: torch.Tensor, mask: Any = None, position_ids: Any = None) -> None:
        """A forward and backward through the fused head (its student CE: no teacher at
        start-up), with the blocks and their gradients a step holds."""
        from xtoken_core.losses.fused_head import FusedHead

        hidden_BTD = self._hidden(ids_BT, mask, position_ids)
        ones_BT = torch.ones_like(ids_BT, dtype=torch.bool)
        batch = {"input_ids": ids_BT, "token_mask": ones_BT}
        head = FusedHead(None, self.head.block_rows)
        with self._train_autocast():
            loss, _ = head(hidden_BTD, self._lm_head.weight, None, batch)
        (loss * 0.0).backward()

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_grad()

    def _out_of_memory(self, length: int) -> StartupOutOfMemory:
        total = others = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            others = max(0, total - free - torch.cuda.memory_reserved(self.device))
        return StartupOutOfMemory(
            startup_oom_message(self.config.micro_batch, length, str(self.device), total, others)
        )

    def recompiles(self) -> int | None:
        """Graphs Dynamo compiled since the start-up step, and Triton kernels (the loss's)
        JIT-compiled since the first step, which compiles those the loss needs (None: the
        student is not compiled)."""
        if not self.compiled or self._graphs_warm is None:
            return None
        kernels = 0 if self._kernels_warm is None else compiled_kernels() - self._kernels_warm
        return compiled_graphs() - self._graphs_warm + kernels

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _head_loss(self, hidden_BTD, batch, counts, teacher_logits) -> tuple[torch.Tensor, dict]:
        """The loss by the fused head (``batch``: the CPU fields, read on the host)."""
        with self._train_autocast():  # the output layer's matmul in the forward's dtype
            return self.head(hidden_BTD, self._lm_head.weight, teacher_logits, batch, **counts)

    def _loss(self, logits_BTV, batch, counts, teacher_logits) -> tuple[torch.Tensor, dict]:
        if self.loss_fn is None:
            from xtoken_core.losses.fused import student_ce  # the row kernels on CUDA

            nll, correct, _ = student_ce(
                logits_BTV, batch["input_ids"], batch["token_mask"], batch["sample_mask"]
            )
            denom = counts["global_valid_tokens"].clamp_min(1.0)
            ce = nll / denom
            return ce, {"loss": ce.detach(), "ce_loss": ce.detach(), "accuracy": correct / denom}
        return self.loss_fn(logits_BTV, teacher_logits, batch, **counts)

    def train_step(self, micro_batches: Sequence[MicroBatch], clock: Any = None) -> StepResult:
        """One optimizer step over this rank's micro-batches (collective over the DP group).

        Args:
            micro_batches: this rank's micro-batches (may be empty when the rank has no data).
            clock: a phase clock already holding this step's data wait (main.py), or None.

        Returns:
            The step result.
        """
        from xtoken_core.data.packing import document_targets

        clock = clock or PhaseClock(self.device)
        # the padded fields go to the device once (the micro-batch steps read them there); the
        # counts come from the CPU fields. Packed rows: the loss sees no target across documents
        targets = [document_targets(mb.batch) for mb in micro_batches]
        batches = [self._to_device(b) for b in targets]
        counts = self.count_valid(micro_batches)
        counts = {k: v.to(self.device, non_blocking=True) for k, v in counts.items()}
        sums: dict[str, torch.Tensor] = {}
        # None: an empty micro-batch (no data on this rank, or fewer micro-batches than another
        # rank under FSDP, whose forwards and backwards are collectives)
        runs: list[MicroBatch | None] = list(micro_batches) or [None]
        runs += [None] * (self._micro_batches_per_rank(len(runs)) - len(runs))
        scale = float(self.world_size) if self.config.parallel == "ddp" else 1.0
        for i, mb in enumerate(runs):
            with self._sync(last=i == len(runs) - 1):
                if mb is None:
                    self._empty_backward()
                    continue
                batch = batches[i]
                # with the fused head the forward stops at the hidden states; the output layer
                # runs in the loss phase, its backward too (the head makes dh and dW there)
                forward = self._forward if self.head is None else self._hidden
                if mb.prefetch is not None:
                    mb.prefetch()
                if self.cuda_graphs:
                    mark_step()
                with clock.phase("forward", gpu=True):
                    mask, position_ids = self._attention(batch, mb.batch["token_mask"])
                    out = forward(batch["input_ids"], mask, position_ids)
                teacher = None
                if mb.teacher_logits is not None:
                    with clock.phase("teacher_wait"):
                        teacher = mb.teacher_logits()
                with clock.phase("loss", gpu=True):
                    if self.head is None:
                        loss, metrics = self._loss(out, batch, counts, teacher)
                    else:
                        loss, metrics = self._head_loss(out, targets[i], counts, teacher)
                with clock.phase("backward", gpu=True):
                    # DDP averages gradients over ranks; the loss is already divided by the
                    # global denominators, so scale back to a sum (FSDP sums: _parallelize)
                    (loss * scale).backward()
                del out, teacher
                if mb.done is not None:
                    mb.done()
                for k, v in metrics.items():
                    if k != "num_valid_chunks":
                        sums[k] = sums.get(k, 0.0) + v.detach().float()
        lr = float(self.optimizer.param_groups[0]["lr"])  # this step's (the schedule moves on)
        with clock.phase("optimizer", gpu=True):
            finite_1, grad_norm = self._optimizer_step()
        with clock.phase("sync"):
            read_metrics = self._reduce_metrics(sums, micro_batches, grad_norm, finite_1)
        self.settle()  # the step before's figures (long done): at most one step is unread
        self.step += 1
        if self._kernels_warm is None:
            self._kernels_warm = compiled_kernels()
        step = self.step

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

    def _micro_batches_per_rank(self, local: int) -> int:
        """Micro-batches this rank runs in the step: its own under DDP (only the last backward
        is collective); under FSDP the most of any rank (one all-reduce), since every forward
        and backward all-gathers the sharded parameters."""
        if self.world_size == 1 or self.config.parallel != "fsdp":
            return local
        import torch.distributed as dist

        n = torch.tensor(local, dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n)

    def _empty_backward(self) -> None:
        ids = torch.full((1, 2), self.student_pad_id, dtype=torch.long, device=self.device)
        if self.cuda_graphs:
            mark_step()
        logits = self._forward(ids, *self._warm_attention(ids))
        (logits.float().sum() * 0.0).backward()

    def _optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The update (skipped where the gradient is not finite); returns ``(finite, norm)``,
        0-d tensors, without reading them on the host (the fused update decides on the GPU)."""
        if self.master is not None:
            self.master.collect()
        params = [p for p in self.state_model.parameters() if p.grad is not None]
        clip = self.config.optim.grad_clip or float("inf")
        if self._clip_in_adamw:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            finite_1 = torch.isfinite(grad_norm)
            # the fused AdamW divides each gradient by grad_scale and skips the whole update
            # (state and step count included) where found_inf is set, as it does for GradScaler:
            # clipping and the finite check cost no pass over the gradients of their own and no
            # host sync before the update is queued
            coef = (clip / (grad_norm.float() + 1e-6)).clamp(max=1.0)
            # 0-d, as GradScaler's: the kernel takes the step counts back by found_inf
            self.optimizer.grad_scale = coef.reciprocal()
            self.optimizer.found_inf = (~finite_1).float()
            self.optimizer.step()
            if self.master is not None:
                self.master.publish()  # unchanged masters where the update was skipped
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            finite_1 = torch.isfinite(grad_norm)
            if bool(finite_1):  # a host sync per step (FSDP's sharded norm)
                self.optimizer.step()
                if self.master is not None:
                    self.master.publish()
        self._zero_grads()
        self.scheduler.step()
        return finite_1.detach(), grad_norm.detach()

    def _reduce_metrics(
        self, sums, micro_batches, grad_norm: torch.Tensor, finite_1: torch.Tensor
    ) -> Callable[[], tuple[dict[str, float], bool]]:
        """Sum the step's metrics over the DP group (on the device, no host wait) and queue
        their copy to the host; returns the function that reads ``(metrics, finite)``."""
        from xtoken_core.kernels._utils import read_later
        from xtoken_core.losses.utils import dp_all_reduce_sum

        if sums:
            self._metric_names = sorted(sums)
        names = self._metric_names
        assert len(sums) <= MAX_METRICS, f"{len(sums)} loss metrics > MAX_METRICS={MAX_METRICS}"
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        vec = torch.zeros(MAX_METRICS + 2, dtype=torch.float32, device=device)  # no data: zeros
        if sums:
            vec[: len(sums)] = torch.stack(
                [sums[n].to(device, torch.float32) for n in sorted(sums)]
            )
        counts = [float(sum(mb.num_tokens for mb in micro_batches)), float(len(micro_batches))]
        vec[-2:] = torch.tensor(counts, dtype=torch.float32).to(device, non_blocking=True)
        if self.world_size > 1:
            vec = dp_all_reduce_sum(vec)
        # the norm and the finite flag are the same on every rank (summed gradients): not summed
        read = read_later(vec, grad_norm.float().reshape(1), finite_1.float().reshape(1))

        def values() -> tuple[dict[str, float], bool]:
            got = read()
            out = {n: float(got[i]) for i, n in enumerate(names)}
            out["tokens"] = float(got[MAX_METRICS])
            out["micro_batches"] = float(got[MAX_METRICS + 1])
            out["grad_norm"] = float(got[MAX_METRICS + 2])
            return out, bool(got[MAX_METRICS + 3])

        return values

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate(self, texts: list[str]) -> dict[str, float]:
        """Held-out bits per byte of the student (``xtoken_core.models.eval``; collective under
        FSDP, where the eval calls the backbone and the output layer apart: the root's own
        parameters, embeddings and output layer, are gathered for the whole eval)."""
        from xtoken_core.models.eval import bits_per_byte

        sharded = self.world_size > 1 and self.config.parallel == "fsdp"
        if sharded:
            with torch.no_grad():  # FSDP initializes itself on the first forward of the root
                ids = torch.full((1, 1), self.student_pad_id, dtype=torch.long, device=self.device)
                self.model(input_ids=ids)
            self.model.unshard()
        self.module.eval()
        try:
            with self._autocast():
                return bits_per_byte(
                    self.module,
                    self.student_tokenizer,
                    texts,
                    ctx=self.config.eval_ctx,
                    device=self.device,
                )
        finally:
            self.module.train()
            if sharded:
                self.model.reshard()

    def export(self, out_dir: Any) -> None:
        """Export the student as a Hugging Face folder (collective under FSDP: the full weights
        are gathered on every rank; rank 0 writes)."""
        from xtoken_core.models import export_hf, load_model

        tokenizer = self.config.student_tokenizer
        if self.world_size > 1 and self.config.parallel == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if self.rank == 0:
                plain = load_model(
                    self.config.student, vocab_size=self.vocab, seed=self.config.seed
                )
                plain.load_state_dict(full)
                export_hf(plain, out_dir, tokenizer=tokenizer)
        elif self.rank == 0:
            export_hf(self.module, out_dir, tokenizer=tokenizer)
        if self.rank == 0:
            logger.info("[trainer] exported the student to %s", out_dir)


class StartupOutOfMemory(RuntimeError):
    """The student's start-up step ran out of device memory (the message names the fix)."""


# memory other processes may hold on the trainer's GPU before the message names them (this
# process's own CUDA context counts as "other" too: ~0.5 GiB)
OTHERS_NAMED_BYTES = 2 * 2**30


def startup_oom_message(
    micro_batch: int, length: int, device: str, total: int | None, others: int | None
) -> str:
    """What a start-up step that did not fit says: the settings to lower and, when other
    processes hold much of the GPU (a colocated teacher, rollout workers, another run), that.

    Args:
        total: the device's bytes (None: unknown).
        others: bytes neither free nor held by this process's allocator (None: unknown).
    """
    size = f" ({total / 2**30:.0f} GiB)" if total else ""
    text = (
        f"a student step of micro_batch={micro_batch} x {length} tokens does not fit in "
        f"{device}'s memory{size}: lower trainer.micro_batch, or set "
        "trainer.activation_checkpointing: true"
    )
    if others is not None and others >= OTHERS_NAMED_BYTES:
        text += (
            f"; other processes hold {others / 2**30:.1f} GiB of it (a teacher, rollout workers "
            "or another job on this GPU: nvidia-smi lists them), so giving them less or another "
            "GPU also helps"
        )
    return text


def is_allocation_failure(error: BaseException) -> bool:
    """An error that is the device running out of memory under another name (cuBLAS failing to
    create its handle, an allocator's message), anywhere in its chain of causes."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        text = str(error)
        if "CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text.lower():
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _is_prefix_mask(mask_BT: torch.Tensor) -> bool:
    """Whether every row of a ``[B, T]`` token mask is ones then zeros (right padding)."""
    lengths_B = mask_BT.sum(dim=1, keepdim=True)
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    return bool(torch.equal(mask_BT.bool(), positions_T < lengths_B))


def _checkpoint_activations(module: torch.nn.Module) -> None:
    """Recompute the decoder layers' activations in the backward (Hugging Face models).

    Raises:
        ValueError: the model has no gradient checkpointing (not a transformers model).
    """
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"activation_checkpointing: the student {type(module).__name__} supports no gradient "
            "checkpointing; set trainer.activation_checkpointing=false"
        )
    # non-reentrant: works under no_sync / FSDP and with inputs that need no grad
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.2x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
