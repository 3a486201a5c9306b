"""XTokenizer over a Hugging Face ``tokenizers`` tokenizer.json (byte-level BPE and others)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from xtoken_core.tokenizers.base import ROLE_SPECIAL, XTokenizer

logger = logging.getLogger(__name__)


def gpt2_byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable unicode character -> raw byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _walk_types(node) -> list[str]:
    """All component ``type`` names in a tokenizer.json sub-tree (nested Sequences included)."""
    found: list[str] = []
    if isinstance(node, dict):
        if "type" in node:
            found.append(node["type"])
        for v in node.values():
            found.extend(_walk_types(v))
    elif isinstance(node, list):
        for v in node:
            found.extend(_walk_types(v))
    return found


def _token_content(value) -> str | None:
    """A tokenizer_config.json token entry (string or AddedToken dict) -> its content."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def without_prefix_space(spec: dict) -> dict | None:
    """A copy of a tokenizer.json spec that adds no space before the text, or None if none is added.

    Turns off the components that put a space (``▁`` / ``Ġ``) before the first word: a
    ``Metaspace`` pre-tokenizer's ``prepend_scheme`` / ``add_prefix_space``, a ``ByteLevel``
    pre-tokenizer's ``add_prefix_space``, and ``Prepend`` normalizers (Llama-2 style).

    Args:
        spec: the parsed tokenizer.json.

    Returns:
        The modified copy, or None when the spec adds no prefix space.
    """
    spec = json.loads(json.dumps(spec))
    changed = False

    def fix_pre(node):
        nonlocal changed
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "Sequence":
            for child in node.get("pretokenizers") or []:
                fix_pre(child)
        elif kind == "Metaspace":
            if node.get("prepend_scheme", "always") != "never":
                node["prepend_scheme"] = "never"
                changed = True
            if node.get("add_prefix_space"):
                node["add_prefix_space"] = False
                changed = True
        elif kind == "ByteLevel" and node.get("add_prefix_space"):
            node["add_prefix_space"] = False
            changed = True

    def fix_norm(node):
        nonlocal changed
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Prepend":
            changed = True
            return None
        if node.get("type") == "Sequence":
            kept = [fix_norm(child) for child in node.get("normalizers") or []]
            node["normalizers"] = [child for child in kept if child is not None]
        return node

    fix_pre(spec.get("pre_tokenizer"))
    spec["normalizer"] = fix_norm(spec.get("normalizer"))
    return spec if changed else None


class HFTokenizer(XTokenizer):
    """A tokenizer.json (HF ``tokenizers``) with exact byte spans.

    Token bytes: byte-level models (ByteLevel decoder or pre-tokenizer) map the GPT-2 alphabet
    back to raw bytes; otherwise ``<0xHH>`` byte-fallback pieces give that byte, ``▁`` gives a
    space (Metaspace / SentencePiece conversions), and other tokens their UTF-8 string (a
    WordPiece ``##`` prefix is dropped). Added special tokens give b"".

    BOS/EOS/pad ids come from a ``tokenizer_config.json`` beside the file when present, else from
    well-known names among the special added tokens.
    """

    def __init__(self, tokenizer_json: str | Path, name: str | None = None) -> None:
        """Load a tokenizer.json.

        Args:
            tokenizer_json: path to tokenizer.json (a tokenizer_config.json in the same folder
                is read for bos/eos/pad).
            name: display name (defaults to the path).

        Raises:
            ValueError: if the file is missing or not a tokenizer.json.
        """
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist; pass a tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"cannot load {str(path)!r} as a tokenizer.json: {exc}") from exc
        # Literal "<|endoftext|>" in training text is text, never a control token.
        self._tok.encode_special_tokens = True
        spec = json.loads(path.read_text(encoding="utf-8"))
        self._plain_tok = self._tok
        plain_spec = without_prefix_space(spec)
        if plain_spec is not None:
            self._plain_tok = Tokenizer.from_str(json.dumps(plain_spec))
            self._plain_tok.encode_special_tokens = True
        self.name = name or str(path)
        self.path = path  # the source file (hf_export.py rebuilds a transformers tokenizer from it)
        config_path = path.parent / "tokenizer_config.json"
        config = (
            json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        )
        self._init_tables(spec, config)
        self._finish_init()
        logger.info("[tokenizers] loaded %s (vocab_size=%d)", self.name, self.vocab_size)

    def _init_tables(self, spec: dict, config: dict) -> None:
        vocab = self._tok.get_vocab(with_added_tokens=True)
        added = spec.get("added_tokens") or []
        max_id = max(list(vocab.values()) + [a["id"] for a in added] + [-1])
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max_id + 1)
        id_to_token: list[str | None] = [None] * self.vocab_size
        for tok, tid in vocab.items():
            id_to_token[tid] = tok
        special_ids = {a["id"] for a in added if a.get("special", False)}

        types = set(_walk_types(spec.get("decoder"))) | set(_walk_types(spec.get("pre_tokenizer")))
        byte_level = "ByteLevel" in types
        byte_fallback = "ByteFallback" in types or bool(
            (spec.get("model") or {}).get("byte_fallback")
        )
        metaspace = "Metaspace" in types or any(
            (d or {}).get("pattern", {}).get("String") == "▁"
            for d in (spec.get("decoder") or {}).get("decoders", [])
        )
        wordpiece = (spec.get("model") or {}).get("type") == "WordPiece"
        self.is_byte_level = byte_level
        byte_decoder = gpt2_byte_decoder() if byte_level else None

        token_bytes: list[bytes] = []
        roles = np.zeros(self.vocab_size, dtype=np.int8)
        for tid, tok in enumerate(id_to_token):
            if tok is None or tid in special_ids:
                token_bytes.append(b"")
                roles[tid] = ROLE_SPECIAL
                continue
            if byte_decoder is not None:
                try:
                    token_bytes.append(bytes(byte_decoder[c] for c in tok))
                    continue
                except KeyError:
                    pass  # non-alphabet added token: its plain UTF-8 below
            if byte_fallback and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                token_bytes.append(bytes([int(tok[3:5], 16)]))
                continue
            if metaspace:
                tok = tok.replace("▁", " ")
            if wordpiece and tok.startswith("##"):
                tok = tok[2:]
            token_bytes.append(tok.encode("utf-8"))
        self._token_bytes = token_bytes
        self._roles = roles

        by_content = {a["content"]: a["id"] for a in added}
        by_content.update({k: v for k, v in vocab.items() if k not in by_content})

        def lookup(key: str, fallbacks: tuple[str, ...]) -> int | None:
            content = _token_content(config.get(key)) if key in config else None
            if content is not None:
                return by_content.get(content)
            if key in config:  # explicitly null in the config
                return None
            for cand in fallbacks:
                if cand in by_content and by_content[cand] in special_ids:
                    return by_content[cand]
            return None

        self.bos_id = lookup("bos_token", ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"))
        self.eos_id = lookup(
            "eos_token", ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]")
        )
        self.pad_id = lookup("pad_token", ("<pad>", "[PAD]"))
        for tid in (self.bos_id, self.eos_id, self.pad_id):
            if tid is not None:
                self._token_bytes[tid] = b""

    def _raw_encode(self, text: str, add_special_tokens: bool):
        return self._unpack(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def _raw_encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[tuple]:
        # One native call: Rust tokenizes the batch (in parallel where it has cores).
        encs = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [self._unpack(enc) for enc in encs]

    @staticmethod
    def _unpack(enc) -> tuple:
        """(ids, lazy offsets, chars): offsets are converted only when spans need them."""
        ids_N = np.asarray(enc.ids, dtype=np.int64)
        return ids_N, lambda: np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), True

    def encode_bytes_to_ids(self, text: str) -> list[int]:
        """Plain tokenization of ``text``: no special tokens, no prefix space (see the base).

        Args:
            text: any string.

        Returns:
            The token ids.
        """
        return list(self._plain_tok.encode(text, add_special_tokens=False).ids)

    def encode_batch_bytes_to_ids(self, texts: list[str]) -> list[list[int]]:
        """``encode_bytes_to_ids`` of several texts in one native (Rust, parallel) call.

        Args:
            texts: the texts.

        Returns:
            One id list per text, in order.
        """
        encs = self._plain_tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(enc.ids) for enc in encs]
