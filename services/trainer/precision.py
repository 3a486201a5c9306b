"""Low-precision compute with fp32 master weights: the student's parameters in bf16 for the
forward and backward, an fp32 copy of them for the optimizer.

Why not autocast over fp32 parameters (the eager baseline): autocast casts every weight to bf16
on every forward (and again in the backward), keeps fp32 gradients of the size of the model, and
runs its dispatch per op; bf16 parameters cast nothing, halve the gradients' bytes, and leave the
update exact in fp32. The fp32 masters are the model's truth: the optimizer steps them, the
checkpoint saves them, the export writes them; the bf16 compute copy is made from them after each
update (:meth:`MasterWeights.publish`).

Gradients: on one rank, each bf16 gradient is added into its master's fp32 gradient as soon as
autograd has accumulated it (a post-accumulate hook), and the bf16 one is freed; so several
micro-batches accumulate in fp32, and the bf16 gradients never all exist at once. Under DDP the
reducer owns the bf16 gradients: each one is a view of the reducer's bucket for the whole run
(:meth:`MasterWeights.hold_grads` before DDP wraps the model, ``gradient_as_bucket_view``), zeroed
in place after each update and never freed, so autograd always adds into the bucket (never into a
buffer of a CUDA graph replay, whose memory the next replay reuses) and the reducer copies nothing.
The buckets are summed over ranks in fp32 (:func:`fp32_allreduce_hook`, rounded to bf16 once;
with two ranks DDP's own bf16 sum is that same number: one addition, rounded once), and taken into
the masters before the update (:meth:`MasterWeights.collect`). FSDP2 does the same by itself
(``MixedPrecisionPolicy``: sharded fp32 parameters, bf16 compute, fp32 reduction).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["MasterWeights", "fp32_allreduce_hook", "resolve_param_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of the student's compute parameters.

    Args:
        name: ``auto`` (bfloat16 on CUDA, float32 on the CPU), ``float32`` or ``bfloat16``.
        device: the trainer's device.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"param_dtype={name!r}: use auto, float32 or bfloat16")
    return _DTYPES[name]


class MasterWeights:
    """fp32 master parameters for a low-precision compute copy of the same model.

    Args:
        master: the fp32 model (the optimizer's parameters, checkpoints, export).
        compute: its low-precision copy (same parameters in the same order: ``copy.deepcopy``
            then ``.to(dtype)``); the forward and backward run on it.
        accumulate_in_hooks: add each gradient into the fp32 master as autograd produces it
            (one rank); False when a DDP reducer owns the compute gradients (they are then kept
            for the run, see :meth:`hold_grads`).

    Raises:
        ValueError: the two models' parameters do not pair up.
    """

    def __init__(
        self, master: torch.nn.Module, compute: torch.nn.Module, *, accumulate_in_hooks: bool
    ) -> None:
        self.masters = list(master.parameters())
        self.computes = list(compute.parameters())
        shapes = [tuple(p.shape) for p in self.masters]
        if shapes != [tuple(p.shape) for p in self.computes]:
            raise ValueError("master and compute models have different parameters")
        self._compute_of = {id(m): c for m, c in zip(self.masters, self.computes, strict=True)}
        self.hooks = []
        self.owned_by_reducer = not accumulate_in_hooks
        if accumulate_in_hooks:
            for m, c in zip(self.masters, self.computes, strict=True):
                if c.requires_grad:
                    hook = functools.partial(_accumulate_into, m)
                    self.hooks.append(c.register_post_accumulate_grad_hook(hook))
        self.publish()

    def hold_grads(self) -> None:
        """Give every trainable compute parameter a zero gradient, before DDP wraps the model:
        with ``gradient_as_bucket_view`` the reducer then makes each one a view of its bucket,
        kept for the run (:meth:`zero_grad` zeroes it in place)."""
        for c in self.computes:
            if c.requires_grad and c.grad is None:
                c.grad = torch.zeros_like(c)

    def collect(self) -> None:
        """Take the compute gradients (DDP: summed over ranks) into the masters' fp32 ones.

        A few multi-tensor kernels for the whole model rather than two per parameter: on one
        rank the hooks do this during the backward, where the GPU is busy; here it sits between
        the backward and the update, where launching hundreds of small copies would set the pace.
        """
        fresh, held = [], []  # masters without a gradient yet (copied into), with one (added)
        for m, c in zip(self.masters, self.computes, strict=True):
            if c.grad is None:
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
                fresh.append((m, c))
            else:
                held.append((m, c))
        if fresh:
            torch._foreach_copy_([m.grad for m, _ in fresh], [c.grad for _, c in fresh])
        if held:
            torch._foreach_add_([m.grad for m, _ in held], [c.grad for _, c in held])
        if not self.owned_by_reducer:
            for _, c in fresh + held:
                c.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters into the compute parameters (rounded to their dtype)."""
        torch._foreach_copy_(self.computes, self.masters)

    def update(
        self, optimizer: torch.optim.AdamW, *, grad_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> None:
        """``optimizer.step()`` then :meth:`publish` in one pass per parameter
        (``xtoken_core.kernels.adamw``): the same AdamW update, state and step counts, kept in
        ``optimizer.state`` as torch's fused AdamW keeps them (checkpoints load either way).

        Args:
            optimizer: the AdamW over the masters (its groups' lr, betas, eps, weight decay).
            grad_scale: 0-d tensor the gradients are divided by (the clip).
            found_inf: 0-d tensor; nonzero skips the update and its step count.
        """
        from xtoken_core.kernels.adamw import adamw_publish_

        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [_adamw_state(optimizer, p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            adamw_publish_(
                params,
                [p.grad.contiguous() for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                steps,
                [self._compute_of[id(p)] for p in params],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # a skipped step is not counted

    def zero_grad(self) -> None:
        """Drop the compute gradients, or zero them in place where the DDP reducer's buckets
        hold them (the masters' are the optimizer's to zero)."""
        if self.owned_by_reducer:
            grads = [c.grad for c in self.computes if c.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
            return
        for c in self.computes:
            c.grad = None


def _adamw_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state, made as torch's fused AdamW makes it on its first step."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _accumulate_into(master: torch.Tensor, compute: torch.Tensor) -> None:
    """Add ``compute.grad`` into ``master.grad`` (fp32) and free it."""
    if master.grad is None:
        master.grad = compute.grad.to(master.dtype)
    else:
        master.grad.add_(compute.grad)
    compute.grad = None


def fp32_allreduce_hook(process_group: Any, bucket):
    """DDP communication hook: sum a bucket of low-precision gradients in fp32.

    ``bucket`` (a ``dist.GradBucket``) and the return value (a ``torch.futures.Future``) carry
    no annotation: DDP refuses a hook whose annotations are not those classes, and this module's
    annotations are strings.

    bf16 has 8 bits of mantissa: summed over ranks in bf16, every addition rounds; summed in fp32
    and rounded once, the reduced gradient is the exact sum's nearest bf16. Divides by the world
    size as DDP's default hook does (the trainer scales its loss back to a sum).

    Args:
        process_group: the DDP process group (None: the default group).
        bucket: DDP's ``GradBucket``.

    Returns:
        A future of the bucket's buffer holding the mean.
    """
    import torch.distributed as dist

    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(dist.get_world_size(group))
    work = dist.all_reduce(wide, group=group, async_op=True)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(back)
