"""What a test needs beyond the core install: a test that lacks an optional package skips with
the line that installs it (a GPU machine's image may not carry the tokenizer packages that the
CPU suite's install does)."""

from __future__ import annotations

import importlib.util

import pytest


def missing_tokenizers(*names: str) -> str | None:
    """Why the tokenizers ``names`` cannot load here, with the line that installs what is
    missing; None when all of them can.

    Args:
        names: short tokenizer names (``smollm2``, ``mistral``...).
    """
    from xtoken_core.tokenizers import registry

    for name in names:
        try:
            registry.bundled_path(name)
        except ValueError as e:
            return str(e)
        entry = registry.BUNDLED[name]
        if entry.kind == "gguf" and importlib.util.find_spec("gguf") is None:
            return (
                f"tokenizer {name!r} is read from its GGUF by the 'gguf' package, which is not "
                f"installed; install it with `{entry.install_command}`"
            )
    return None


def require_tokenizers(*names: str) -> None:
    """Skip the calling test, naming the install line, unless the tokenizers ``names`` load."""
    reason = missing_tokenizers(*names)
    if reason is not None:
        pytest.skip(reason)
