"""Fixtures of the trainer tests: the test projection file (built once)."""

from __future__ import annotations

import pytest

from tests.services.trainer import distill_setup as setup


@pytest.fixture(scope="session")
def projection(tmp_path_factory) -> str:
    """A top-4 projection of the test tokenizers (mistral student, smollm2 teacher); the tests
    that take it skip with the install line where a tokenizer's package is not installed (a bare
    GPU machine)."""
    try:
        return setup.write_projection(tmp_path_factory.mktemp("projection") / "proj.pt")
    except ValueError as e:
        if "needs the PyPI package" not in str(e):
            raise
        pytest.skip(str(e))
