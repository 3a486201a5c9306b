"""Shared pytest set-up: offline hub, the gpu marker skips without CUDA, repeatable property
tests."""

import os

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests draw the same examples on every run, so a run's verdict is the code's, not the
# draw's; XTOKEN_HYPOTHESIS=explore draws new ones each run (to look for cases, then pin them).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(
    "explore" if os.environ.get("XTOKEN_HYPOTHESIS") == "explore" else "repeatable"
)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Triton's interpreter before its fix for triton-lang/triton#9171 turns a scalar kernel argument
# into a one-element array and then calls int() on it, which NumPy 2.4 refuses (the deprecation
# of NumPy 1.25 became a TypeError). Such a test says so and is skipped, not failed: the kernel
# is not at fault, and the same test runs compiled on a GPU.
_INTERPRETER_NUMPY_CLASH = (
    "only 0-dimensional arrays can be converted to Python scalars",
    "Conversion of an array with ndim > 0 to a scalar",
)


def _interpreter_numpy_clash(exc: BaseException | None) -> bool:
    while exc is not None:
        if type(exc).__name__ == "InterpreterError" and any(
            m in str(exc) for m in _INTERPRETER_NUMPY_CLASH
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    excinfo = outcome.excinfo
    if excinfo is not None and _interpreter_numpy_clash(excinfo[1]):
        import numpy
        import triton

        outcome.force_exception(
            pytest.skip.Exception(
                f"Triton {triton.__version__}'s interpreter cannot run under NumPy "
                f"{numpy.__version__} (triton-lang/triton#9171): use numpy<2.4 or a Triton with "
                "its fix to run it interpreted"
            )
        )
