"""Triton kernels with their PyTorch references (CPU fallback when Triton or CUDA is missing)."""

from xtoken_core.kernels.chunk_log_softmax import (
    chunk_avg_log_softmax,
    chunk_avg_log_softmax_reference,
)
from xtoken_core.kernels.projection_gather import (
    GatherIndex,
    build_gather_index,
    project_by_gather,
    project_reference,
)

__all__ = [
    "GatherIndex",
    "build_gather_index",
    "chunk_avg_log_softmax",
    "chunk_avg_log_softmax_reference",
    "project_by_gather",
    "project_reference",
]
