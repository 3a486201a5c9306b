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
