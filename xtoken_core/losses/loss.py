"""CrossTokenizerLoss: the public loss API. The loss builds its KD mode (the registry of
:mod:`xtoken_core.losses.modes`) and chooses its backend once, from ``backend`` and what the
machine has (:func:`~xtoken_core.losses.backends.choose_backend`: the reference, the Triton
kernels or the CPU path, one module each in :mod:`xtoken_core.losses.backends`). A call lets the
backend start on the student logits (the GPU then works while the host goes on), prepares the
inputs (shapes, teacher vocab, alignment, projection), asks the backend for the KD term and the
student CE, and combines the two (:func:`combine_losses`). A call whose logits the chosen backend
cannot take (fp64; CPU logits for the kernels without the interpreter) runs on the reference
backend.

Every metric returned is already divided by its *global* denominator (valid chunks or valid CE
tokens over all micro-batches and DP ranks), so metrics are additive: summing them over the
micro-batches of a step and over the DP ranks gives the step's value. ``num_valid_chunks`` is
the local count (summed the same way). ``kl_common`` (the common-vocab KL of gold, the KL of
P-KL) and ``l1_uncommon`` (the uncommon-vocab sorted L1 of gold, 0 for P-KL) are reported
after the ``T**2`` factor, as ``kl_loss`` is (NeMo RL reports them before it: divide by
``temperature**2`` to compare). With several teachers each one's own figures come too
(``teacher{i}_kl_loss`` and the rest: :func:`teacher_metric_keys`), unweighted and over that
teacher's own denominator.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab, C chunk slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from xtoken_core.data.projection import Projection, open_projection
from xtoken_core.losses.alignment import alignment_from_batch, check_alignment_shapes, valid_chunks
from xtoken_core.losses.backends import Backend, choose_backend
from xtoken_core.losses.backends.reference import ReferenceBackend, compute_dtype
from xtoken_core.losses.checks import DeferredChecks, counted_targets
from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.distributed import dp_all_reduce_sum
from xtoken_core.losses.inputs import TeacherInputs
from xtoken_core.losses.modes import MODES, KDMode
from xtoken_core.losses.sparse_teacher import SparseTeacher
from xtoken_core.ops.transfer import to_device

#: The metrics of every call. With several teachers the metrics also hold each teacher's own
#: (:func:`teacher_metric_keys`); ``kl_loss``, ``kl_common`` and ``l1_uncommon`` are then the
#: weighted sums of the teachers' (each over its own denominator), ``proj_accuracy`` and
#: ``num_valid_chunks`` their means over the teachers.
METRIC_KEYS = (
    "loss",
    "kl_loss",
    "ce_loss",
    "kl_common",
    "l1_uncommon",
    "proj_accuracy",
    "num_valid_chunks",
    "accuracy",
)

#: The figures each teacher has of its own with several teachers, named ``teacher{i}_<figure>``
#: (teacher 0 included): its KD term unweighted by its teacher weight (``kl_loss``) and its
#: ``kl_common``, ``l1_uncommon`` and ``proj_accuracy``, each divided by its own global
#: valid-chunk count, and its local ``num_valid_chunks`` (additive like :data:`METRIC_KEYS`).
TEACHER_METRICS = ("kl_loss", "kl_common", "l1_uncommon", "proj_accuracy", "num_valid_chunks")


def teacher_metric_keys(num_teachers: int) -> tuple[str, ...]:
    """The per-teacher metric keys a loss of ``num_teachers`` teachers returns besides
    :data:`METRIC_KEYS`.

    Args:
        num_teachers: the loss's teacher count.

    Returns:
        ``teacher{i}_<figure>`` for every teacher i and :data:`TEACHER_METRICS` figure, teacher
        by teacher (``teacher0_kl_loss``, ``teacher0_kl_common``, ..., ``teacher1_kl_loss``,
        ...); empty with one teacher (its figures are the totals).
    """
    if num_teachers < 2:
        return ()
    return tuple(f"teacher{i}_{name}" for i in range(num_teachers) for name in TEACHER_METRICS)


class CrossTokenizerLoss:
    """Cross-tokenizer KD loss (P-KL, gold or relaxed gold) plus the student CE.

    Usage per optimizer step::

        counts = loss_fn.count_valid(micro_batches)          # all-reduced over DP
        for mb in micro_batches:
            loss, metrics = loss_fn(student_logits, teacher_logits, mb, **counts)
            loss.backward()                                  # then SUM gradients over DP

    Args:
        config: a validated :class:`CrossTokenizerLossConfig` of a KD mode, with a projection.

    Raises:
        ValueError: ``mode: ce`` (no KD term: the student CE alone is
            :func:`~xtoken_core.losses.backends.student_ce`, or a
            :class:`~xtoken_core.losses.fused_head.FusedHead` without a loss), or no projection.

    Attributes:
        mode: the KD mode (:data:`~xtoken_core.losses.modes.MODES` of ``config.mode``).
        backend: the backend chosen at construction
            (:func:`~xtoken_core.losses.backends.choose_backend`).
        reference: the reference backend (``backend`` itself, or the fallback for calls whose
            logits ``backend`` cannot take).
    """

    def __init__(self, config: CrossTokenizerLossConfig) -> None:
        if not config.uses_teacher:
            raise ValueError(
                f"mode={config.mode!r} has no KD term: compute the student CE alone "
                "(xtoken_core.losses.student_ce, or FusedHead(None)), or set a KD mode "
                f"({', '.join(MODES)})"
            )
        if not config.projections:
            raise ValueError(
                "projection is required: a file path or an (indices, likelihoods) tensor pair"
            )
        self.config = config
        self.mode: KDMode = MODES[config.mode](config)
        self.reference = ReferenceBackend(config, self.mode)
        self.backend: Backend = choose_backend(config, self.mode, self.reference)
        self._projections: dict[tuple[int, torch.device], Projection] = {}
        self._fits: dict[tuple[int, torch.device], set[tuple[int, int]]] = {}

    def __call__(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | Sequence[torch.Tensor],
        batch: Mapping[str, Any],
        *,
        global_valid_chunks: torch.Tensor | float | Sequence[float] | None = None,
        global_valid_tokens: torch.Tensor | float | None = None,
        checks: DeferredChecks | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch.

        Args:
            student_logits: ``[B, T, V]`` (any float dtype; computed in fp32, fp64 kept).
            teacher_logits: ``[B, U, W']`` or one per teacher; columns past the teacher vocab
                (lm_head padding) are dropped. Treated as constants.
            batch: flat mapping with ``alignment_*`` keys (``teacher{i}_alignment_*`` overrides
                per teacher), and optionally ``input_ids`` (needed when ``ce_weight > 0``),
                ``token_mask`` [B, T], ``sample_mask`` [B].
            global_valid_chunks: valid-chunk count over the global batch (scalar or one per
                teacher, finite and >= this micro-batch's count: :meth:`count_valid`); None: this
                micro-batch's own count.
            global_valid_tokens: CE token count over the global batch; None: this micro-batch's.
            checks: a caller's ``DeferredChecks(hold=True)`` that takes this call's input checks
                (the caller reads them with its ``finish``: the fused head reads its blocks'
                once); None: the call's own, read before it returns. Unused with
                ``check_inputs`` off.

        Returns:
            ``(loss, metrics)``: scalar loss and detached scalar metrics (:data:`METRIC_KEYS`;
            with several teachers also :func:`teacher_metric_keys`).

        Raises:
            ValueError: shape mismatches, chunk ids out of range or not integer, a projection
                wider than the vocabularies, NaN/inf logits, missing batch keys, a
                ``global_valid_chunks`` that is not finite or below the local count.
        """
        cfg = self.config
        if student_logits.dim() != 3:
            raise ValueError(f"student_logits is {tuple(student_logits.shape)}, expected [B, T, V]")
        teacher_logits = self._teacher_logits(teacher_logits)
        backend = self.backend_for(student_logits, teacher_logits)
        if not cfg.check_inputs:
            checks = None
        elif checks is None:
            checks = DeferredChecks()
        started = backend.start(student_logits, checks)  # the GPU starts; the host prepares
        dtype = compute_dtype(student_logits)
        teachers = self._teachers(student_logits, teacher_logits, batch, global_valid_chunks)
        input_ids = self._ce_targets(student_logits, batch, checks)
        kd = backend.kd(student_logits, teachers, checks, started)
        ce, accuracy = self._ce(
            backend, started, student_logits, batch, input_ids, global_valid_tokens, dtype
        )
        if ce is None and not cfg.dynamic_scaling:  # no CE term: kl_weight * kd alone
            loss = kd.kd if cfg.kl_weight == 1.0 else cfg.kl_weight * kd.kd
        else:
            zero = student_logits.new_zeros((), dtype=dtype)
            loss = combine_losses(
                kd.kd,
                zero if ce is None else ce,
                kl_weight=cfg.kl_weight,
                ce_weight=cfg.ce_weight,
                dynamic_scaling=cfg.dynamic_scaling,
            )
        kl_common, l1_uncommon, proj_accuracy, num_valid = kd.metrics_4.unbind()
        no_ce = student_logits.new_zeros((), dtype=dtype)
        metrics = {
            "loss": loss.detach(),
            "kl_loss": kd.kd.detach(),
            "ce_loss": no_ce if ce is None else _detached(ce),
            "kl_common": _detached(kl_common),
            "l1_uncommon": _detached(l1_uncommon),
            "proj_accuracy": _detached(proj_accuracy),
            "num_valid_chunks": _detached(num_valid),
            "accuracy": no_ce if accuracy is None else _detached(accuracy),
        }
        if kd.teachers_N5 is not None:
            keys = teacher_metric_keys(cfg.num_teachers)
            metrics.update(zip(keys, _detached(kd.teachers_N5).reshape(-1).unbind(), strict=True))
        return loss, metrics

    def count_valid(
        self, batches: Sequence[Mapping[str, Any]], device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """First pass over a step's micro-batches: the global denominators.

        Needs only the alignment and masks (no logits). Collective: every DP rank must call it.

        Args:
            batches: the micro-batches this rank will run in the step (CPU batches count on the
                host, with no wait for the GPU).
            device: where the counts go for the all-reduce (NCCL reduces CUDA tensors only);
                None: the batches' device.

        Returns:
            ``{"global_valid_chunks": [num_teachers] float32, "global_valid_tokens": scalar
            float32}``, summed over the micro-batches and all-reduced over the DP group; pass
            them as keywords to ``__call__``.
        """
        chunks = torch.zeros(self.config.num_teachers, dtype=torch.float32)
        tokens = torch.zeros((), dtype=torch.float32)
        batch_device = None
        for batch in batches:
            for i in range(self.config.num_teachers):
                alignment = alignment_from_batch(batch, i)
                batch_device = alignment.student_chunk_id.device
                B, T = alignment.student_chunk_id.shape
                if self.config.check_inputs:
                    check_alignment_shapes(alignment, B, T, None)
                _, _, valid_BC = valid_chunks(alignment, self.config, batch.get("sample_mask"))
                chunks[i] += valid_BC.sum().float().cpu()
            tokens += ce_token_count(batch, B, T).cpu()
        device = device or batch_device
        if device is not None and device.type == "cuda":  # NCCL reduces CUDA tensors only
            # queued through pinned memory: a blocking copy would make the host wait for the
            # step before's kernels, and the GPU then idle while the host queues this step
            chunks, tokens = to_device(chunks, device), to_device(tokens, device)
        return {
            "global_valid_chunks": dp_all_reduce_sum(chunks),
            "global_valid_tokens": dp_all_reduce_sum(tokens),
        }

    def backend_for(
        self, student_logits: torch.Tensor, teacher_logits: Sequence[torch.Tensor]
    ) -> Backend:
        """The backend of this call: :attr:`backend`, or :attr:`reference` for logits it does
        not take (fp64 logits; the kernels: CPU logits without ``TRITON_INTERPRET=1``, or CPU
        logits under ``backend: auto``). The one place a call's logits are looked at: below
        it, the backend's code trusts the choice.

        Args:
            student_logits: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            :attr:`backend` or :attr:`reference`.
        """
        if self.backend.takes(student_logits, teacher_logits):
            return self.backend
        return self.reference

    # ----------------------------------------------------------------- input preparation

    def _teacher_logits(
        self,
        teacher_logits: torch.Tensor | SparseTeacher | Sequence[torch.Tensor | SparseTeacher],
        dense: bool = False,
    ) -> list[torch.Tensor | SparseTeacher]:
        """The teacher logits as a list, one per teacher (counted). Top-K targets
        (:class:`~xtoken_core.losses.sparse_teacher.SparseTeacher`) stay sparse where the mode
        reads them so (:meth:`reads_sparse`) and ``dense`` is off, else are decoded (bf16 on a
        GPU, fp32 on the CPU: ``xtoken_core.wire.topk.decode_dtype``)."""
        from xtoken_core.wire.topk import decode_dtype

        cfg = self.config
        logits = (
            list(teacher_logits) if isinstance(teacher_logits, list | tuple) else [teacher_logits]
        )
        if len(logits) != cfg.num_teachers:
            raise ValueError(
                f"got {len(logits)} teacher logits for {cfg.num_teachers} teachers "
                f"(teacher_weights={cfg.teacher_weights}); pass one per teacher"
            )
        for i, z_t in enumerate(logits):
            if isinstance(z_t, SparseTeacher):
                if dense or not self.reads_sparse(i, z_t.width):
                    logits[i] = z_t.dense(decode_dtype(z_t.device))
            elif not isinstance(z_t, torch.Tensor):
                raise ValueError(f"teacher logits {i} is a {type(z_t).__name__}, not a tensor")
        return logits

    def reads_sparse(self, i: int, width: int) -> bool:
        """Whether teacher ``i``'s top-K targets of ``width`` ids are read without their dense
        logits: P-KL's teacher side is made from them (:mod:`xtoken_core.losses.sparse_teacher`);
        gold's sorted tails read whole rows."""
        cfg = self.config
        return cfg.mode == "pkl" and (cfg.teacher_vocab_size[i] or width) == width

    def _teachers(
        self,
        student_logits: torch.Tensor,
        logits: list[torch.Tensor],
        batch: Mapping[str, Any],
        global_valid_chunks: torch.Tensor | float | Sequence[float] | None,
    ) -> list[TeacherInputs]:
        """Each teacher's logits (:meth:`_teacher_logits`) sliced to its vocab, alignment
        (shapes checked), projection and global valid-chunk count."""
        cfg = self.config
        B, T, V = student_logits.shape
        prepared = []
        for i, z_t in enumerate(logits):
            name = "teacher_logits" if cfg.num_teachers == 1 else f"teacher_logits[{i}]"
            if z_t.dim() != 3 or z_t.shape[0] != B:
                raise ValueError(f"{name} is {tuple(z_t.shape)}, expected [{B}, U, W]")
            W = cfg.teacher_vocab_size[i] or z_t.shape[-1]
            if z_t.shape[-1] < W:
                raise ValueError(
                    f"{name} has {z_t.shape[-1]} columns but teacher_vocab_size is {W}; fix "
                    "teacher_vocab_size"
                )
            alignment = alignment_from_batch(batch, i)
            if cfg.check_inputs:
                check_alignment_shapes(alignment, B, T, z_t.shape[1])
            projection = self._projection(i, V, W, student_logits.device)
            if not isinstance(z_t, SparseTeacher):  # targets are W wide (reads_sparse)
                z_t = z_t[..., :W]
            prepared.append((name, z_t, alignment, projection))
        dtype, device = compute_dtype(student_logits), student_logits.device
        denoms = self._chunk_denoms(global_valid_chunks, dtype, device)
        sample_mask = batch.get("sample_mask")
        return [
            TeacherInputs(
                index=i,
                name=name,
                logits_BUW=z_BUW,
                alignment=alignment,
                projection=projection,
                weight=cfg.teacher_weights[i],
                sample_mask_B=sample_mask,
                denominator_1=None if denoms is None else denoms[i : i + 1],
            )
            for i, (name, z_BUW, alignment, projection) in enumerate(prepared)
        ]

    def _projection(self, i: int, V: int, W: int, device: torch.device) -> Projection:
        """Teacher i's projection on ``device`` (loaded once), checked against the vocabularies."""
        key = (i, device)
        projection = self._projections.get(key)
        if projection is None:
            source = self.config.projections[i]
            if isinstance(source, tuple):
                projection = Projection.from_topk(*source, device)
            else:
                projection = open_projection(source, device)
            self._projections[key] = projection
        if (V, W) not in self._fits.setdefault(key, set()):
            projection.check_fits(V, W)
            self._fits[key].add((V, W))
        return projection

    def _chunk_denoms(self, global_valid_chunks, dtype, device) -> torch.Tensor | None:
        """``global_valid_chunks`` as one count per teacher on the device, or None."""
        if global_valid_chunks is None:
            return None
        n = self.config.num_teachers
        denoms = torch.as_tensor(global_valid_chunks, dtype=dtype, device=device).reshape(-1)
        if denoms.numel() == 1:
            denoms = denoms.expand(n)
        if denoms.numel() != n:
            raise ValueError(
                f"global_valid_chunks has {denoms.numel()} entries for {n} teachers; pass a "
                "scalar or one count per teacher"
            )
        return denoms

    def _ce_targets(
        self, student_logits: torch.Tensor, batch: Mapping[str, Any], checks: DeferredChecks | None
    ) -> torch.Tensor | None:
        """The CE targets (``input_ids``) after their shape checks, their range check queued."""
        B, T, V = student_logits.shape
        if "input_ids" not in batch:
            if self.config.ce_weight > 0:
                raise ValueError(
                    "batch has no input_ids but ce_weight > 0; add them or set ce_weight=0"
                )
            return None
        input_ids, token_mask = batch["input_ids"], batch.get("token_mask")
        if self.config.check_inputs:
            if tuple(input_ids.shape) != (B, T):
                raise ValueError(f"input_ids is {tuple(input_ids.shape)}, expected [{B}, {T}]")
            if token_mask is not None and tuple(token_mask.shape) != (B, T):
                raise ValueError(f"token_mask is {tuple(token_mask.shape)}, expected [{B}, {T}]")
        if checks is not None:
            checks.ce_targets(input_ids, token_mask, batch.get("sample_mask"), V)
        return input_ids

    def _ce(self, backend, started, student_logits, batch, input_ids, global_valid_tokens, dtype):
        """``(ce, accuracy)`` over the global token count, or ``(None, None)`` without targets;
        the sums by the backend's CE (``started``: what the backend's ``start`` returned)."""
        if input_ids is None:  # no CE tokens: both terms are 0 over any denominator
            return None, None
        device = student_logits.device
        token_mask, sample_mask = batch.get("token_mask"), batch.get("sample_mask")
        targets = (
            input_ids.to(device),
            None if token_mask is None else token_mask.to(device),
            None if sample_mask is None else sample_mask.to(device),
        )
        nll_sum, correct, n_tokens = backend.ce(student_logits, targets, started)
        if global_valid_tokens is not None:
            n_tokens = torch.as_tensor(global_valid_tokens, dtype=dtype, device=device)
        denom = n_tokens.to(dtype).clamp_min(1)
        return nll_sum.to(dtype) / denom, correct.to(dtype) / denom


def combine_losses(
    kd: torch.Tensor,
    ce: torch.Tensor,
    *,
    kl_weight: float,
    ce_weight: float,
    dynamic_scaling: bool,
) -> torch.Tensor:
    """Combine the (already normalized) KD and CE terms.

    Static: ``kl_weight * kd + ce_weight * ce``. Dynamic: ``kl_weight * s * kd + ce_weight * ce``
    with ``s = |ce| / |kd|`` detached (0 when ``kd`` is 0), so the KD term has the CE term's
    magnitude while keeping its own gradient direction.

    Args:
        kd: scalar KD term.
        ce: scalar CE term.
        kl_weight: weight of the KD term.
        ce_weight: weight of the CE term.
        dynamic_scaling: use the dynamic scale s.

    Returns:
        Scalar loss.
    """
    if not dynamic_scaling:
        return kl_weight * kd + ce_weight * ce
    kd_abs = kd.detach().abs()
    scale = torch.where(
        kd_abs > 0, ce.detach().abs() / kd_abs.clamp_min(1e-30), torch.zeros_like(kd_abs)
    )
    return kl_weight * scale * kd + ce_weight * ce


def ce_token_count(batch: Mapping[str, Any], B: int, T: int) -> torch.Tensor:
    """Positions the CE counts in a batch (the first token is never a target), on the token
    mask's device (the host without one)."""
    token_mask = batch.get("token_mask")
    device = None if token_mask is None else token_mask.device
    return counted_targets((B, T), token_mask, batch.get("sample_mask"), device).sum().float()


def _detached(x: torch.Tensor) -> torch.Tensor:
    """``x`` without autograd history (no new view when it has none: a dispatch per metric)."""
    return x.detach() if x.requires_grad or x.grad_fn is not None else x
