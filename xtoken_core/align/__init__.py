"""The exact token aligner and AlignmentBatch (see aligner.py for the rules)."""

from xtoken_core.align.aligner import TokenAligner
from xtoken_core.align.batch import (
    ALIGNMENT_FIELDS,
    AlignmentBatch,
    SampleAlignment,
    alignment_stats,
)

__all__ = [
    "ALIGNMENT_FIELDS",
    "AlignmentBatch",
    "SampleAlignment",
    "TokenAligner",
    "alignment_stats",
]
