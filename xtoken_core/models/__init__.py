"""Causal LMs offline: loading (folder, preset, smollm2, GGUF, dropped layers), dtypes, output-layer
split, eval; document masks of packed rows in ``documents``."""

from xtoken_core.models.dtypes import resolve_dtype
from xtoken_core.models.eval import bits_per_byte
from xtoken_core.models.gguf import GGUF_PRESETS
from xtoken_core.models.heads import split_lm_head
from xtoken_core.models.layer_drop import drop_layers
from xtoken_core.models.loading import (
    check_model_dir,
    export_hf,
    exported_tokenizer,
    load_model,
    load_output_layer,
    model_spec_names,
)
from xtoken_core.models.presets import PRESETS, Preset
from xtoken_core.models.vocab import check_vocab, model_vocab_size

__all__ = [
    "GGUF_PRESETS",
    "PRESETS",
    "Preset",
    "bits_per_byte",
    "check_model_dir",
    "check_vocab",
    "drop_layers",
    "export_hf",
    "exported_tokenizer",
    "load_model",
    "load_output_layer",
    "model_spec_names",
    "model_vocab_size",
    "resolve_dtype",
    "split_lm_head",
]
