"""Cross-tokenizer losses: the public loss API (loss.py) and its settings (config.py); one module
per KD mode (modes/: each mode's PyTorch reference, kernel path and CPU path, and their
registry); one module per backend that runs a mode over every teacher (backends/: the reference,
the Triton kernels, the CPU path), chosen once when a loss is built; the records they take
(inputs.py), the alignment and chunk plumbing (alignment.py), the input checks (checks.py), the
DP count (distributed.py); the fused output head (fused_head.py, head_blocks.py).

The public names load on first use (``xtoken_core.lazy``), so that importing the config alone
(``xtoken_core.losses.config``, which runs this file first) imports no torch or Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xtoken_core.lazy import lazy_names

if TYPE_CHECKING:
    from xtoken_core.losses.alignment import shift_chunk_ids
    from xtoken_core.losses.backends import student_ce
    from xtoken_core.losses.backends.reference import Fp32SparseMM
    from xtoken_core.losses.config import CrossTokenizerLossConfig
    from xtoken_core.losses.distributed import dp_all_reduce_sum
    from xtoken_core.losses.fused_head import FusedHead
    from xtoken_core.losses.loss import (
        METRIC_KEYS,
        TEACHER_METRICS,
        CrossTokenizerLoss,
        teacher_metric_keys,
    )

__all__ = [
    "METRIC_KEYS",
    "TEACHER_METRICS",
    "CrossTokenizerLoss",
    "CrossTokenizerLossConfig",
    "Fp32SparseMM",
    "FusedHead",
    "dp_all_reduce_sum",
    "shift_chunk_ids",
    "student_ce",
    "teacher_metric_keys",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "METRIC_KEYS": "xtoken_core.losses.loss",
        "TEACHER_METRICS": "xtoken_core.losses.loss",
        "CrossTokenizerLoss": "xtoken_core.losses.loss",
        "CrossTokenizerLossConfig": "xtoken_core.losses.config",
        "FusedHead": "xtoken_core.losses.fused_head",
        "Fp32SparseMM": "xtoken_core.losses.backends.reference",
        "dp_all_reduce_sum": "xtoken_core.losses.distributed",
        "shift_chunk_ids": "xtoken_core.losses.alignment",
        "student_ce": "xtoken_core.losses.backends",
        "teacher_metric_keys": "xtoken_core.losses.loss",
    },
)
