"""Trainer process shell: process group, device, queue client, launch id and lifecycle."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from services.common.lifecycle import Lifecycle
from services.queue.client import connect
from services.trainer import determinism
from services.trainer.config import TrainerConfig
from services.trainer.trainer import Ranks, Trainer
from xtoken_core.data.corpus import read_texts

logger = logging.getLogger(__name__)


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment (0, 1, 0 without it)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world, local


def _all_reduce_flags(flags: list[float], device: torch.device, world: int) -> list[float]:
    """Sum the ranks' step flags (has data, stop). On the host (gloo) where there is a host group
    (:func:`_host_group`): an NCCL sum read back would wait for the GPU work queued before it,
    the step before's included, and leave the GPU idle while the next step is claimed."""
    if world == 1:
        return flags
    on_host = _HOST_GROUP is not None or device.type != "cuda"
    t = torch.tensor(flags, dtype=torch.float64, device="cpu" if on_host else device)
    dist.all_reduce(t, group=_HOST_GROUP)
    return t.tolist()


_HOST_GROUP: Any = None  # a gloo group of the trainer ranks beside their NCCL one


def _host_group(device: torch.device) -> None:
    """Make the host group of the step flags (collective; on CUDA only: CPU runs are gloo)."""
    global _HOST_GROUP
    if device.type != "cuda":
        return
    try:
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    except Exception as e:  # no usable network interface for gloo: the flags go by NCCL
        logger.warning("[trainer] no gloo group for the step flags (%s); using NCCL", e)


def serve(config: TrainerConfig, lc: Lifecycle) -> int:
    """Train until ``schedule.max_steps``, the end of the data (all epochs) or a stop; returns 0.

    torchrun-compatible: the rank, world size and local rank come from ``RANK``, ``WORLD_SIZE``
    and ``LOCAL_RANK`` (``MASTER_ADDR`` / ``MASTER_PORT`` for the rendezvous); NCCL on CUDA, gloo
    on CPU, and a gloo group beside NCCL for the step flags; ``compute.deterministic`` sets the
    process's deterministic algorithms and seeds first (:mod:`services.trainer.determinism`).
    The training is the :class:`~services.trainer.trainer.Trainer`'s; the shell gives it the
    queue client, this rank's place in the group with its host collectives, the stop event of
    SIGTERM and the launch's name.
    """
    rank, world, local = dist_env()
    # before the device is touched: cuBLAS's workspace setting is read at its first call
    determinism.configure(config.compute.deterministic, config.student.seed)
    device = torch.device(config.compute.device)
    if device.type == "cuda":
        device = torch.device("cuda", local if device.index is None else device.index)
        torch.cuda.set_device(device)
    if world > 1:
        # a rank may wait for its slowest teacher's answer while the others wait in a collective
        wait_s = max(t.link.timeout_s for t in config.teachers())
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=max(600.0, 2 * wait_s)),
        )
        _host_group(device)
    try:
        return _train(config, lc, rank, world, device)
    finally:
        global _HOST_GROUP
        _HOST_GROUP = None
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainerConfig, lc: Lifecycle, rank: int, world: int, device) -> int:
    # bad input first: a held-out file without text fails before the queue and the model; under
    # FSDP every rank takes part in the eval forward (the parameters are sharded)
    evaluates = rank == 0 or (world > 1 and config.compute.parallel == "fsdp")
    ev = config.eval
    heldout = read_texts(ev.heldout, ev.texts) if evaluates and ev.heldout and ev.texts else []
    # stopping, it tries nothing twice: a queue that went away costs no retries (trainer.py)
    client = connect(
        config.queue, timeout_s=config.feed.queue_timeout_s, name=f"trainer{rank}",
        setting="feed.queue_timeout_s", stopping=lc.stop,
    )  # fmt: skip
    ranks = Ranks()
    if world > 1:
        ranks = Ranks(
            rank,
            world,
            sum=lambda flags: _all_reduce_flags(flags, device, world),
            barrier=dist.barrier,
        )
    # this launch's name in its consumer tasks: no earlier launch used it, so what a dead launch
    # held leased is pending for this one at once (its leases lapse unseen)
    trainer = Trainer(
        config,
        client,
        heldout=heldout,
        ranks=ranks,
        device=device,
        stop=lc.stop,
        launch=_launch_id(world),
    )
    lc.ready(rank=rank, world_size=world, step=trainer.student.step)
    trainer.train()
    client.close()
    return 0


def _launch_id(world: int) -> str:
    """A name for this launch of the trainer group, the same on every rank (rank 0's, sent to
    the others): a fresh process-instance id (``<pid>-<8 hex>``)."""
    from services.protocol.names import new_instance

    ids = [new_instance()]
    if world > 1:
        dist.broadcast_object_list(ids, src=0, group=_HOST_GROUP)
    return ids[0]
