"""Cross-tokenizer losses: the public loss API (loss.py, config.py) over two KD engines, the
PyTorch reference (engine.py over reference.py) and the Triton kernels (kernel_engine.py over
fused.py)."""

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
