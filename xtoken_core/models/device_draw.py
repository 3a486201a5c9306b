"""A preset's random weights drawn on the device that holds them, one tensor at a time.

Drawing a preset on the CPU from one generator makes the same model on every device, but one
CPU stream draws ~50 M numbers a second: a Qwen3-1.7B-shaped student took 35 s to build and a
Qwen2.5-7B-shaped teacher 100-130 s, in every process of every run. Here the model is made on the
``meta`` device, its tensors allocated where they go, and each one drawn there by a generator of
its own, seeded by the preset seed and the tensor's name (and a shard's rank): matrices
``N(0, config.initializer_range)``, biases 0, norm weights 1 (transformers' initialisation). A
seed gives the same weights run to run on GPUs of one kind (CUDA's generator lays numbers out by
the launch's shape), not those of the CPU draw. Tensor-parallel teacher groups draw their shards
the same way (``services/teacher/shards.py``).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch

__all__ = [
    "draw_model",
    "draw_output_layer",
    "draw_tensor_",
    "init_std",
    "meta_model",
    "rebuild_rotary",
    "seed_of",
]


def seed_of(seed: int, name: str, rank: int | None) -> int:
    """The seed of one tensor's generator: the preset seed, the tensor's name and, for a shard
    of a tensor split over a group, its rank (None: the whole tensor)."""
    text = f"{int(seed)}/{name}/{'all' if rank is None else rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def draw_tensor_(local: torch.Tensor, name: str, seed: int, rank: int | None, std: float) -> None:
    """Fill ``local`` (a parameter, or this rank's shard of one) as a preset's: a bias 0, a 1-D
    weight (a norm's) 1, anything else ``N(0, std)`` from its own generator on its device,
    drawn in float32 and rounded to ``local``'s dtype (so a tensor drawn alone, such as the
    output layer the ``hidden`` transport's trainer builds, is the model's in any dtype)."""
    if name.endswith("bias"):
        local.zero_()
    elif local.dim() == 1:
        local.fill_(1.0)
    else:
        generator = torch.Generator(device=local.device)
        generator.manual_seed(seed_of(seed, name, rank))
        if local.dtype == torch.float32:
            local.normal_(0.0, std, generator=generator)
        else:
            drawn = torch.empty(local.shape, dtype=torch.float32, device=local.device)
            local.copy_(drawn.normal_(0.0, std, generator=generator))


def draw_output_layer(
    config: Any, dtype: torch.dtype, device: torch.device | str, seed: int
) -> torch.nn.Module:
    """The output layer of the preset model :func:`draw_model` draws, drawn alone on ``device``
    (its tensor's generator is its own, so nothing else need be drawn)."""
    from xtoken_core.models.heads import split_lm_head

    model = _on_meta(config, dtype)
    model.tie_weights()
    _, head = split_lm_head(model)
    name = next(n for n, p in model.named_parameters() if p is head.weight)  # as draw_model's
    head = head.to_empty(device=device)
    for own, param in head.named_parameters():
        drawn_as = name if own == "weight" else f"lm_head.{own}"
        draw_tensor_(param.data, drawn_as, seed, None, init_std(config))
    return head


def init_std(config: Any) -> float:
    """The standard deviation of a preset's matrices (transformers' ``initializer_range``)."""
    return float(getattr(config, "initializer_range", 0.02))


def _on_meta(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def rebuild_rotary(model: torch.nn.Module, device: torch.device | str, setting: str) -> None:
    """Recompute the computed (non-persistent) buffers after ``to_empty``: the rotary
    embedding's inverse frequencies, by building each rotary module again.

    Raises:
        ValueError: the model has other buffers, which a draw does not know how to fill (names
            them and ``setting``, the setting to turn off).
    """
    config = model.config
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            cls = type(module)
            params = inspect.signature(cls.__init__).parameters
            kwargs = {"device": device} if "device" in params else {}
            fresh = cls(config=getattr(module, "config", config), **kwargs).to(device)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)
    unknown = [name for name, _ in model.named_buffers() if "rotary_emb" not in name]
    if unknown:
        raise ValueError(
            f"{type(model).__name__} has buffers {unknown[:3]} that a draw on the device does "
            f"not know how to fill; {setting}"
        )


def meta_model(
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    setting: str,
    prepare: Any = None,
) -> torch.nn.Module:
    """The causal LM of ``config`` made on ``meta``, then (after ``prepare(model)``, e.g. the
    tensor-parallel split, which returns the model) allocated uninitialised on ``device``, its
    rotary buffers computed. ``setting``: what to turn off when it cannot be drawn."""
    model = _on_meta(config, dtype)
    if prepare is not None:
        model = prepare(model)
    model.to_empty(device=device)
    rebuild_rotary(model, device, setting)
    return model


def draw_model(config: Any, dtype: torch.dtype, device: torch.device | str, seed: int) -> Any:
    """A whole preset model drawn on ``device`` (one process; module doc)."""
    model = meta_model(config, dtype, device, setting="build the preset on the CPU")
    model.tie_weights()  # a tied output layer is the embedding, drawn once
    std = init_std(config)
    for name, param in model.named_parameters():
        draw_tensor_(param.data, name, seed, None, std)
    return model
