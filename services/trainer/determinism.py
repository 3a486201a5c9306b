"""Bitwise-reproducible trainer steps (``trainer.compute.deterministic``): the process-wide
PyTorch, cuDNN and cuBLAS settings and the seeds, set once by the trainer's shell before the
device is touched."""

from __future__ import annotations

import logging
import os
import random

import torch

logger = logging.getLogger(__name__)

#: cuBLAS's deterministic workspace settings (NVIDIA's "results reproducibility"): one buffer of
#: 4096 KiB x 8, or 16 KiB x 8; PyTorch refuses a cuBLAS call in deterministic mode without one
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def configure(deterministic: bool, seed: int) -> None:
    """Make this process's steps bitwise reproducible (nothing when ``deterministic`` is off).

    ``CUBLAS_WORKSPACE_CONFIG`` goes into the environment first (one of
    :data:`CUBLAS_DETERMINISTIC` given there is kept), then
    ``torch.use_deterministic_algorithms(True)``: an op without a deterministic algorithm raises
    instead of warning, and with it the flash and memory-efficient attention backwards, the
    index and scatter adds and Inductor's compiled layers take their ordered algorithms; cuDNN
    deterministic and unbenchmarked; torch (CPU and every CUDA device), numpy and ``random``
    seeded. Call it before the first CUDA call (the trainer's shell does, before it picks its
    device): PyTorch reads the cuBLAS setting at its first cuBLAS call.

    Args:
        deterministic: ``trainer.compute.deterministic``.
        seed: the run's seed (``trainer.student.seed``).
    """
    if not deterministic:
        return
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    seed_everything(seed)
    logger.info(
        "[trainer] deterministic: deterministic algorithms, cuDNN deterministic, "
        "CUBLAS_WORKSPACE_CONFIG=%s, seed %d",
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
        seed,
    )


def seed_everything(seed: int) -> None:
    """Seed torch (the CPU and every CUDA device), numpy's global generator and ``random``.

    Args:
        seed: the run's seed.
    """
    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
