"""The kernel engine's P-KL KD phase captured once as a CUDA graph and replayed (an option).

At one sample of 1,024 tokens the fused P-KL kernels need ~1.3 ms of GPU but ~2 ms of host time
to launch (plan, teacher top-k, chunk means, projection, chunk terms, metric scaling, input
checks): the GPU waits for Python. :class:`GraphedPklPhase` captures that whole phase once and
replays it, so a call costs a few small copies, one replay and the readback of the checks.

What a graph may and may not assume:

* **The logits are read where they are.** Student and teacher logits are hundreds of MB, too
  large to copy into the graph's own buffers every call, so the graph reads them at the
  addresses it was captured with, and a graph is used only when a call passes logits at those
  same addresses (with the same shapes, strides and dtypes). A training loop with PyTorch's
  caching allocator or a persistent teacher buffer does; when the addresses change every call,
  the policy stops capturing (:class:`GraphPolicy`) and the phase runs eagerly.
* **Everything small is copied in.** Chunk ids, pair masks, the sample mask and the global
  denominators are copied into the graph's static inputs on every call (one small copy each).
* **Outputs are private.** The loss and metrics are cloned out of the graph's memory; nothing
  a caller keeps is overwritten by a later replay.
* **A late backward is still right.** The tensors the backward reads (row logsumexp, projected
  rows, chunk means, restricted tables) live in the graph's memory; each replay bumps a
  generation counter, and a backward whose replay was overwritten (two forwards with the same
  logits before its backward, or the graph evicted) recomputes them eagerly from its inputs.

The first call with a new key runs eagerly (it also compiles and warms the kernels), the second
captures, later ones replay. The same kernels run in all three cases, so the results are
bitwise equal.

Legend (shape suffixes): B batch, T student tokens, U teacher tokens, V student vocab,
W teacher vocab, C chunk slots, F the flat output (5 sums + one scale per teacher),
X the flat checks (1 + 6 per teacher).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xtoken_core import envs
from xtoken_core.kernels import pkl_chunk_kl
from xtoken_core.losses import fused, reference
from xtoken_core.losses.utils import ChunkRows

logger = logging.getLogger(__name__)

__all__ = [
    "GraphPolicy",
    "GraphedPklPhase",
    "PklSpec",
    "PklTeacher",
    "graphs_enabled",
    "kd_phase",
]


def graphs_enabled() -> bool:
    """Whether CUDA graphs may be used at all: ``XTOKEN_CUDA_GRAPHS`` is not 0/false/off and
    the Triton kernels are compiled (not ``TRITON_INTERPRET=1``).

    Returns:
        True unless the environment turns them off (read now).
    """
    return envs.cuda_graphs_allowed() and not envs.triton_interpret()


@dataclass(frozen=True)
class PklSpec:
    """The settings a P-KL phase depends on (part of the graph key)."""

    temperature: float
    vocab_topk: int | None
    reverse_kl: bool
    exact_token_match_only: bool
    topk_columns: str = "valid"


@dataclass(frozen=True)
class PklTeacher:
    """One teacher's inputs to the P-KL phase.

    Attributes:
        logits_BUW: teacher logits, already sliced to the teacher vocab (read in place).
        student_chunk_id_BT: raw (unshifted) student chunk ids of this teacher's alignment.
        teacher_chunk_id_BU: raw teacher chunk ids.
        pair_valid_BC: bool pair validity.
        pair_is_correct_BC: bool or None.
        tables: :class:`xtoken_core.kernels.pkl_projection.ProjectionTables` of the projection.
        coef_5: fp32 [5] metric coefficients, ``sums_5 * (coef_5 / denom + bias_5)``.
        bias_5: fp32 [5] metric offsets.
    """

    logits_BUW: torch.Tensor
    student_chunk_id_BT: torch.Tensor
    teacher_chunk_id_BU: torch.Tensor
    pair_valid_BC: torch.Tensor
    pair_is_correct_BC: torch.Tensor | None
    tables: Any
    coef_5: torch.Tensor
    bias_5: torch.Tensor

    def small(self) -> tuple[torch.Tensor | None, ...]:
        """The inputs copied into a graph on every call, in a fixed order."""
        return (
            self.student_chunk_id_BT,
            self.teacher_chunk_id_BU,
            self.pair_valid_BC,
            self.pair_is_correct_BC,
        )

    def with_small(self, small: Sequence[torch.Tensor | None]) -> PklTeacher:
        """This teacher with other small inputs (in :meth:`small`'s order)."""
        s_ids, t_ids, pair_valid, pair_is_correct = small
        return dataclasses.replace(
            self,
            student_chunk_id_BT=s_ids,
            teacher_chunk_id_BU=t_ids,
            pair_valid_BC=pair_valid,
            pair_is_correct_BC=pair_is_correct,
        )


@dataclass
class PhaseResult:
    """What one run of :func:`kd_phase` leaves on the device.

    Attributes:
        out_F: fp32 ``[5 + n]``: the scaled sums ``(kd, kl_common, l1, proj_accuracy,
            num_valid)`` over the teachers, then each teacher's KD scale (weight / denominator).
        checks_X: fp64 ``[1 + 6 n]``: the student logits' fp32 sum, then per teacher its logits'
            sum and the plan stats (student id min, max, teacher id min, max, N).
        student_BTV: the contiguous copy the kernels read when the student logits' last dim
            is strided, else None (they read the logits themselves: a graph must not hold a
            reference to the logits it was captured with, or their address could never be
            freed and taken by the next step's logits).
        saved: per teacher, the :class:`~xtoken_core.kernels.pkl_chunk_kl.ChunkKLSaved`.
    """

    out_F: torch.Tensor
    checks_X: torch.Tensor
    student_BTV: torch.Tensor | None
    saved: tuple


def kd_phase(
    spec: PklSpec,
    student_logits_BTV: torch.Tensor,
    teachers: Sequence[PklTeacher],
    sample_mask_B: torch.Tensor | None,
    chunk_denoms: torch.Tensor | None,
) -> PhaseResult:
    """The fused P-KL KD phase of every teacher, without autograd and without a host sync.

    The same kernels as :func:`xtoken_core.losses.fused.pkl_kd_loss` with a chunk plan, and the
    same metric scaling as :class:`~xtoken_core.losses.loss.CrossTokenizerLoss`, so that it can
    be captured as a CUDA graph.

    Args:
        spec: the settings.
        student_logits_BTV: [B, T, V] student logits (fp32/bf16/fp16, CUDA or interpreted).
        teachers: one :class:`PklTeacher` each.
        sample_mask_B: [B] or None.
        chunk_denoms: fp32 [n] global valid-chunk counts, or None (each teacher's own N).

    Returns:
        :class:`PhaseResult`.
    """
    zs_BTV = fused._last_dim_contiguous(student_logits_BTV.detach())
    device = zs_BTV.device
    # The finite checks are plain fp32 sums of the logits, taken by passes that read them
    # anyway: the student's row-logsumexp pass, the teacher's column-max pass.
    row_sums_R = torch.empty(zs_BTV.shape[0] * zs_BTV.shape[1], device=device)
    teacher_checks = []
    acc_5 = None
    scales, saved = [], []
    for i, t in enumerate(teachers):
        zt_BUW = fused._last_dim_contiguous(t.logits_BUW.detach())
        plan = fused.plan_chunks(
            t.student_chunk_id_BT,
            t.teacher_chunk_id_BU,
            t.pair_valid_BC,
            sample_mask_B=sample_mask_B,
            pair_is_correct_BC=t.pair_is_correct_BC,
            exact_token_match_only=spec.exact_token_match_only,
            device=device,
        )
        device_N = plan.stats_5[4:5]
        s_rows, t_rows = ChunkRows(*plan.rows(0, None)), ChunkRows(*plan.rows(1, None))
        teacher_lp_NK, restricted, teacher_sum = fused.pkl_teacher_side(
            zt_BUW,
            plan.teacher_chunk_id_BU,
            t_rows,
            t.tables,
            temperature=spec.temperature,
            vocab_topk=spec.vocab_topk,
            device_N=device_N,
            with_sum=True,
            topk_columns=spec.topk_columns,
        )
        if teacher_sum is None:  # all columns kept: no column-max pass
            teacher_sum = zt_BUW.sum(dtype=torch.float32)
        teacher_checks += [teacher_sum.reshape(1), plan.stats_5]
        sums_4, saved_i = pkl_chunk_kl.projected_chunk_kl_forward(
            zs_BTV,
            s_rows.nidx_R,
            s_rows.order_R,
            s_rows.offsets_N1,
            teacher_lp_NK,
            *restricted,
            float(spec.temperature),
            bool(spec.reverse_kl),
            reference.PROB_EPS,
            device_N,
            row_sums_R=row_sums_R if i == 0 else None,
        )
        # (kd, kl, l1, correct, num_valid) * (coef / denom + bias), as the loss scales them
        denom = sums_4[3] if chunk_denoms is None else chunk_denoms[i]
        scale_5 = torch.addcdiv(t.bias_5, t.coef_5, denom.clamp_min(1))
        sums_5 = torch.cat([sums_4[:1], sums_4[:1], sums_4[1:]])
        scaled_5 = sums_5 * scale_5
        acc_5 = scaled_5 if acc_5 is None else acc_5 + scaled_5
        scales.append(scale_5[:1])
        saved.append(saved_i)
    # the first teacher's row-logsumexp pass has filled row_sums_R (a loss has >= 1 teacher)
    checks = [row_sums_R.sum().reshape(1), *teacher_checks]
    checks_X = torch.cat([c.to(torch.float64) for c in checks])
    return PhaseResult(
        out_F=torch.cat([acc_5, *scales]),
        checks_X=checks_X,
        student_BTV=zs_BTV if student_logits_BTV.stride(-1) != 1 else None,
        saved=tuple(saved),
    )


class GraphPolicy:
    """Which calls of a key run eagerly, get captured or replay a graph (no CUDA in here).

    A key is captured the second time it is seen (the first call warms the kernels up, and a
    key seen once is not worth a graph); at most ``capacity`` graphs are kept, the least
    recently used is evicted. When keys keep changing (more than ``2 * capacity + 2`` captures
    with fewer replays than captures), capturing stops for good: the caller's addresses are
    not stable and every capture would be wasted.

    Args:
        capacity: graphs kept at most (>= 1).
        seen_capacity: keys remembered as seen once.
    """

    def __init__(self, capacity: int, seen_capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._seen_capacity = seen_capacity
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "evictions": 0}
        self.disabled_reason: str | None = None

    def decide(self, key: Hashable) -> str:
        """``"replay"``, ``"capture"`` or ``"eager"`` for a call with ``key``."""
        if key in self.entries:
            self.entries.move_to_end(key)
            self.stats["replays"] += 1
            return "replay"
        if self.disabled_reason is None and key in self._seen:
            captures, replays = self.stats["captures"], self.stats["replays"]
            if captures > 2 * self.capacity + 2 and replays < captures:
                self.disable(
                    f"the logits addresses change between calls ({captures} graphs captured, "
                    f"{replays} replays); keep the logits in fixed buffers to use graphs"
                )
            else:
                del self._seen[key]
                self.stats["captures"] += 1
                return "capture"
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self._seen_capacity:
            self._seen.popitem(last=False)
        self.stats["eager"] += 1
        return "eager"

    def forget(self, key: Hashable) -> None:
        """Drop ``key`` from the keys seen once (its eager run failed: it is not captured)."""
        self._seen.pop(key, None)

    def add(self, key: Hashable, entry: Any) -> list[Any]:
        """Keep a captured ``entry``; returns the entries evicted to make room."""
        self.entries[key] = entry
        evicted = []
        while len(self.entries) > self.capacity:
            evicted.append(self.entries.popitem(last=False)[1])
            self.stats["evictions"] += 1
        return evicted

    def disable(self, reason: str) -> None:
        """Stop capturing (entries already kept still replay)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.warning("[losses] CUDA graphs off for this loss: %s", reason)


class _Entry:
    """One captured graph: its static inputs, its outputs and a replay generation."""

    def __init__(self, graph, static_small, static_denoms, result: PhaseResult, keep) -> None:
        self.graph = graph
        # the projection tables and metric constants the graph reads by address: alive as long
        # as the graph (so their memory, and the ids in the key, are never reused under it)
        self.keep = keep
        self.static_small = static_small
        self.static_denoms = static_denoms
        self.result = result
        self.generation = 0
        self.alive = True

    def replay(self, small: Sequence[torch.Tensor | None], denoms: torch.Tensor | None) -> int:
        # plain copies (a pinned CPU source is read before the call returns, as ``.to`` does)
        for dst, src in zip(self.static_small, small, strict=True):
            if dst is not None:
                dst.copy_(src)
        if denoms is not None:
            self.static_denoms.copy_(denoms)
        self.graph.replay()
        self.generation += 1
        return self.generation


class _Run:
    """One call's phase: its inputs and result, and where its backward finds them again.

    The backward's tensors travel through ``ctx.save_for_backward`` (:meth:`flatten`), so that
    autograd frees them after the backward as it does for any Function: the logits of a
    finished step do not outlive it, and the next step's logits can take their addresses.
    """

    def __init__(self, spec, inputs, result, entry=None, generation=0) -> None:
        self.spec = spec
        self.inputs = inputs  # (student, teachers, sample_mask, denoms)
        self.result = result
        self.entry = entry
        self.generation = generation
        self.num_teachers = len(inputs[1])
        self.aux = [(t.tables, t.coef_5, t.bias_5) for t in inputs[1]]

    def flatten(self) -> list[torch.Tensor | None]:
        """Every tensor the backward may read, in the order :meth:`restore` expects."""
        student, teachers, sample_mask, denoms = self.inputs
        flat = [student, sample_mask, denoms, self.result.student_BTV]
        for t in teachers:
            flat += [t.logits_BUW, *t.small()]
        for saved in self.result.saved:
            flat += list(saved)
        return flat

    def backward_tensors(self, flat: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, tuple]:
        """``(student_BTV, saved)`` of this call from :meth:`flatten`'s tensors, recomputed when
        the graph ran again (or was dropped) since this forward: its memory then holds another
        call's tensors."""
        student, sample_mask, denoms, student_BTV = flat[:4]
        n = self.num_teachers
        per = [flat[4 + 5 * i : 9 + 5 * i] for i in range(n)]
        saved_flat = flat[4 + 5 * n :]
        stale = self.entry is not None and (
            not self.entry.alive or self.entry.generation != self.generation
        )
        if stale:
            teachers = [PklTeacher(*p, *aux) for p, aux in zip(per, self.aux, strict=True)]
            with torch.no_grad():
                result = kd_phase(self.spec, student, teachers, sample_mask, denoms)
            student_BTV, saved = result.student_BTV, result.saved
        else:
            saved_type = pkl_chunk_kl.ChunkKLSaved
            width = len(saved_type._fields)
            saved = tuple(saved_type(*saved_flat[i * width : (i + 1) * width]) for i in range(n))
        return (student.detach() if student_BTV is None else student_BTV), saved

    def detach_tensors(self) -> _Run:
        """Forget the tensors (they now live in the autograd context) and keep the rest."""
        self.inputs = self.result = None
        return self


class _PhaseFunction(torch.autograd.Function):
    """``(kd, metrics)`` of a :class:`_Run`; the gradient of kd flows to the student logits."""

    @staticmethod
    def forward(ctx, student_logits_BTV, run: _Run):
        out_F = run.result.out_F
        kd = out_F[0].clone()
        metrics = out_F[1:].clone()  # 4 sums, then the teachers' KD scales (for backward)
        # the logits among them: autograd's in-place check (an edit before backward raises)
        ctx.save_for_backward(metrics, *run.flatten())
        ctx.run = run.detach_tensors()
        ctx.mark_non_differentiable(metrics)
        ctx.set_materialize_grads(False)
        return kd, metrics

    @staticmethod
    def backward(ctx, grad_kd, grad_metrics):
        if grad_kd is None:
            return None, None
        metrics, *flat = ctx.saved_tensors
        run = ctx.run
        student_BTV, saved_all = run.backward_tensors(flat)
        grad = grad_kd.to(torch.float32).reshape(1)
        dz_BTV = None
        for i, saved in enumerate(saved_all):
            dz_i = pkl_chunk_kl.projected_chunk_kl_backward(
                grad * metrics[4 + i : 5 + i],
                student_BTV,
                saved,
                float(run.spec.temperature),
                bool(run.spec.reverse_kl),
                reference.PROB_EPS,
            )
            dz_BTV = dz_i if dz_BTV is None else dz_BTV.add_(dz_i)
        return dz_BTV, None


def _address(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)


def _layout(x: torch.Tensor | None) -> tuple | None:
    return None if x is None else (x.shape, x.dtype, x.device)


class GraphedPklPhase:
    """The P-KL KD phase of one loss object, eager or replayed from a CUDA graph.

    Args:
        capacity: graphs kept at most; each holds the phase's working memory (about
            ``B*T*K*4`` bytes three times over, plus the plan: ~100 MB at 1x1024, K = 8192).
    """

    def __init__(self, capacity: int = 2) -> None:
        self.policy = GraphPolicy(capacity)

    @property
    def stats(self) -> dict[str, Any]:
        """Counts of eager calls, captures, replays and evictions, and why graphs are off."""
        return {**self.policy.stats, "disabled": self.policy.disabled_reason}

    def __call__(
        self,
        spec: PklSpec,
        student_logits_BTV: torch.Tensor,
        teachers: Sequence[PklTeacher],
        sample_mask_B: torch.Tensor | None,
        chunk_denoms: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the phase: eagerly, by capturing a graph, or by replaying one.

        Args: as :func:`kd_phase` (CUDA tensors; small ones may sit on the CPU).

        Returns:
            ``(kd, metrics, checks_X)``: the scalar KD term (gradient to the student logits),
            fp32 ``[4 + n]`` metrics (kl_common, l1, proj_accuracy, num_valid, then the
            teachers' scales) and the fp64 checks of :class:`PhaseResult`. ``checks_X`` may be
            graph memory: read it (e.g. queue its readback) before the next call.
        """
        small = [x for t in teachers for x in t.small()] + [sample_mask_B]
        key = (
            spec,
            _address(student_logits_BTV),
            tuple(
                (_address(t.logits_BUW), id(t.tables), id(t.coef_5), id(t.bias_5)) for t in teachers
            ),
            tuple(_layout(x) for x in small),
            _layout(chunk_denoms),
        )
        inputs = (student_logits_BTV, tuple(teachers), sample_mask_B, chunk_denoms)
        # a graph is captured and replayed on the current device: logits elsewhere run eagerly
        device = student_logits_BTV.device
        elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
        action = "eager" if elsewhere else self.policy.decide(key)
        run = None
        if action == "replay":
            entry = self.policy.entries[key]
            generation = entry.replay(small, chunk_denoms)
            run = _Run(spec, inputs, entry.result, entry, generation)
        elif action == "capture":
            run = self._capture(key, spec, inputs, small)
        if run is None:
            try:
                with torch.no_grad():
                    run = _Run(spec, inputs, kd_phase(spec, *inputs))
            except Exception:
                # bad input (e.g. exact_token_match_only without pair_is_correct): this key is
                # not one to capture, and a capture must never be what finds the error
                self.policy.forget(key)
                raise
        checks_X = run.result.checks_X
        kd, metrics = _PhaseFunction.apply(student_logits_BTV, run)
        return kd, metrics, checks_X

    def _capture(self, key, spec, inputs, small) -> _Run | None:
        student, teachers, sample_mask, denoms = inputs
        device = student.device
        static_small = [
            None if x is None else torch.empty(x.shape, dtype=x.dtype, device=device) for x in small
        ]
        static_denoms = None if denoms is None else torch.empty_like(denoms, device=device)
        static_teachers = [
            t.with_small(static_small[4 * i : 4 * i + 4]) for i, t in enumerate(teachers)
        ]
        static_mask = static_small[-1]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                result = kd_phase(spec, student, static_teachers, static_mask, static_denoms)
        except Exception as exc:  # a kernel or library call that cannot be captured
            self.policy.disable(f"capture failed ({type(exc).__name__}: {exc}); running eagerly")
            return None
        keep = [(t.tables, t.coef_5, t.bias_5) for t in teachers]
        entry = _Entry(graph, static_small, static_denoms, result, keep)
        for old in self.policy.add(key, entry):
            old.alive = False
        generation = entry.replay(small, denoms)
        return _Run(spec, inputs, result, entry, generation)
