"""Cross-tokenizer losses: reference PyTorch implementations and the public loss API."""

from xtoken_core.losses.config import CrossTokenizerLossConfig
from xtoken_core.losses.loss import METRIC_KEYS, CrossTokenizerLoss
from xtoken_core.losses.utils import Fp32SparseMM, dp_all_reduce_sum, shift_chunk_ids

__all__ = [
    "METRIC_KEYS",
    "CrossTokenizerLoss",
    "CrossTokenizerLossConfig",
    "Fp32SparseMM",
    "dp_all_reduce_sum",
    "shift_chunk_ids",
]
