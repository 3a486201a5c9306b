"""A data-parallel rank for the gradient tests, run by torch.multiprocessing.spawn: gloo (or NCCL)
process group, one student step over this rank's micro-batches under DDP or FSDP2, then the
full gradients the optimizer saw and the full parameters it left (and, given a checkpoint
directory, the parameters a fresh student loads back from a checkpoint of that step)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tests.sections import merged
from tests.services.trainer import distill_setup as setup


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor (an FSDP2 shard) gathered from every rank (collective)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_params(student) -> dict[str, torch.Tensor]:
    """Every parameter of the student's model, whole (collective under FSDP2)."""
    return {name: full(p) for name, p in student.module.named_parameters()}


def capture_step_gradients(step, micro_batches):
    """Run one student step; returns the whole gradients as ``optimizer.step`` received them
    (gathered on every rank under FSDP2) and the step result."""
    grads: dict[str, torch.Tensor] = {}
    student = step.student

    def capture(optimizer, args, kwargs) -> None:
        for name, p in student.module.named_parameters():
            grads[name] = full(p.grad)

    hook = student.optimizer.register_step_pre_hook(capture)
    try:
        result = step.run(micro_batches)
    finally:
        hook.remove()
    assert not result.skipped and grads, "the optimizer never stepped"
    return grads, result


def run_rank(
    rank: int,
    world: int,
    port: int,
    projection: str,
    plan: list[list[int]],
    out: str,
    device: str = "cpu",
    parallel: str = "ddp",
    checkpoint_dir: str | None = None,
    overrides: dict | None = None,
):
    """Rank ``rank`` trains micro-batches ``plan[rank]`` (indices into ``micro_batches()``) and
    saves ``{"grads", "params", "grad_norm"}`` (plus ``"loaded"`` with ``checkpoint_dir``) to
    ``<out>.rank<rank>.pt``; ``device="cuda"``: NCCL, one GPU per rank; ``overrides``: more
    trainer settings. With bf16 compute parameters it also saves ``"held"``: whether each compute
    gradient is still the tensor it was before the step, zeroed (the DDP bucket's view)."""
    from services.trainer import checkpoint
    from services.trainer.trainer import build_step

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

    def student_step(seed: int = 0):
        return build_step(
            setup.trainer_config(
                projection,
                **merged(
                    {
                        "feed": {"grad_accum": len(plan[rank])},
                        "compute": {"device": device, "parallel": parallel},
                        "student": {"seed": seed},
                    },
                    overrides or {},
                ),
            ),
            rank=rank,
            world_size=world,
            device=f"cuda:{rank}" if device == "cuda" else "cpu",
        )

    try:
        step = student_step()
        trained = step.student
        batches = setup.micro_batches()
        mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in plan[rank]]
        if device == "cuda":
            for mb in mbs:
                logits = mb.teacher_logits
                mb.teacher_logits = lambda f=logits: f().to(trained.device)
        before = None
        if trained.master is not None:
            before = [p.grad.data_ptr() for p in trained.compute.parameters()]
        grads, result = capture_step_gradients(step, mbs)
        saved = {
            "grads": grads,
            "params": full_params(trained),
            "grad_norm": result.metrics["grad_norm"],
            "cuda_graphs": trained.cuda_graphs,
        }
        if before is not None:
            after = list(trained.compute.parameters())
            saved["held"] = len(after) == len(before) and all(
                p.grad is not None and p.grad.data_ptr() == ptr and not p.grad.any()
                for p, ptr in zip(after, before, strict=True)
            )
        if checkpoint_dir is not None:
            path = checkpoint.save(trained, checkpoint_dir, epoch=0, task_start=0, trained=set())
            fresh = student_step(seed=7).student  # other initial weights: the load overwrites all
            checkpoint.load(fresh, path)
            saved["loaded"] = full_params(fresh)
            saved["loaded_step"] = fresh.step
        torch.save(saved, f"{out}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
