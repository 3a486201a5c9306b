"""The records the loss's paths take: one teacher's inputs as the loss prepared them for a backend
(:class:`TeacherInputs`), and the tensors every mode path computes one teacher's KD sums over
(:class:`LossInputs`).

Legend (shape suffixes in this file):
    B batch, T student tokens, U teacher tokens, V student vocab, W teacher vocab, C chunk slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from xtoken_core.data.projection import Projection
    from xtoken_core.kernels.chunk_plan import ChunkPlan
    from xtoken_core.losses.alignment import AlignmentView

__all__ = ["LossInputs", "TeacherInputs"]


@dataclass(frozen=True)
class TeacherInputs:
    """One teacher's inputs to a backend, prepared and checked by the loss.

    Attributes:
        index: the teacher's position (its weight, denominator and projection).
        name: how messages name its logits ("teacher_logits" or "teacher_logits[i]").
        logits_BUW: ``[B, U, W]`` logits sliced to the teacher vocab (constants).
        alignment: its alignment (raw, unshifted chunk ids).
        projection: its :class:`~xtoken_core.data.projection.Projection` on the logits' device,
            checked against V and W.
        weight: its weight in the sum over teachers.
        sample_mask_B: ``[B]``, the samples that count (None: all).
        denominator_1: ``[1]`` its valid-chunk count over the global batch, on the logits'
            device (None: this micro-batch's own count).
    """

    index: int
    name: str
    logits_BUW: torch.Tensor
    alignment: AlignmentView
    projection: Projection
    weight: float
    sample_mask_B: torch.Tensor | None
    denominator_1: torch.Tensor | None

    @property
    def vocab_size(self) -> int:
        """W, the teacher logits' width."""
        return int(self.logits_BUW.shape[-1])

    @property
    def denominator_name(self) -> str:
        """How the checks name :attr:`denominator_1` ("global_valid_chunks" or
        "global_valid_chunks[i]", like :attr:`name`)."""
        return "global_valid_chunks" + self.name.removeprefix("teacher_logits")


@dataclass(frozen=True)
class LossInputs:
    """The tensors a mode computes one teacher's KD sums over, on every path (reference, kernel,
    CPU).

    Attributes:
        student_logits_BTV: ``[B, T, V]`` student logits (gradient flows here).
        teacher_logits_BUW: ``[B, U, W]`` teacher logits sliced to the teacher vocab (constants).
        student_chunk_id_BT: ``[B, T]`` shifted student chunk ids
            (:func:`~xtoken_core.losses.alignment.shift_chunk_ids`).
        teacher_chunk_id_BU: ``[B, U]`` shifted teacher chunk ids.
        valid_BC: ``[B, C]`` bool, the valid chunks
            (:func:`~xtoken_core.losses.alignment.chunk_validity`).
    """

    student_logits_BTV: torch.Tensor
    teacher_logits_BUW: torch.Tensor
    student_chunk_id_BT: torch.Tensor
    teacher_chunk_id_BU: torch.Tensor
    valid_BC: torch.Tensor

    @classmethod
    def planned(
        cls, student_logits_BTV: torch.Tensor, teacher_logits_BUW: torch.Tensor, plan: ChunkPlan
    ) -> LossInputs:
        """The inputs whose ids and validity are a chunk plan's (the kernel backend's).

        Args:
            student_logits_BTV: ``[B, T, V]`` student logits.
            teacher_logits_BUW: ``[B, U, W]`` teacher logits.
            plan: the teacher's :class:`~xtoken_core.kernels.chunk_plan.ChunkPlan`.

        Returns:
            :class:`LossInputs`.
        """
        return cls(
            student_logits_BTV,
            teacher_logits_BUW,
            plan.student_chunk_id_BT,
            plan.teacher_chunk_id_BU,
            plan.valid_BC,
        )

    @property
    def vocab_sizes(self) -> tuple[int, int]:
        """``(V, W)``, the widths of the student and teacher logits."""
        return int(self.student_logits_BTV.shape[-1]), int(self.teacher_logits_BUW.shape[-1])
