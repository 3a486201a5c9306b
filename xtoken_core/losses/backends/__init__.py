"""The loss backends, one module each: :mod:`~.reference` (the PyTorch reference),
:mod:`~.kernel` (the Triton kernels) and :mod:`~.cpu` (the CPU path), over the seam of
:mod:`~.base`. :func:`choose_backend` picks one once, where a loss is built (a new backend is its
module and a line there); :func:`student_ce` is the student CE alone, for callers without a loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xtoken_core.kernels import row_ce
from xtoken_core.kernels._utils import triton
from xtoken_core.losses.backends import cpu
from xtoken_core.losses.backends.base import Backend
from xtoken_core.losses.backends.cpu import CpuBackend
from xtoken_core.losses.backends.kernel import KernelBackend, kernels_run_on
from xtoken_core.losses.backends.reference import ReferenceBackend, student_ce_loss

if TYPE_CHECKING:
    from xtoken_core.losses.config import CrossTokenizerLossConfig
    from xtoken_core.losses.modes.base import KDMode

__all__ = ["Backend", "choose_backend", "student_ce"]


def choose_backend(
    config: CrossTokenizerLossConfig, mode: KDMode, reference: ReferenceBackend
) -> Backend:
    """The loss's backend, chosen once from ``config.backend`` and the machine: "reference" the
    reference; "kernel" the kernels wherever Triton is installed (they run on CUDA, or on the
    CPU under ``TRITON_INTERPRET=1``); "auto" the kernels where CUDA is available, else the CPU
    path.

    Args:
        config: the loss settings.
        mode: the loss's KD mode.
        reference: the loss's reference backend (returned when it is the choice).

    Returns:
        The backend.
    """
    kernels = triton is not None and (
        config.backend == "kernel" or (config.backend == "auto" and torch.cuda.is_available())
    )
    if kernels:
        return KernelBackend(config, mode)
    return CpuBackend(config, mode) if config.backend == "auto" else reference


def student_ce(
    student_logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    token_mask_BT: torch.Tensor | None = None,
    sample_mask_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student next-token CE, summed, on the backend its logits take (the CE alone has no loss
    to choose one). See :func:`~xtoken_core.losses.backends.reference.student_ce_loss`.

    The row kernels (:func:`~xtoken_core.kernels.row_ce.row_cross_entropy`: each row's
    logsumexp, target logit and argmax on the logits in their own dtype; no fp32 copy, no
    log-softmax) where they run (:func:`~xtoken_core.losses.backends.kernel.kernels_run_on`);
    else CPU logits take the CPU path (:func:`~xtoken_core.losses.backends.cpu.student_ce`: the
    same sums with one read of the exponentials per pass, no fp32 copy); else the reference
    (fp64 logits stay fp64).

    Args:
        student_logits_BTV: ``[B, T, V]`` logits (gradient flows here).
        input_ids_BT: ``[B, T]`` student token ids; the logits at p predict ``input_ids[:, p + 1]``.
        token_mask_BT: ``[B, T]`` (None: every token counts).
        sample_mask_B: ``[B]`` (None: every sample counts).

    Returns:
        ``(nll_sum, correct, num_tokens)`` scalars; only ``nll_sum`` carries gradient.
    """
    targets = (input_ids_BT, token_mask_BT, sample_mask_B)
    if kernels_run_on(student_logits_BTV):
        return row_ce.row_cross_entropy(student_logits_BTV, *targets)
    if cpu.cpu_path_available(student_logits_BTV):
        return cpu.student_ce(student_logits_BTV, *targets)
    return student_ce_loss(student_logits_BTV, *targets)
