"""Cross-tokenizer losses: the public loss API (loss.py, config.py); one module per KD mode
(modes/: each mode's PyTorch reference, kernel path and CPU path, and their registry); three
engines that run a mode over every teacher, the reference (engine.py), the Triton kernels
(kernel_engine.py) and the CPU path (cpu_engine.py); the shared reference pieces
(reference.py), kernel plumbing (fused.py), CPU plumbing (cpu.py) and chunk plumbing (utils.py);
the fused output head (fused_head.py, head_blocks.py)."""

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
