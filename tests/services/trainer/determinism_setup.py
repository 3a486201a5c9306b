"""Helpers of the tests of ``trainer.compute.deterministic``: the process settings it changes,
restored after a test, and bitwise comparisons of losses and weights."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@contextlib.contextmanager
def restored_process_settings() -> Iterator[None]:
    """Put back what :func:`services.trainer.determinism.configure` changes: the deterministic
    algorithms (and warn-only), cuDNN's flags, ``CUBLAS_WORKSPACE_CONFIG`` and the RNG states."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(CUBLAS),
        torch.get_rng_state(),
        np.random.get_state(),
        random.getstate(),
    )
    try:
        yield
    finally:
        algorithms, warn_only, cudnn_deterministic, benchmark, cublas, rng, np_rng, py_rng = saved
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = benchmark
        if cublas is None:
            os.environ.pop(CUBLAS, None)
        else:
            os.environ[CUBLAS] = cublas
        torch.set_rng_state(rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)


def bits(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor (on the host): equal bytes are bitwise-equal values (-0.0 and 0.0
    differ, NaNs of one payload match)."""
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def weight_bits(module: torch.nn.Module) -> dict[str, bytes]:
    """Every parameter and buffer of a module by name, as :func:`bits`."""
    return {name: bits(t) for name, t in module.state_dict().items()}


def hex_losses(values: list[float]) -> list[str]:
    """Losses as exact hex strings (``float.hex``): equal strings are bitwise-equal doubles."""
    return [float(v).hex() for v in values]
