"""The student as it trains: its model, precision, compile, data parallel and optimizer."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from services.trainer.compile import CompileCounts, compile_student, uncompile
from services.trainer.parallel import full_state_dict, gradient_sync, most_over_ranks, parallelize
from services.trainer.precision import MasterWeights, resolve_param_dtype
from services.trainer.sections import OptimConfig
from xtoken_core.models.dtypes import resolve_dtype

logger = logging.getLogger(__name__)

# Legend: B rows, T student tokens, D hidden size, V student vocab.


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


def resolve_cuda_graphs(
    setting: bool | None,
    *,
    device: torch.device,
    compiled: bool,
    parallel: str,
    world_size: int,
    masters: bool,
    activation_checkpointing: bool,
) -> bool:
    """Whether the compiled layers replay as CUDA graphs (``trainer.compute.cuda_graphs``; None:
    where they can run).

    A replay writes its outputs into buffers the next replay reuses, so a gradient must leave
    them before the next micro-batch: on one process the fp32 master weights' hooks take each
    one at once; under DDP autograd adds each into the reducer's bucket, which holds it for
    the run (:mod:`services.trainer.precision`). FSDP's gradients stay where autograd put
    them, and an fp32 model has no masters.
    Activation checkpointing recomputes a layer's forward inside the backward, which keeps a
    recorded graph's input alive where the recording saw it freed: Inductor's CUDA graph trees
    stop the run at the first replay ("graph recording observed an input tensor
    deallocate", pytorch/pytorch#154306).

    Args:
        setting: ``trainer.compute.cuda_graphs``.
        device: the trainer's device.
        compiled: whether the decoder layers are compiled.
        parallel, world_size: the data parallel of the run.
        masters: whether the parameters are low-precision copies of fp32 masters.
        activation_checkpointing: ``trainer.compute.activation_checkpointing``.

    Raises:
        ValueError: ``cuda_graphs: true`` where it cannot run (names the setting to change).
    """
    if setting is False:
        return False
    why = None
    if device.type != "cuda":
        why = f"the trainer runs on {device}, not a cuda device"
    elif not compiled:
        why = "trainer.compute.compile is off"
    elif world_size > 1 and parallel != "ddp":
        why = f"parallel {parallel} (CUDA graphs need one process or ddp)"
    elif not masters:
        why = "the parameters are float32 (CUDA graphs need trainer.compute.param_dtype bfloat16)"
    elif activation_checkpointing:
        why = (
            "trainer.compute.activation_checkpointing is on (its recomputed forward breaks the "
            "replay)"
        )
    if why and setting:
        raise ValueError(
            f"trainer.compute.cuda_graphs: {why}; set trainer.compute.cuda_graphs: false"
        )
    return why is None


class Student:
    """The student model as it trains: fp32 master weights (the optimizer's, the checkpoint's, the
    eval's and the export's), the copy the forward and backward run on (bf16, packed attention,
    activation checkpointing, compiled decoder layers, CUDA graphs), the data-parallel wrapper,
    AdamW and the learning-rate schedule, and the optimizer steps taken (``step``).

    Every choice of backend is made here, once (docs/design.md, "The student step"); the step
    (services/trainer/step.py) trusts it. Data parallel needs an initialized process group (the
    shell's); with one process the student runs as is.

    Args:
        spec: the student model (``xtoken_core.models.load_model``).
        tokenizer: the student tokenizer (pad id, eval, export).
        vocab_size: vocab of a preset student (default: the tokenizer's, rounded up to a multiple
            of 128: ``student_vocab_size``).
        seed: seed of the student's init.
        device: this rank's device.
        rank, world_size: data-parallel rank and size (> 1 needs an initialized process group).
        parallel: ``ddp``, or ``fsdp`` (fully_shard).
        dtype, param_dtype, compile, cuda_graphs, activation_checkpointing, fused_head,
            fused_head_rows, fused_update, pack, packed_attention: the trainer settings of the
            same names.
        optim: AdamW and its schedule.
        max_steps: the schedule's last step (0: constant after warmup).
        module: an already built student model (tests); default ``load_model(spec)``.

    Raises:
        ValueError: a vocab mismatch between the student and its tokenizer, a setting that cannot
            run here (names it).
    """

    def __init__(
        self,
        spec: str,
        tokenizer: str,
        *,
        vocab_size: int | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        parallel: str = "ddp",
        dtype: str = "auto",
        param_dtype: str = "auto",
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        activation_checkpointing: bool = False,
        fused_head: bool = False,
        fused_head_rows: int = 4096,
        fused_update: bool | None = None,
        pack: bool = False,
        packed_attention: str = "auto",
        optim: OptimConfig | None = None,
        max_steps: int = 0,
        module: torch.nn.Module | None = None,
    ) -> None:
        from xtoken_core.data.collator import resolve_pad_id
        from xtoken_core.models import check_vocab, load_model, model_vocab_size
        from xtoken_core.models.loading import student_vocab_size
        from xtoken_core.tokenizers import load_tokenizer

        optim = optim or OptimConfig()
        self.spec, self.tokenizer_spec, self.seed = spec, tokenizer, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.parallel = parallel
        self.sharded = world_size > 1 and parallel == "fsdp"  # FSDP2 casts by its own policy
        self.pack = pack
        self.autocast_dtype = resolve_dtype(dtype, str(self.device))
        self.param_dtype = resolve_param_dtype(param_dtype, self.device)
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.tokenizer = load_tokenizer(tokenizer)
        self.pad_id = resolve_pad_id(self.tokenizer)
        torch.manual_seed(seed)
        model = module
        if model is None:
            model = load_model(
                spec,
                vocab_size=vocab_size or student_vocab_size(spec, self.tokenizer.vocab_size),
                dtype=torch.float32,
                device=self.device,
                seed=seed,
            )
        self.vocab = model_vocab_size(model)
        check_vocab(f"student model {spec!r}", self.vocab, self.tokenizer.vocab_size)
        # the fp32 model: the optimizer's parameters (directly, or as the masters of a bf16
        # compute copy), the checkpoint, the eval and the export
        self.module = model.to(self.device).train()
        self.master: MasterWeights | None = None
        compute = self.module
        if self.param_dtype != torch.float32 and not self.sharded:
            compute = copy.deepcopy(self.module).to(self.param_dtype)
            self.master = MasterWeights(self.module, compute, accumulate_in_hooks=world_size == 1)
        if pack:  # packed rows: document-boundary attention (compiled as such below)
            from xtoken_core.models.documents import packed_attention as attention_of
            from xtoken_core.models.documents import use_packed_attention

            use_packed_attention(compute, attention_of(packed_attention, self.device))
        if activation_checkpointing:
            _checkpoint_activations(compute)
        self.cuda_graphs = resolve_cuda_graphs(
            cuda_graphs,
            device=self.device,
            compiled=self.compiled,
            parallel=parallel,
            world_size=world_size,
            masters=self.master is not None,
            activation_checkpointing=activation_checkpointing,
        )
        if self.compiled:
            self.compiled = compile_student(compute, cuda_graphs=self.cuda_graphs) > 0
        self.cuda_graphs = self.cuda_graphs and self.compiled
        self.compute = compute  # what the forward and backward run on
        # the fused output head's halves (the step's head runs the output layer), or Nones
        self.backbone, self.lm_head = (
            _split_head(compute, world_size) if fused_head else (None, None)
        )
        self.fused_head_rows = fused_head_rows
        self.model = parallelize(
            compute,
            parallel=parallel,
            world_size=world_size,
            device=self.device,
            param_dtype=self.param_dtype,
            master=self.master,
        )
        # DDP averages gradients over ranks; the loss is already divided by the global
        # denominators, so the step scales it back to a sum (FSDP sums: parallelize)
        self.loss_scale = float(world_size) if parallel == "ddp" else 1.0
        self.optimizer = self._build_optimizer(optim)
        if fused_update is None:  # where it can run: fp32 masters on a cuda device
            fused_update = self.master is not None and self.device.type == "cuda"
        if fused_update and self.master is None:
            raise ValueError(
                "fused_update: needs bf16 parameters with fp32 masters (param_dtype "
                f"{self.param_dtype}, parallel {parallel}; on cuda param_dtype auto is bf16); "
                "set trainer.compute.fused_update: false"
            )
        self.fused_update = fused_update
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(optim.warmup_steps, max_steps, optim.min_lr_ratio)
        )
        self.step = 0  # optimizer steps taken (the checkpoint's)
        self.compiles = CompileCounts()

    @property
    def state_model(self) -> torch.nn.Module:
        """The model whose parameters the optimizer steps (the checkpoint's model)."""
        return self.module if self.master is not None else self.model

    def publish(self) -> None:
        """Copy the fp32 masters into the compute copy (after an update, or a checkpoint load)."""
        if self.master is not None:
            self.master.publish()

    def zero_grads(self) -> None:
        """Drop the gradients of the parameters and of their masters."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_grad()

    def uncompile(self) -> None:
        """Run eagerly from now on (a compile that failed)."""
        uncompile(self.compute)
        self.compiled = self.cuda_graphs = False

    def recompiles(self) -> int | None:
        """Graphs Dynamo compiled since the start-up step, and Triton kernels (the loss's)
        JIT-compiled since the first step, which compiles those the loss needs (None: the
        student is not compiled)."""
        return self.compiles.since() if self.compiled else None

    def _build_optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for p in self.state_model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # clipping and the finite check inside the fused kernel (the step's update), on the GPU
        # and the CPU alike; FSDP's gradients are sharded DTensors, clipped by clip_grad_norm_
        self.clip_in_adamw = not self.sharded
        fused = self.device.type == "cuda" or not self.sharded
        return torch.optim.AdamW(
            groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused
        )

    # ------------------------------------------------------------------ data parallel

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's forward and backward: gradients are synchronized over
        the ranks on the step's last micro-batch only."""
        return gradient_sync(
            self.model, parallel=self.parallel, world_size=self.world_size, last=last
        )

    def micro_batches_per_rank(self, local: int) -> int:
        """Micro-batches this rank runs in a step: its own under DDP (only the last backward
        is collective); under FSDP the most of any rank (one all-reduce), since every forward
        and backward all-gathers the sharded parameters."""
        return most_over_ranks(local, self.device) if self.sharded else local

    # ------------------------------------------------------------------ forward

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype on CUDA (the eval's)."""
        if self.device.type == "cuda" and self.autocast_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def train_autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for the training forward: only over fp32 parameters (the eager baseline);
        bf16 parameters compute in bf16 without it."""
        if self.param_dtype != torch.float32:
            return contextlib.nullcontext()
        return self.autocast()

    def forward(
        self, input_ids_BT: torch.Tensor, mask_BT: Any, position_ids_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The student's ``[B, T, V]`` logits (``mask_BT`` None: causal attention alone; packed
        rows: the document mask and the positions restarting per document)."""
        kwargs = {} if position_ids_BT is None else {"position_ids": position_ids_BT}
        with self.train_autocast():
            return self.model(
                input_ids=input_ids_BT, attention_mask=mask_BT, use_cache=False, **kwargs
            ).logits

    def hidden(
        self, input_ids_BT: torch.Tensor, mask_BT: Any, position_ids_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The backbone's ``[B, T, D]`` last hidden states (the fused head's input)."""
        with self.train_autocast():
            return self.backbone(input_ids_BT, mask_BT, position_ids_BT)

    def attention(self, batch: dict[str, torch.Tensor], cpu_mask_BT: torch.Tensor) -> tuple:
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
                self.compute.config, position_ids_BT, self.forward_dtype()
            )
            return mask, position_ids_BT
        if is_prefix_mask(cpu_mask_BT):
            return None, None
        return batch["token_mask"].long(), None

    def filler_attention(self, ids_BT: torch.Tensor) -> tuple:
        """``(attention_mask, position_ids)`` of a forward of pads only (the start-up step, an
        empty micro-batch): none, or with ``pack`` two documents per row, so that the graphs
        built are those of packed rows."""
        if not self.pack:
            return None, None
        from xtoken_core.models.documents import document_attention_mask

        T = ids_BT.shape[1]
        half = T // 2
        positions_T = torch.cat([torch.arange(half), torch.arange(T - half)]).to(self.device)
        position_ids_BT = positions_T.expand(ids_BT.shape[0], T)
        mask = document_attention_mask(self.compute.config, position_ids_BT, self.forward_dtype())
        return mask, position_ids_BT

    def pads(self, rows: int, length: int) -> torch.Tensor:
        """``[rows, length]`` pad ids on the device (a forward of pads only)."""
        return torch.full((rows, length), self.pad_id, dtype=torch.long, device=self.device)

    def forward_dtype(self) -> torch.dtype:
        """The dtype the attention computes in (an additive mask's dtype)."""
        if self.param_dtype != torch.float32:
            return self.param_dtype
        return self.autocast_dtype if self.device.type == "cuda" else torch.float32

    # ------------------------------------------------------------------ eval and export

    @torch.no_grad()
    def evaluate(self, texts: list[str], ctx: int) -> dict[str, float]:
        """Held-out bits per byte of the student (``xtoken_core.models.eval``; collective under
        FSDP, where the eval calls the backbone and the output layer apart: the root's own
        parameters, embeddings and output layer, are gathered for the whole eval).

        A compiled student evaluates eagerly: the eval's windows come in every length, and each
        length range would compile an inference graph of its own (with CUDA graphs, record one
        too) that no training step uses; a run's recompile count stays that of its steps.

        Args:
            texts: the held-out texts.
            ctx: tokens per eval window.
        """
        from xtoken_core.models.eval import bits_per_byte

        with torch.compiler.set_stance("force_eager"):  # nothing to skip when not compiled
            if self.sharded:
                with torch.no_grad():  # FSDP initializes itself on the first forward of the root
                    self.model(input_ids=self.pads(1, 1))
                self.model.unshard()
            self.module.eval()
            try:
                with self.autocast():
                    return bits_per_byte(
                        self.module, self.tokenizer, texts, ctx=ctx, device=self.device
                    )
            finally:
                self.module.train()
                if self.sharded:
                    self.model.reshard()

    def export(self, out_dir: Any) -> None:
        """Export the student as a Hugging Face folder (collective under FSDP: the full weights
        are gathered on every rank; rank 0 writes)."""
        from xtoken_core.models import export_hf, load_model

        if self.sharded:
            full = full_state_dict(self.model)
            if self.rank == 0:
                plain = load_model(self.spec, vocab_size=self.vocab, seed=self.seed)
                plain.load_state_dict(full)
                export_hf(plain, out_dir, tokenizer=self.tokenizer_spec)
        elif self.rank == 0:
            export_hf(self.module, out_dir, tokenizer=self.tokenizer_spec)
        if self.rank == 0:
            logger.info("[trainer] exported the student to %s", out_dir)


def is_prefix_mask(mask_BT: torch.Tensor) -> bool:
    """Whether every row of a ``[B, T]`` token mask is ones then zeros (right padding)."""
    lengths_B = mask_BT.sum(dim=1, keepdim=True)
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    return bool(torch.equal(mask_BT.bool(), positions_T < lengths_B))


def _split_head(compute: torch.nn.Module, world_size: int) -> tuple[Any, Any]:
    """``(backbone, lm_head)`` of the fused output head (``trainer.compute.fused_head``): the
    forward runs the backbone, the step's head the output layer.

    Raises:
        ValueError: where it cannot run (several processes, a model with no plain linear output
            layer).
    """
    from xtoken_core.models import split_lm_head

    why = None
    if world_size > 1:
        # DDP's reducer and FSDP's gathers run in the wrapped model's forward, which the
        # backbone-only forward bypasses
        why = f"it runs in one process (this run has {world_size})"
    else:
        try:
            backbone, lm_head = split_lm_head(compute)
        except ValueError as e:
            backbone, lm_head, why = None, None, str(e)
        if lm_head is not None and getattr(lm_head, "bias", None) is not None:
            why = "the student's output layer has a bias"
    if why is not None:
        raise ValueError(f"fused_head: {why}; set trainer.compute.fused_head: false")
    return backbone, lm_head


def _checkpoint_activations(module: torch.nn.Module) -> None:
    """Recompute the decoder layers' activations in the backward (Hugging Face models).

    Raises:
        ValueError: the model has no gradient checkpointing (not a transformers model).
    """
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"activation_checkpointing: the student {type(module).__name__} supports no gradient "
            "checkpointing; set trainer.compute.activation_checkpointing=false"
        )
    # non-reentrant: works under no_sync / FSDP and with inputs that need no grad
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.2x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
