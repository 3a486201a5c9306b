"""Causal LMs offline: loading (folder, preset, smollm2, GGUF, dropped layers), dtypes, output-layer
split, eval; document masks of packed rows in ``documents``.

The names load on first use (``xtoken_core.lazy``): a config that checks a dtype name
(``dtypes.py``) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xtoken_core.lazy import lazy_names

if TYPE_CHECKING:
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
    from xtoken_core.models.vocab import check_vocab, model_vocab_size, preset_vocab_size

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
    "preset_vocab_size",
    "resolve_dtype",
    "split_lm_head",
]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "GGUF_PRESETS": "xtoken_core.models.gguf",
        "PRESETS": "xtoken_core.models.presets",
        "Preset": "xtoken_core.models.presets",
        "bits_per_byte": "xtoken_core.models.eval",
        "check_model_dir": "xtoken_core.models.loading",
        "check_vocab": "xtoken_core.models.vocab",
        "drop_layers": "xtoken_core.models.layer_drop",
        "export_hf": "xtoken_core.models.loading",
        "exported_tokenizer": "xtoken_core.models.loading",
        "load_model": "xtoken_core.models.loading",
        "load_output_layer": "xtoken_core.models.loading",
        "model_spec_names": "xtoken_core.models.loading",
        "model_vocab_size": "xtoken_core.models.vocab",
        "preset_vocab_size": "xtoken_core.models.vocab",
        "resolve_dtype": "xtoken_core.models.dtypes",
        "split_lm_head": "xtoken_core.models.heads",
    },
)
