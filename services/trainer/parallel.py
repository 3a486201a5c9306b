"""Data parallel: the student under DDP or FSDP2, and the collectives its step and export need."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from services.trainer.compile import decoder_layers
from services.trainer.precision import MasterWeights, fp32_allreduce_hook


def parallelize(
    module: torch.nn.Module,
    *,
    parallel: str,
    world_size: int,
    device: torch.device,
    param_dtype: torch.dtype,
    master: MasterWeights | None,
) -> torch.nn.Module:
    """The model the step runs on: ``module`` itself on one rank, wrapped in DDP or sharded by
    FSDP2 on several (needs an initialized process group).

    Gradients are summed over the ranks, never averaged: the loss is already divided by the global
    denominators (DDP's average is undone by the step's loss scale, FSDP2 is told to sum).

    Args:
        module: the compute model.
        parallel: ``ddp`` or ``fsdp``.
        world_size: data-parallel size.
        device: this rank's device.
        param_dtype: the compute dtype (FSDP2 gathers the sharded fp32 parameters in it).
        master: the fp32 masters of a low-precision compute copy (DDP), or None.
    """
    if world_size == 1:
        return module
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # the mesh of the trainer's device: without one FSDP2 shards onto CUDA whenever the
        # machine has it, also for a CPU trainer (its logits then land on another device)
        mesh = init_device_mesh(device.type, (world_size,))
        # sharded fp32 parameters, gathered in the compute dtype, gradients reduced in fp32
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype == torch.float32:
            policy = MixedPrecisionPolicy()
        sharded = [
            fully_shard(layer, mesh=mesh, mp_policy=policy) for layer in decoder_layers(module)
        ]
        sharded.append(fully_shard(module, mesh=mesh, mp_policy=policy))
        for m in sharded:  # per FSDP module: these setters do not recurse
            # the loss is already divided by the global denominators: the ranks' gradients
            # must be summed, where FSDP2 averages them by default (gradients, their norm and
            # so the clipping 1/world_size off); a plain SUM, not the PREMUL_SUM(1) that a
            # factor alone picks, which only NCCL has
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    if master is not None:  # the bf16 gradients: views of the buckets for the run
        master.hold_grads()
    ddp = DistributedDataParallel(
        module, device_ids=ids, gradient_as_bucket_view=master is not None
    )
    if master is not None and world_size > 2:
        # bf16 gradients summed in fp32 over the ranks; two ranks' sum is one bf16 addition
        # (rounded once), the number the fp32 sum rounds to, at half the bytes
        ddp.register_comm_hook(None, fp32_allreduce_hook)
    return ddp


def gradient_sync(
    model: Any, *, parallel: str, world_size: int, last: bool
) -> contextlib.AbstractContextManager:
    """The context of a micro-batch's backward: the gradients are synchronized over the ranks on
    the step's last micro-batch only."""
    if world_size == 1 or last:
        if parallel == "fsdp" and world_size > 1:
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if parallel == "fsdp":
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    return model.no_sync()


def most_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` of any rank (collective)."""
    import torch.distributed as dist

    t = torch.tensor(n, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of an FSDP2 model on the CPU (collective: gathered on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
