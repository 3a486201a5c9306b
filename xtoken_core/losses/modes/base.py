"""The seam of a KD mode: what a mode computes for one teacher (:class:`KDMode`) and what it
returns (:class:`KDTerms`).

A mode holds its PyTorch reference (the ground truth: any float dtype, fp64 included), its
kernel path (the Triton kernels: fp32/bf16/fp16 logits on CUDA or under ``TRITON_INTERPRET=1``)
and optionally a CPU path (the reference's math with fewer passes over CPU logits; without one
the reference runs). The engines (:mod:`xtoken_core.losses.engine`,
:mod:`xtoken_core.losses.kernel_engine`, :mod:`xtoken_core.losses.cpu_engine`) call one of them
per teacher; what both share (chunk ids, validity, denominators, the input checks,
the sum over teachers) stays in the engines.

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab, C chunk slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xtoken_core.data.projection import Projection
    from xtoken_core.losses.config import CrossTokenizerLossConfig

__all__ = ["KDMode", "KDTerms"]


@dataclass
class KDTerms:
    """Sums over the valid chunks of one teacher (divide by the global valid-chunk count).

    Attributes:
        kd: scalar, the KD loss sum (``(kl + l1) * T**2``), differentiable.
        kl: scalar, the KL part (times T**2), detached.
        l1: scalar, the uncommon L1 part (times T**2; 0 for P-KL), detached.
        correct: scalar, valid chunks whose argmaxes agree, detached.
        num_valid: scalar, number of valid chunks.
    """

    kd: torch.Tensor
    kl: torch.Tensor
    l1: torch.Tensor
    correct: torch.Tensor
    num_valid: torch.Tensor


class KDMode(ABC):
    """One KD loss mode over one teacher: its reference and its kernel path.

    A loss builds its mode once from its config (the registry of
    :mod:`xtoken_core.losses.modes` maps the config's ``mode`` to the class) and reads the
    settings it needs from it.

    Args:
        config: the loss settings.
    """

    #: The kernel path reads every row's logsumexp of both logits at the temperature and N on
    #: the host: the kernel engine makes the student's before the teachers are prepared (the
    #: GPU then works while the host prepares), and reads N back behind the chunk plans.
    row_logsumexps: bool = False

    def __init__(self, config: CrossTokenizerLossConfig) -> None:
        self.config = config

    @abstractmethod
    def reference(
        self,
        student_logits_BTV: torch.Tensor,
        teacher_logits_BUW: torch.Tensor,
        student_chunk_id_BT: torch.Tensor,
        teacher_chunk_id_BU: torch.Tensor,
        valid_BC: torch.Tensor,
        projection: Projection,
    ) -> KDTerms:
        """The KD sums of one teacher by the PyTorch reference.

        Args:
            student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
            teacher_logits_BUW: ``[B, U, W]`` teacher logits sliced to the teacher vocab
                (constants).
            student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
            teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
            valid_BC: ``[B, C]`` bool, the valid chunks.
            projection: the teacher's projection on the logits' device, checked against V, W.

        Returns:
            :class:`KDTerms`.
        """

    @abstractmethod
    def kernel(
        self,
        student_logits_BTV: torch.Tensor,
        teacher_logits_BUW: torch.Tensor,
        plan: Any,
        projection: Projection,
        *,
        num_valid: int | None = None,
        row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDTerms:
        """The KD sums of one teacher by the Triton kernels.

        Args:
            student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
            teacher_logits_BUW: ``[B, U, W]`` teacher logits sliced to the teacher vocab.
            plan: the teacher's :class:`~xtoken_core.kernels.chunk_plan.ChunkPlan` (shifted
                ids, validity, N and both sides' rows, on the device).
            projection: the teacher's projection on the logits' device, checked against V, W.
            num_valid: N on the host (given to modes with :attr:`row_logsumexps`), else None.
            row_lse: ``(student [B*T], teacher [B*U])`` fp32 row logsumexps of ``z / T`` over
                every row (given to modes with :attr:`row_logsumexps`), else None.

        Returns:
            :class:`KDTerms`.
        """

    def cpu(
        self,
        student_logits_BTV: torch.Tensor,
        teacher_logits_BUW: torch.Tensor,
        student_chunk_id_BT: torch.Tensor,
        teacher_chunk_id_BU: torch.Tensor,
        valid_BC: torch.Tensor,
        projection: Projection,
        *,
        stats: Any = None,
    ) -> KDTerms:
        """The KD sums of one teacher on the CPU path (:mod:`xtoken_core.losses.cpu`): the
        reference's math with fewer passes over CPU logits. A mode without one runs its
        :meth:`reference` (this default).

        Args:
            student_logits_BTV: ``[B, T, V]`` CPU student logits, fp32/bf16/fp16.
            teacher_logits_BUW: ``[B, U, W]`` teacher logits sliced to the teacher vocab.
            student_chunk_id_BT: ``[B, T]`` shifted student chunk ids.
            teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
            valid_BC: ``[B, C]`` bool, the valid chunks.
            projection: the teacher's projection, checked against V, W.
            stats: the call's :class:`~xtoken_core.losses.cpu.RowStats` of the student logits.

        Returns:
            :class:`KDTerms`.
        """
        return self.reference(
            student_logits_BTV,
            teacher_logits_BUW,
            student_chunk_id_BT,
            teacher_chunk_id_BU,
            valid_BC,
            projection,
        )

    def picks_columns(self, teacher_vocab_size: int) -> bool:
        """Whether the mode keeps a subset of the teacher columns picked over the whole
        micro-batch (a fused head that splits the micro-batch into blocks then gives every
        block the same pick).

        Args:
            teacher_vocab_size: W.

        Returns:
            False here.
        """
        return False
