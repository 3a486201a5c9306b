"""Causal LMs offline: loading (folder, preset, smollm2), dtypes, output-layer split, eval."""

from xtoken_core.models.dtypes import resolve_dtype
from xtoken_core.models.eval import bits_per_byte
from xtoken_core.models.heads import split_lm_head
from xtoken_core.models.loading import (
    check_model_dir,
    export_hf,
    exported_tokenizer,
    load_model,
    load_output_layer,
)
from xtoken_core.models.presets import PRESETS, Preset
from xtoken_core.models.vocab import check_vocab, model_vocab_size

__all__ = [
    "PRESETS",
    "Preset",
    "bits_per_byte",
    "check_model_dir",
    "check_vocab",
    "export_hf",
    "exported_tokenizer",
    "load_model",
    "load_output_layer",
    "model_vocab_size",
    "resolve_dtype",
    "split_lm_head",
]
