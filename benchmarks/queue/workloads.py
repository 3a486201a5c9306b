"""Workloads of the queue benchmark, shared by our side and the TransferQueue harness (torch only).

Legend: N samples, L_i tokens of sample i, R = sum L_i, H hidden width (64).
"""

from __future__ import annotations

import pathlib

import torch

HIDDEN = 64
W1_SAMPLES = 64
W1_MIN_LEN, W1_MAX_LEN = 512, 4096
W2_SAMPLES = 4096
W2_BATCH = 64
W2_MIN_LEN, W2_MAX_LEN = 10, 30  # ~20 tokens
FIELDS = ("input_ids", "hidden")


def lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """N lengths uniform in [low, high] (inclusive), reproducible across processes.

    Args:
        n: number of samples.
        low: shortest length.
        high: longest length.
        seed: generator seed.

    Returns:
        N ints.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def columns(lengths_N: list[int], seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Field -> (values, offsets) of one batch: input_ids int64 [R], hidden float32 [R, H].

    Args:
        lengths_N: the N sample lengths.
        seed: generator seed of the values.

    Returns:
        ``{"input_ids": (values [R], offsets [N+1]), "hidden": (values [R, H], offsets [N+1])}``.
    """
    g = torch.Generator().manual_seed(seed)
    offsets_N1 = torch.zeros(len(lengths_N) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths_N, dtype=torch.int64), 0, out=offsets_N1[1:])
    total = int(offsets_N1[-1])
    ids_R = torch.randint(0, 150_000, (total,), generator=g, dtype=torch.int64)
    hidden_RH = torch.randn(total, HIDDEN, generator=g, dtype=torch.float32)
    return {"input_ids": (ids_R, offsets_N1), "hidden": (hidden_RH, offsets_N1.clone())}


def nbytes(cols: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Payload bytes of a batch (values only: what a sample is made of)."""
    return sum(v.numel() * v.element_size() for v, _ in cols.values())


def jagged(cols: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The columns as ``xtoken_core.wire.JaggedColumn`` fields (imported here: the
    TransferQueue harness runs without xtoken)."""
    from xtoken_core.wire import JaggedColumn

    return {name: JaggedColumn(values, offsets) for name, (values, offsets) in cols.items()}


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
