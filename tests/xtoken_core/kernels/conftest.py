"""Kernel tests: without CUDA, run Triton kernels in the interpreter, for these tests only.

The interpreter is switched on per test (``monkeypatch.setenv``), not for the whole pytest
process, so that other tests that happen to call a kernel on CPU tensors keep the fast PyTorch
fallback. Kernels must therefore pick the mode at launch time: wrap them with
``xtoken_core.kernels._utils.lazy_jit`` instead of ``triton.jit`` (a module-level ``@triton.jit``
is pinned to whatever ``TRITON_INTERPRET`` was when it was imported).
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _triton_interpreter_without_cuda(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def no_interpreter(monkeypatch):
    """Run the test on the plain CPU path (no CUDA, no interpreter): the reference fallback."""
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback path is only taken without CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
