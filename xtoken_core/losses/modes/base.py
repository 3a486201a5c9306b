"""The seam of a KD mode: what a mode computes for one teacher (:class:`KDMode`) and what it
returns (:class:`KDTerms`).

A mode holds its PyTorch reference (the ground truth: any float dtype, fp64 included), its
kernel path (the Triton kernels: fp32/bf16/fp16 logits on CUDA or under ``TRITON_INTERPRET=1``)
and optionally a CPU path (the reference's math with fewer passes over CPU logits; without one
the reference runs). Each path takes one teacher's
:class:`~xtoken_core.losses.inputs.LossInputs`; the loss's backend
(:mod:`xtoken_core.losses.backends`, chosen once when the loss is built) calls one of them per
teacher and does what every mode shares (chunk ids, validity, denominators, the input checks,
the sum over teachers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from xtoken_core.data.projection import Projection
    from xtoken_core.kernels.chunk_plan import ChunkPlan
    from xtoken_core.losses.config import CrossTokenizerLossConfig
    from xtoken_core.losses.inputs import LossInputs

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
    """One KD loss mode over one teacher: its reference, its kernel path and its CPU path.

    A loss builds its mode once from its config (the registry of
    :mod:`xtoken_core.losses.modes` maps the config's ``mode`` to the class) and reads the
    settings it needs from it.

    Args:
        config: the loss settings.
    """

    #: The kernel path reads every row's logsumexp of both logits at the temperature and N on
    #: the host: the kernel backend makes the student's before the teachers are prepared (the
    #: GPU then works while the host prepares), and reads N back behind the chunk plans.
    row_logsumexps: bool = False

    def __init__(self, config: CrossTokenizerLossConfig) -> None:
        self.config = config

    @abstractmethod
    def reference(self, inputs: LossInputs, projection: Projection) -> KDTerms:
        """The KD sums of one teacher by the PyTorch reference.

        Args:
            inputs: the teacher's :class:`~xtoken_core.losses.inputs.LossInputs`.
            projection: the teacher's projection on the logits' device, checked against V, W.

        Returns:
            :class:`KDTerms`.
        """

    @abstractmethod
    def kernel(
        self,
        inputs: LossInputs,
        projection: Projection,
        *,
        plan: ChunkPlan,
        num_valid: int | None = None,
        row_lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> KDTerms:
        """The KD sums of one teacher by the Triton kernels.

        Args:
            inputs: the teacher's :class:`~xtoken_core.losses.inputs.LossInputs`, whose ids and
                validity are the plan's.
            projection: the teacher's projection on the logits' device, checked against V, W.
            plan: the teacher's :class:`~xtoken_core.kernels.chunk_plan.ChunkPlan` (shifted
                ids, validity, N and both sides' rows, on the device).
            num_valid: N on the host (given to modes with :attr:`row_logsumexps`), else None.
            row_lse: ``(student [B*T], teacher [B*U])`` fp32 row logsumexps of ``z / T`` over
                every row (given to modes with :attr:`row_logsumexps`), else None.

        Returns:
            :class:`KDTerms`.
        """

    def cpu(self, inputs: LossInputs, projection: Projection, *, stats: Any = None) -> KDTerms:
        """The KD sums of one teacher on the CPU path
        (:mod:`xtoken_core.losses.backends.cpu`): the reference's math with fewer passes over
        CPU logits (fp32/bf16/fp16). A mode without one runs its :meth:`reference` (this
        default).

        Args:
            inputs: the teacher's :class:`~xtoken_core.losses.inputs.LossInputs`.
            projection: the teacher's projection, checked against V, W.
            stats: the call's :class:`~xtoken_core.losses.backends.cpu.RowStats` of the
                student logits.

        Returns:
            :class:`KDTerms`.
        """
        return self.reference(inputs, projection)

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
