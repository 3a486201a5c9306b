"""Real tokenizers loaded offline, with exact byte spans of tokens (see spans.py for the rules)."""

from xtoken_core.tokenizers.base import (
    ROLE_BOS,
    ROLE_CODES,
    ROLE_CONTENT,
    ROLE_EOS,
    ROLE_NAMES,
    ROLE_PAD,
    ROLE_SPECIAL,
    TokenizedText,
    XTokenizer,
)
from xtoken_core.tokenizers.registry import available_tokenizers, bundled_path, load_tokenizer

__all__ = [
    "ROLE_BOS",
    "ROLE_CODES",
    "ROLE_CONTENT",
    "ROLE_EOS",
    "ROLE_NAMES",
    "ROLE_PAD",
    "ROLE_SPECIAL",
    "TokenizedText",
    "XTokenizer",
    "available_tokenizers",
    "bundled_path",
    "load_tokenizer",
]
