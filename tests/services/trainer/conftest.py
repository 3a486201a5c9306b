"""Fixtures of the trainer tests: the test projection file (built once)."""

from __future__ import annotations

import pytest

from tests.services.trainer import distill_setup as setup


@pytest.fixture(scope="session")
def projection(tmp_path_factory) -> str:
    """A top-4 projection of the test tokenizers (mistral student, smollm2 teacher)."""
    return setup.write_projection(tmp_path_factory.mktemp("projection") / "proj.pt")
