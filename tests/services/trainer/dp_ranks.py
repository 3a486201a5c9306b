"""A data-parallel rank for the gradient test, run by torch.multiprocessing.spawn: gloo process
group, one TrainerWorker step over this rank's micro-batches, the gradients the optimizer saw."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tests.services.trainer import distill_setup as setup


def capture_step_gradients(worker, micro_batches) -> dict[str, torch.Tensor]:
    """Run one ``train_step`` and return the gradients as ``optimizer.step`` received them."""
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs) -> None:
        for name, p in worker.module.named_parameters():
            grads[name] = p.grad.detach().clone()

    hook = worker.optimizer.register_step_pre_hook(capture)
    try:
        result = worker.train_step(micro_batches)
    finally:
        hook.remove()
    assert not result.skipped and grads, "the optimizer never stepped"
    return grads


def run_rank(
    rank: int,
    world: int,
    port: int,
    projection: str,
    plan: list[list[int]],
    out: str,
    device: str = "cpu",
):
    """Rank ``rank`` trains micro-batches ``plan[rank]`` (indices into ``micro_batches()``);
    ``device="cuda"``: NCCL, one GPU per rank."""
    from services.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        worker = TrainerWorker(
            setup.trainer_config(projection, grad_accum=len(plan[rank]), device=device),
            rank=rank,
            world_size=world,
            device=f"cuda:{rank}" if device == "cuda" else "cpu",
        )
        batches = setup.micro_batches()
        mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in plan[rank]]
        if device == "cuda":
            for mb in mbs:
                logits = mb.teacher_logits
                mb.teacher_logits = lambda f=logits: f().to(worker.device)
        grads = capture_step_gradients(worker, mbs)
        torch.save({k: v.cpu() for k, v in grads.items()}, f"{out}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
