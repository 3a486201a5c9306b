"""CrossTokenizerLoss: the public loss API (input checks, projections, backends, global scaling).

Every metric returned is already divided by its *global* denominator (valid chunks or valid CE
tokens over all micro-batches and DP ranks), so metrics are additive: summing them over the
micro-batches of a step and over the DP ranks gives the step's value. ``num_valid_chunks`` is
the local count (summed the same way). ``kl_common`` (the common-vocab KL of gold, the KL of
P-KL) and ``l1_uncommon`` (the uncommon-vocab sorted L1 of gold, 0 for P-KL) are reported
after the ``T**2`` factor, as ``kl_loss`` is (NeMo RL reports them before it: divide by
``temperature**2`` to compare).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab, C chunk slots.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from xtoken_core.data.projection import Projection, open_projection
from xtoken_core.losses import fused, graphed, reference
from xtoken_core.losses.checks import DeferredChecks
from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.utils import (
    AlignmentView,
    alignment_from_batch,
    check_chunk_ids,
    dp_all_reduce_sum,
    shift_chunk_ids,
)

logger = logging.getLogger(__name__)

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


class CrossTokenizerLoss:
    """Cross-tokenizer KD loss (P-KL, gold or relaxed gold) plus the student CE.

    Usage per optimizer step::

        counts = loss_fn.count_valid(micro_batches)          # all-reduced over DP
        for mb in micro_batches:
            loss, metrics = loss_fn(student_logits, teacher_logits, mb, **counts)
            loss.backward()                                  # then SUM gradients over DP

    Args:
        config: a validated :class:`CrossTokenizerLossConfig`.
    """

    def __init__(self, config: CrossTokenizerLossConfig) -> None:
        self.config = config
        self._projections: dict[tuple[int, torch.device], Projection] = {}
        self._fits: dict[tuple[int, torch.device], set[tuple[int, int]]] = {}
        self._scales: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: graphed.GraphedPklPhase | None = None

    # ----------------------------------------------------------------- projections

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

    # ----------------------------------------------------------------- helpers

    def _metric_scales(
        self, weight: float, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coef_5, bias_5)`` with ``sums_5 * (coef_5 / denom + bias_5)`` the scaled sums of
        one teacher (cached per device: no host-to-device copy per call)."""
        key = (weight, dtype, device)
        if key not in self._scales:
            per_teacher = 1.0 / self.config.num_teachers
            self._scales[key] = (
                torch.tensor([weight] * 3 + [per_teacher, 0.0], dtype=dtype, device=device),
                torch.tensor([0.0] * 4 + [per_teacher], dtype=dtype, device=device),
            )
        return self._scales[key]

    def _graph_eligible(self, backend, student_logits: torch.Tensor, teachers) -> bool:
        """Whether this call's KD phase goes through :class:`graphed.GraphedPklPhase`."""
        cfg = self.config
        return (
            cfg.cuda_graphs
            and not cfg.gold_loss
            and backend is fused
            and student_logits.is_cuda
            and student_logits.dtype != torch.float64
            and graphed.graphs_enabled()
            and not torch.cuda.is_current_stream_capturing()
            and all(fused.fused_path_available(student_logits, z_t) for z_t in teachers)
        )

    def _graph_teacher(self, i, alignment, z_t, V: int, W: int, dtype, device):
        coef_5, bias_5 = self._metric_scales(self.config.teacher_weights[i], dtype, device)
        return graphed.PklTeacher(
            logits_BUW=z_t,
            student_chunk_id_BT=alignment.student_chunk_id,
            teacher_chunk_id_BU=alignment.teacher_chunk_id,
            pair_valid_BC=alignment.pair_valid,
            pair_is_correct_BC=alignment.pair_is_correct,
            tables=self._projection(i, V, W, device).kernel_tables(V, W),
            coef_5=coef_5,
            bias_5=bias_5,
        )

    def _graph_phase(self, student_logits, teachers, sample_mask, chunk_denoms, checks):
        """Run the graphed P-KL phase; queue its checks in the order of the eager path."""
        cfg = self.config
        if self._graphs is None:
            self._graphs = graphed.GraphedPklPhase(cfg.cuda_graph_cache)
        spec = graphed.PklSpec(
            temperature=float(cfg.temperature),
            vocab_topk=cfg.vocab_topk,
            reverse_kl=bool(cfg.reverse_kl),
            exact_token_match_only=bool(cfg.exact_token_match_only),
            topk_columns=cfg.topk_columns,
        )
        kd, metrics_4n, checks_X = self._graphs(
            spec, student_logits, teachers, sample_mask, chunk_denoms
        )
        if checks is not None:  # checks_X may be graph memory: start() copies it this call
            checks.finite("student_logits", student_logits, total=checks_X[0:1])
            for i, t in enumerate(teachers):
                name = "teacher_logits" if len(teachers) == 1 else f"teacher_logits[{i}]"
                at = 1 + 6 * i
                C = t.pair_valid_BC.shape[1]
                checks.finite(name, t.logits_BUW, total=checks_X[at : at + 1])
                checks.id_bounds("alignment_student_chunk_id", checks_X[at + 1 : at + 3], C)
                checks.id_bounds("alignment_teacher_chunk_id", checks_X[at + 3 : at + 5], C)
        return kd, metrics_4n

    @property
    def graph_stats(self) -> dict[str, Any] | None:
        """CUDA-graph counts of the P-KL phase (eager, captures, replays, evictions, disabled
        reason), or None before the first graph-eligible call."""
        return None if self._graphs is None else self._graphs.stats

    def _backend(self, device: torch.device):
        choice = self.config.backend
        if choice == "reference":
            return reference
        if choice == "kernel":
            return fused
        if device.type == "cuda" and fused.kernels_available():
            return fused
        return reference

    def _teacher_list(self, teacher_logits) -> list[torch.Tensor]:
        teachers = (
            list(teacher_logits) if isinstance(teacher_logits, list | tuple) else [teacher_logits]
        )
        if len(teachers) != self.config.num_teachers:
            raise ValueError(
                f"got {len(teachers)} teacher logits for {self.config.num_teachers} teachers "
                f"(teacher_weights={self.config.teacher_weights}); pass one per teacher"
            )
        return teachers

    def _check_alignment_shapes(
        self, alignment: AlignmentView, B: int, T: int, U: int | None
    ) -> None:
        """The cheap shape checks of one teacher's alignment against the logits."""
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

    def _valid_chunks(
        self,
        batch: Mapping[str, Any],
        alignment: AlignmentView,
        B: int,
        T: int,
        U: int | None,
        checks: DeferredChecks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shifted ids and the validity mask of one teacher, after the cheap shape checks.

        With ``checks`` the id-range check is queued there (and the ids clamped so that nothing
        indexes out of bounds before it runs); without, it syncs here.
        """
        C = alignment.max_chunks
        s_ids, t_ids = alignment.student_chunk_id, alignment.teacher_chunk_id
        if self.config.check_inputs:
            self._check_alignment_shapes(alignment, B, T, U)
            if checks is None:
                check_chunk_ids("alignment_student_chunk_id", s_ids, C)
                check_chunk_ids("alignment_teacher_chunk_id", t_ids, C)
            else:
                checks.id_range("alignment_student_chunk_id", s_ids, C)
                checks.id_range("alignment_teacher_chunk_id", t_ids, C)
                s_ids, t_ids = s_ids.clamp(-1, C - 1), t_ids.clamp(-1, C - 1)
        s_ids, t_ids = shift_chunk_ids(s_ids), shift_chunk_ids(t_ids)
        valid_BC = reference.chunk_validity(
            s_ids,
            t_ids,
            alignment.pair_valid,
            sample_mask_B=batch.get("sample_mask"),
            pair_is_correct_BC=alignment.pair_is_correct,
            exact_token_match_only=self.config.exact_token_match_only,
        )
        return s_ids, t_ids, valid_BC

    def _planned_chunks(
        self,
        batch: Mapping[str, Any],
        alignment: AlignmentView,
        B: int,
        T: int,
        U: int,
        device: torch.device,
        checks: DeferredChecks | None,
    ):
        """:meth:`_valid_chunks` for the fused path: one :func:`fused.plan_chunks` (two
        launches) gives the shifted ids, validity, N and both sides' rows; the id-range checks
        are queued from its device stats."""
        if self.config.check_inputs:
            self._check_alignment_shapes(alignment, B, T, U)
        sample_mask = batch.get("sample_mask")
        plan = fused.plan_chunks(
            alignment.student_chunk_id,
            alignment.teacher_chunk_id,
            alignment.pair_valid,
            sample_mask_B=sample_mask,
            pair_is_correct_BC=alignment.pair_is_correct,
            exact_token_match_only=self.config.exact_token_match_only,
            device=device,
        )
        if checks is not None:
            C = alignment.max_chunks
            checks.id_bounds("alignment_student_chunk_id", plan.stats_5[0:2], C)
            checks.id_bounds("alignment_teacher_chunk_id", plan.stats_5[2:4], C)
        return plan

    @staticmethod
    def _ce_token_count(batch: Mapping[str, Any], B: int, T: int) -> torch.Tensor:
        mask_BT = torch.ones(B, max(T - 1, 0), dtype=torch.bool)
        if batch.get("token_mask") is not None:
            mask_BT = batch["token_mask"][:, 1:].bool()
        if batch.get("sample_mask") is not None:
            mask_BT = mask_BT & batch["sample_mask"].bool().view(-1, 1).to(mask_BT.device)
        return mask_BT.sum().float()

    # ----------------------------------------------------------------- public API

    def count_valid(self, batches: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """First pass over a step's micro-batches: the global denominators.

        Needs only the alignment and masks (no logits). Collective: every DP rank must call it.

        Args:
            batches: the micro-batches this rank will run in the step.

        Returns:
            ``{"global_valid_chunks": [num_teachers] float32, "global_valid_tokens": scalar
            float32}``, summed over the micro-batches and all-reduced over the DP group; pass
            them as keywords to ``__call__``.
        """
        chunks = torch.zeros(self.config.num_teachers, dtype=torch.float32)
        tokens = torch.zeros((), dtype=torch.float32)
        device = None
        for batch in batches:
            for i in range(self.config.num_teachers):
                alignment = alignment_from_batch(batch, i)
                device = alignment.student_chunk_id.device
                B, T = alignment.student_chunk_id.shape
                _, _, valid_BC = self._valid_chunks(batch, alignment, B, T, None)
                chunks[i] += valid_BC.sum().float().cpu()
            tokens += self._ce_token_count(batch, B, T).cpu()
        if device is not None and device.type == "cuda":  # NCCL reduces CUDA tensors only
            chunks, tokens = chunks.to(device), tokens.to(device)
        return {
            "global_valid_chunks": dp_all_reduce_sum(chunks),
            "global_valid_tokens": dp_all_reduce_sum(tokens),
        }

    def __call__(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | Sequence[torch.Tensor],
        batch: Mapping[str, Any],
        *,
        global_valid_chunks: torch.Tensor | float | Sequence[float] | None = None,
        global_valid_tokens: torch.Tensor | float | None = None,
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

        Returns:
            ``(loss, metrics)``: scalar loss and detached scalar metrics (:data:`METRIC_KEYS`).

        Raises:
            ValueError: shape mismatches, chunk ids out of range or not integer, a projection
                wider than the vocabularies, NaN/inf logits, missing batch keys, a
                ``global_valid_chunks`` that is not finite or below the local count.
        """
        cfg = self.config
        teachers = self._teacher_list(teacher_logits)
        if student_logits.dim() != 3:
            raise ValueError(f"student_logits is {tuple(student_logits.shape)}, expected [B, T, V]")
        B, T, V = student_logits.shape
        device = student_logits.device
        checks = DeferredChecks() if cfg.check_inputs else None
        backend = self._backend(device)
        # P-KL on the fused path: the whole KD phase as one CUDA graph replay (graphed.py); it
        # computes the logits' check sums and the plan stats itself
        graph_teachers = [] if self._graph_eligible(backend, student_logits, teachers) else None
        if checks is not None and graph_teachers is None:
            checks.finite("student_logits", student_logits)
        dtype = reference.compute_dtype(student_logits)

        if global_valid_chunks is not None:
            chunk_denoms = torch.as_tensor(global_valid_chunks, dtype=dtype, device=device).reshape(
                -1
            )
            if chunk_denoms.numel() == 1:
                chunk_denoms = chunk_denoms.expand(cfg.num_teachers)
            if chunk_denoms.numel() != cfg.num_teachers:
                raise ValueError(
                    f"global_valid_chunks has {chunk_denoms.numel()} entries for "
                    f"{cfg.num_teachers} teachers; pass a scalar or one count per teacher"
                )
        # Phase 1: shapes, alignment and validity of every teacher; the value checks (finite
        # logits, chunk-id range, CE targets) and the valid-chunk counts are read back with one
        # host sync, before any kernel that relies on them (the fused P-KL kernels rely on none:
        # they index with clamped ids and take N on the device).
        prepared = []
        for i, z_t in enumerate(teachers):
            name = "teacher_logits" if cfg.num_teachers == 1 else f"teacher_logits[{i}]"
            if z_t.dim() != 3 or z_t.shape[0] != B:
                raise ValueError(f"{name} is {tuple(z_t.shape)}, expected [{B}, U, W]")
            W = cfg.teacher_vocab_size[i] or z_t.shape[-1]
            if z_t.shape[-1] < W:
                raise ValueError(
                    f"{name} has {z_t.shape[-1]} columns but teacher_vocab_size is {W}; fix "
                    "teacher_vocab_size"
                )
            z_t = z_t[..., :W]
            alignment = alignment_from_batch(batch, i)
            if graph_teachers is not None:
                if cfg.check_inputs:
                    self._check_alignment_shapes(alignment, B, T, z_t.shape[1])
                graph_teachers.append(self._graph_teacher(i, alignment, z_t, V, W, dtype, device))
                continue
            if checks is not None:
                checks.finite(name, z_t)
            plan = slot = None
            if backend is fused and fused.fused_path_available(student_logits, z_t):
                plan = self._planned_chunks(batch, alignment, B, T, z_t.shape[1], device, checks)
                s_ids, t_ids = plan.student_chunk_id_BT, plan.teacher_chunk_id_BU
                valid_BC = plan.valid_BC
                slot = checks.value(plan.stats_5[4:5]) if checks is not None else None
            else:
                s_ids, t_ids, valid_BC = self._valid_chunks(
                    batch, alignment, B, T, z_t.shape[1], checks
                )
                s_ids, t_ids, valid_BC = s_ids.to(device), t_ids.to(device), valid_BC.to(device)
                if checks is not None and backend is fused:
                    slot = checks.count(valid_BC)
            prepared.append((W, z_t, s_ids, t_ids, valid_BC, slot, plan))
        if checks is not None and global_valid_chunks is not None:
            for i in range(cfg.num_teachers):
                name = "global_valid_chunks" + ("" if cfg.num_teachers == 1 else f"[{i}]")
                local = None  # the graphed phase counts on the device: finite and >= 0 only
                if graph_teachers is None:
                    plan, valid_BC = prepared[i][-1], prepared[i][4]
                    local = valid_BC.sum() if plan is None else plan.stats_5[4:5]
                checks.denominator(name, chunk_denoms[i : i + 1], local)
        token_mask, sample_mask = batch.get("token_mask"), batch.get("sample_mask")
        graph_out = None
        if graph_teachers is not None:
            graph_out = self._graph_phase(
                student_logits,
                graph_teachers,
                sample_mask,
                None if global_valid_chunks is None else chunk_denoms,
                checks,
            )
        if "input_ids" in batch:
            input_ids = batch["input_ids"]
            if cfg.check_inputs and tuple(input_ids.shape) != (B, T):
                raise ValueError(f"input_ids is {tuple(input_ids.shape)}, expected [{B}, {T}]")
            if cfg.check_inputs and token_mask is not None and tuple(token_mask.shape) != (B, T):
                raise ValueError(f"token_mask is {tuple(token_mask.shape)}, expected [{B}, {T}]")
            if checks is not None:
                checks.ce_targets(input_ids, token_mask, sample_mask, V)
        elif cfg.ce_weight > 0:
            raise ValueError(
                "batch has no input_ids but ce_weight > 0; add them or set ce_weight=0"
            )
        # The fused P-KL path with a chunk plan keeps N on the device: its checks are read back
        # after the KD kernels are queued (they index only with clamped ids), so the host does
        # not wait for the GPU here; every other path reads them now.
        deferred = all(p[-1] is not None for p in prepared) and not cfg.gold_loss
        values = None
        if checks is not None:
            checks.start()
            if not deferred:
                values = checks.finish()

        # Phase 2: the KD terms.
        zero = student_logits.new_zeros((), dtype=dtype)
        kd, kl_common, l1_uncommon, proj_accuracy, num_valid = zero, zero, zero, zero, zero
        acc_5 = None
        if graph_out is not None:
            kd, metrics_4n = graph_out
            kl_common, l1_uncommon, proj_accuracy, num_valid = metrics_4n[:4].unbind()
        else:
            for i, (weight, (W, z_t, s_ids, t_ids, valid_BC, slot, plan)) in enumerate(
                zip(cfg.teacher_weights, prepared, strict=True)
            ):
                common = (student_logits, z_t, s_ids, t_ids, valid_BC)
                extra = {}
                if backend is fused and slot is not None and values is not None:
                    extra["num_valid"] = int(values[slot][0])
                if plan is not None:
                    extra["plan"] = plan
                projection = self._projection(i, V, W, device)
                if cfg.gold_loss:
                    exact = projection.exact_map(
                        W, xtoken_loss=cfg.xtoken_loss, student_vocab_size=V
                    )
                    terms = backend.gold_kd_loss(
                        *common,
                        exact,
                        temperature=cfg.temperature,
                        uncommon_topk=cfg.uncommon_topk,
                        reverse_kl=cfg.reverse_kl,
                        **extra,
                    )
                else:
                    if backend is fused:
                        extra["projection_topk"] = projection.topk
                        if fused.fused_path_available(student_logits, z_t):
                            extra["projection_tables"] = projection.kernel_tables(V, W)
                    terms = backend.pkl_kd_loss(
                        *common,
                        projection.sparse(V, W),
                        temperature=cfg.temperature,
                        vocab_topk=cfg.vocab_topk,
                        reverse_kl=cfg.reverse_kl,
                        topk_columns=cfg.topk_columns,
                        **extra,
                    )
                denom = terms.num_valid if global_valid_chunks is None else chunk_denoms[i]
                # One update for the five sums in three launches: [kd, kl, l1] * w / d,
                # correct / d / n_t, num_valid / n_t as sums * (coef / d + bias), the constants
                # cached on the device. The metrics are detached; the gradient takes one multiply.
                coef_5, bias_5 = self._metric_scales(weight, dtype, device)
                scale_5 = torch.addcdiv(bias_5, coef_5, denom.to(dtype).clamp_min(1))
                sums_5 = torch.stack(
                    [terms.kd.detach(), terms.kl, terms.l1, terms.correct, terms.num_valid]
                )
                scaled_5 = sums_5.to(dtype) * scale_5
                kd_i = terms.kd.to(dtype) * scale_5[0]
                acc_5 = scaled_5 if acc_5 is None else acc_5 + scaled_5
                kd = kd_i if i == 0 else kd + kd_i
        if acc_5 is not None:
            kl_common, l1_uncommon, proj_accuracy, num_valid = acc_5[1:].unbind()
        if checks is not None and deferred:
            checks.finish()  # raises on bad input before the CE gather and before returning

        if "input_ids" in batch:
            nll_sum, correct, n_tokens = reference.student_ce_loss(
                student_logits,
                input_ids.to(device),
                None if token_mask is None else token_mask.to(device),
                None if sample_mask is None else sample_mask.to(device),
            )
            tok_denom = (
                n_tokens
                if global_valid_tokens is None
                else torch.as_tensor(global_valid_tokens, dtype=dtype, device=device)
            )
            tok_denom = tok_denom.to(dtype).clamp_min(1)
            ce = nll_sum.to(dtype) / tok_denom
            accuracy = correct.to(dtype) / tok_denom
        else:  # no CE tokens: both terms are 0 over any denominator
            ce, accuracy = zero, zero
        if ce is zero and not cfg.dynamic_scaling:
            # kl_weight * kd + ce_weight * 0 without the two ops on the constant (host time)
            loss = kd if cfg.kl_weight == 1.0 else cfg.kl_weight * kd
        else:
            loss = reference.combine_losses(
                kd,
                ce,
                kl_weight=cfg.kl_weight,
                ce_weight=cfg.ce_weight,
                dynamic_scaling=cfg.dynamic_scaling,
            )
        metrics = {
            "loss": loss.detach(),
            "kl_loss": kd.detach(),
            "ce_loss": _detached(ce),
            "kl_common": _detached(kl_common),
            "l1_uncommon": _detached(l1_uncommon),
            "proj_accuracy": _detached(proj_accuracy),
            "num_valid_chunks": _detached(num_valid),
            "accuracy": _detached(accuracy),
        }
        return loss, metrics


def _detached(x: torch.Tensor) -> torch.Tensor:
    """``x`` without autograd history (no new view when it has none: a dispatch per metric)."""
    return x.detach() if x.requires_grad or x.grad_fn is not None else x
