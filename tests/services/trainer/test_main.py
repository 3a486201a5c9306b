"""The trainer shell's pieces that run without a queue: a CUDA trainer's step flags are summed on
the host."""

from __future__ import annotations

import datetime
import pathlib
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _flags_rank(rank: int, port: int, out: str) -> None:
    from services.trainer import main

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        main._host_group(torch.device("cuda"))  # a CUDA trainer's: made, though no GPU is used
        made = main._HOST_GROUP is not None
        flags = main._all_reduce_flags([float(rank == 0), 1.0], torch.device("cuda"), 2)
        torch.save({"made": made, "flags": flags}, f"{out}.rank{rank}.pt")
    finally:
        main._HOST_GROUP = None
        dist.destroy_process_group()


def test_a_cuda_trainer_sums_the_step_flags_on_the_host(tmp_path):
    # the flags of a CUDA run go through a gloo group: an NCCL sum read back would wait for the
    # GPU work queued before it (the step before's)
    root = str(pathlib.Path(__file__).resolve().parents[3])
    if root not in sys.path:
        sys.path.insert(0, root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "flags")
    mp.spawn(_flags_rank, args=(port, out), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}.pt", weights_only=True)
        assert got["made"] and got["flags"] == [1.0, 2.0]
