"""The kernel engine: the KD term by the Triton kernels of :mod:`xtoken_core.losses.fused`, and,
as an option (``cuda_graphs``, off by default), P-KL's whole KD phase replayed as one CUDA graph
(:mod:`xtoken_core.losses.graphed`).

The chunk bookkeeping of each teacher is one :func:`~xtoken_core.losses.fused.plan_chunks` (two
launches, no host sync). P-KL then needs no host value before its kernels are queued, so the
input checks are read back after them (the kernels index only with clamped ids); gold reads
them first (it needs the valid-chunk count N on the host).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xtoken_core.losses import fused, graphed, reference
from xtoken_core.losses.checks import DeferredChecks
from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.engine import (
    KDResult,
    MetricScales,
    TeacherInputs,
    _denominator_name,
    sum_teacher_terms,
)

__all__ = ["KernelEngine"]


class KernelEngine:
    """The KD term by the Triton kernels (CUDA, or ``TRITON_INTERPRET=1``; fp32/bf16/fp16
    logits: :meth:`supports`). Reads its settings from ``config`` at each call.

    Args:
        config: the loss settings (``cuda_graphs`` and ``cuda_graph_cache`` for the graphs).
    """

    def __init__(self, config: CrossTokenizerLossConfig) -> None:
        self.config = config
        self.scales = MetricScales(config.num_teachers)
        self._graphs: graphed.GraphedPklPhase | None = None

    @staticmethod
    def supports(student_logits_BTV: torch.Tensor, teacher_logits: Sequence[torch.Tensor]) -> bool:
        """Whether the kernels run on these logits (:func:`fused.fused_path_available`).

        Args:
            student_logits_BTV: the student logits.
            teacher_logits: every teacher's logits.

        Returns:
            True when every teacher's logits (and the student's) can take the kernels.
        """
        return all(fused.fused_path_available(student_logits_BTV, z) for z in teacher_logits)

    @property
    def graph_stats(self) -> dict[str, Any] | None:
        """CUDA-graph counts of the P-KL phase (eager, captures, replays, evictions, disabled
        reason), or None before the first graph-eligible call."""
        return None if self._graphs is None else self._graphs.stats

    def _graph_eligible(self, student_logits_BTV: torch.Tensor) -> bool:
        """Whether this call's P-KL phase goes through :class:`graphed.GraphedPklPhase`."""
        return (
            self.config.cuda_graphs
            and not self.config.gold_loss
            and student_logits_BTV.is_cuda
            and graphed.graphs_enabled()
            and not torch.cuda.is_current_stream_capturing()
        )

    def kd(
        self,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[TeacherInputs],
        *,
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
        checks: DeferredChecks | None,
    ) -> KDResult:
        """See :class:`~xtoken_core.losses.engine.KDEngine`."""
        if self._graph_eligible(student_logits_BTV):
            return self._graph_kd(student_logits_BTV, teachers, sample_mask_B, chunk_denoms, checks)
        cfg = self.config
        V = student_logits_BTV.shape[-1]
        device = student_logits_BTV.device
        if checks is not None:
            checks.finite("student_logits", student_logits_BTV)
        plans, slots = [], []
        for t in teachers:
            if checks is not None:
                checks.finite(t.name, t.logits_BUW)
            plan = self._plan(t, sample_mask_B, device, checks)
            plans.append(plan)
            slots.append(None if checks is None else checks.value(plan.stats_5[4:5]))
        if checks is not None and chunk_denoms is not None:
            for t, plan in zip(teachers, plans, strict=True):
                name = _denominator_name(t, len(teachers))
                checks.denominator(name, chunk_denoms[t.index : t.index + 1], plan.stats_5[4:5])
        values = None
        if checks is not None:
            checks.start()
            if cfg.gold_loss:  # gold needs N on the host: read the checks now
                values = checks.finish()
        terms = []
        for t, plan, slot in zip(teachers, plans, slots, strict=True):
            common = (
                student_logits_BTV,
                t.logits_BUW,
                plan.student_chunk_id_BT,
                plan.teacher_chunk_id_BU,
                plan.valid_BC,
            )
            num_valid = None if values is None else int(values[slot][0])
            W = t.vocab_size
            if cfg.gold_loss:
                exact = t.projection.exact_map(W, xtoken_loss=cfg.xtoken_loss, student_vocab_size=V)
                terms.append(
                    fused.gold_kd_loss(
                        *common,
                        exact,
                        temperature=cfg.temperature,
                        uncommon_topk=cfg.uncommon_topk,
                        reverse_kl=cfg.reverse_kl,
                        num_valid=num_valid,
                        plan=plan,
                    )
                )
            else:
                terms.append(
                    fused.pkl_kd_loss(
                        *common,
                        t.projection.sparse(V, W),
                        temperature=cfg.temperature,
                        vocab_topk=cfg.vocab_topk,
                        reverse_kl=cfg.reverse_kl,
                        topk_columns=cfg.topk_columns,
                        plan=plan,
                        projection_tables=t.projection.kernel_tables(V, W),
                    )
                )
        dtype = reference.compute_dtype(student_logits_BTV)
        result = sum_teacher_terms(terms, teachers, chunk_denoms, self.scales, dtype, device)
        if checks is not None and values is None:
            checks.finish()  # raises on bad input before the caller reads the result
        return result

    def _plan(self, teacher: TeacherInputs, sample_mask_B, device, checks):
        """Shifted ids, validity, N and both sides' rows of one teacher
        (:func:`fused.plan_chunks`); the id-range checks are queued from its device stats."""
        alignment = teacher.alignment
        plan = fused.plan_chunks(
            alignment.student_chunk_id,
            alignment.teacher_chunk_id,
            alignment.pair_valid,
            sample_mask_B=sample_mask_B,
            pair_is_correct_BC=alignment.pair_is_correct,
            exact_token_match_only=self.config.exact_token_match_only,
            device=device,
        )
        if checks is not None:
            C = alignment.max_chunks
            checks.id_bounds("alignment_student_chunk_id", plan.stats_5[0:2], C)
            checks.id_bounds("alignment_teacher_chunk_id", plan.stats_5[2:4], C)
        return plan

    def _graph_kd(self, student_logits_BTV, teachers, sample_mask_B, chunk_denoms, checks):
        """P-KL's KD phase through :class:`graphed.GraphedPklPhase` (eager, captured or
        replayed); its checks are queued in the order of the eager path."""
        cfg = self.config
        V = student_logits_BTV.shape[-1]
        device = student_logits_BTV.device
        dtype = reference.compute_dtype(student_logits_BTV)
        if self._graphs is None:
            self._graphs = graphed.GraphedPklPhase(cfg.cuda_graph_cache)
        phase_teachers = []
        for t in teachers:
            coef_5, bias_5 = self.scales(t.weight, dtype, device)
            phase_teachers.append(
                graphed.PklTeacher(
                    logits_BUW=t.logits_BUW,
                    student_chunk_id_BT=t.alignment.student_chunk_id,
                    teacher_chunk_id_BU=t.alignment.teacher_chunk_id,
                    pair_valid_BC=t.alignment.pair_valid,
                    pair_is_correct_BC=t.alignment.pair_is_correct,
                    tables=t.projection.kernel_tables(V, t.vocab_size),
                    coef_5=coef_5,
                    bias_5=bias_5,
                )
            )
        spec = graphed.PklSpec(
            temperature=float(cfg.temperature),
            vocab_topk=cfg.vocab_topk,
            reverse_kl=bool(cfg.reverse_kl),
            exact_token_match_only=bool(cfg.exact_token_match_only),
            topk_columns=cfg.topk_columns,
        )
        kd, metrics_4n, checks_X = self._graphs(
            spec, student_logits_BTV, phase_teachers, sample_mask_B, chunk_denoms
        )
        if checks is not None:  # checks_X may be graph memory: start() copies it this call
            # the phase took the logits' sums in passes that read them anyway
            checks.finite("student_logits", student_logits_BTV, total=checks_X[0:1])
            for i, t in enumerate(phase_teachers):
                at = 1 + 6 * i
                C = t.pair_valid_BC.shape[1]
                checks.finite(teachers[i].name, t.logits_BUW, total=checks_X[at : at + 1])
                checks.id_bounds("alignment_student_chunk_id", checks_X[at + 1 : at + 3], C)
                checks.id_bounds("alignment_teacher_chunk_id", checks_X[at + 3 : at + 5], C)
            if chunk_denoms is not None:
                for t in teachers:  # N is on the device only: finite and >= 0
                    name = _denominator_name(t, len(teachers))
                    checks.denominator(name, chunk_denoms[t.index : t.index + 1], None)
            checks.start()
            checks.finish()
        return KDResult(kd=kd, metrics_4=metrics_4n[:4])
