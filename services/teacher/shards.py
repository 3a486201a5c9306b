"""The teacher model split over a tensor-parallel group: the plan, and each rank's shards built
on its own device (a preset's drawn, a checkpoint's read) or cut from a model loaded whole.

DTensor's ``parallelize_module`` splits, per decoder layer, q/k/v and gate/up by columns (each
rank holds ``1/k`` of the heads and of the intermediate size) and o and down by rows (an
all-reduce gives every rank the whole hidden state); the output layer by columns with its
output left sharded on the vocab: rank r computes the logits of columns ``[lo_r, hi_r)``
(``column_bounds``: ``torch.chunk``'s split, the one DTensor uses, so the vocab may split
unevenly). The embedding and the norms are replicated.

The forward runs on plain local tensors (``localize``, once the shards are filled): a column-
parallel layer is an ``nn.Linear`` of this rank's rows of the weight, a row-parallel one a
:class:`RowParallelLinear` (its local product, one all-reduce over the group, then the bias).
DTensor's own forward dispatch costs ~0.1 ms of CPU per sharded matmul, which left the GPUs of a
group waiting on the CPU: a Qwen2.5-7B-shaped forward at 1x4096 over two H200s took 343 ms under
DTensor against 113 ms on one GPU (benchmarks/results/teachers.md).

A preset is built on the ``meta`` device, parallelized, and each rank draws its own shards on
its own device (``init_shards``: seeded by the preset seed, the parameter's name and the rank); a
checkpoint folder is built the same way and each rank reads only its slices of the safetensors
files (``load_shards``). Neither materialises the whole model anywhere. ``shard_model`` shards a
model already loaded whole on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from services.teacher.config import check_tensor_parallel
from xtoken_core.models.device_draw import draw_tensor_, init_std, meta_model

logger = logging.getLogger(__name__)

__all__ = [
    "RowParallelLinear",
    "build_sharded_model",
    "column_bounds",
    "init_shards",
    "load_shards",
    "localize",
    "model_config",
    "shard_model",
    "tensor_parallel_plan",
]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def column_bounds(width: int, size: int, rank: int) -> tuple[int, int]:
    """The vocab columns ``[lo, hi)`` of ``rank``: ``torch.chunk``'s split of ``width`` into
    ``size`` parts (``ceil(width / size)`` each, the last ones shorter), as DTensor shards.

    Args:
        width: W, the vocab.
        size: k, the group's ranks.
        rank: this rank, ``0 <= rank < size``.

    Returns:
        ``(lo, hi)``; ``lo == hi`` for a rank past the end (a vocab smaller than the group).
    """
    chunk = -(-width // size)
    lo = min(rank * chunk, width)
    return lo, min(lo + chunk, width)


def model_config(spec: str, vocab_size: int | None = None) -> tuple[Any, Path | None]:
    """The transformers config of a model spec, without its weights, and its folder.

    Args:
        spec: a preset name, ``smollm2``, a GGUF preset, ``gguf:PATH`` or a local folder.
        vocab_size: a preset's vocab (None: any; the shapes a group splits do not depend on it).

    Returns:
        ``(config, folder)``: folder None for a preset (random weights).

    Raises:
        ValueError: an unknown spec, a folder that is not a causal LM, a ``:drop=`` suffix (a
            group loads whole checkpoints only).
    """
    from xtoken_core.models.gguf import GGUF_PREFIX, GGUF_PRESETS, gguf_model_dir, gguf_preset_dir
    from xtoken_core.models.layer_drop import split_spec
    from xtoken_core.models.loading import SMOLLM2, check_model_dir
    from xtoken_core.models.presets import PRESETS

    base, drop = split_spec(os.fspath(spec))
    if drop:
        raise ValueError(
            f"teacher.model={spec!r}: a tensor-parallel teacher loads whole checkpoints, not "
            "dropped layers; export the smaller model with export_hf or set "
            "teacher.tensor_parallel: 1"
        )
    if base in PRESETS:
        return PRESETS[base].config(vocab_size or 1024), None
    if base == SMOLLM2:
        from xtoken_core.models.smollm2 import smollm2_dir

        folder = smollm2_dir()
    elif base in GGUF_PRESETS:
        folder = gguf_preset_dir(base)
    elif base.startswith(GGUF_PREFIX):
        folder = gguf_model_dir(base[len(GGUF_PREFIX) :])
    else:
        folder = Path(base).expanduser()
        if not folder.is_dir():
            from xtoken_core.models.loading import model_spec_names

            raise ValueError(
                f"unknown model {spec!r}: not a preset and not a directory; use one of "
                f"{model_spec_names()} or a local Hugging Face model directory"
            )
    return check_model_dir(folder), folder


def _layer_prefixes(model: torch.nn.Module) -> list[str]:
    from xtoken_core.models.layers import LAYER_PATHS, decoder_layers

    layers = decoder_layers(model)
    for path in LAYER_PATHS:
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
        if layers and node is not None and list(node) == layers:
            return [f"{path}.{i}" for i in range(len(layers))]
    return []


def tensor_parallel_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a Llama / Qwen-style causal LM.

    Per decoder layer: ``self_attn.{q,k,v}_proj`` and ``mlp.{gate,up}_proj`` column-parallel,
    ``self_attn.o_proj`` and ``mlp.down_proj`` row-parallel (their output all-reduced, so the
    residual stream is whole on every rank); ``lm_head`` column-parallel with its output left
    sharded on the vocab (each rank's local logits ``[..., hi - lo]``).

    Args:
        model: the causal LM (on any device, ``meta`` included).

    Returns:
        Module path -> parallel style.

    Raises:
        ValueError: the model has no such layers (names its class).
    """
    prefixes = _layer_prefixes(model)
    plan: dict[str, Any] = {}
    for prefix in prefixes:
        layer = model.get_submodule(prefix)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(
            isinstance(getattr(m, n, None), torch.nn.Linear)
            for m, names in ((attn, _ATTENTION), (mlp, _MLP))
            for n in names
        ):
            prefixes = []
            break
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"{prefix}.mlp.{name}"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not prefixes or not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"teacher.tensor_parallel: {type(model).__name__} is not a Llama / Qwen-style causal "
            "LM (decoder layers with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj, a "
            "linear output layer); set teacher.tensor_parallel: 1"
        )
    head_name = next(n for n, m in model.named_modules() if m is head)
    plan[head_name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    return plan


class RowParallelLinear(torch.nn.Module):
    """A row-parallel linear layer on plain tensors: this rank's input columns times its columns
    of the weight, summed over the group by one all-reduce (traceable by ``torch.compile``: a
    functional collective), then the bias (once, not once per rank).

    Args:
        weight: this rank's ``[out, in / k]`` slice.
        bias: the whole ``[out]`` bias, or None.
        group: the group's process group.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        y = funcol.all_reduce(torch.nn.functional.linear(x, self.weight), "sum", self.group)
        return y if self.bias is None else y + self.bias


def localize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """The parallelized model's forward on plain local tensors: each layer of the plan takes
    its local shard as a plain parameter and loses DTensor's hooks; a row-parallel layer
    becomes a :class:`RowParallelLinear`. The replicated parameters were plain already. The
    output layer keeps its vocab rows and says the whole vocab in ``whole_out_features``.

    Args:
        model: a model ``parallelize_module`` split over ``mesh``, its shards filled.
        mesh: the group's 1-D device mesh.

    Returns:
        The same module, no DTensor left in it.
    """
    group = mesh.get_group()
    head = model.get_output_embeddings()
    for name, style in tensor_parallel_plan(model).items():
        module = model.get_submodule(name)
        if module is head:  # its vocab rows here; the vocab (model_vocab_size) is the whole
            module.whole_out_features = int(module.weight.shape[0])
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        weight = _local(module.weight)[0]
        bias = None if module.bias is None else _local(module.bias)[0]
        if isinstance(style, RowwiseParallel):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, RowParallelLinear(weight, bias, group))
        else:
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                module.bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


def _parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    config = getattr(model, "config", None)
    check_tensor_parallel(mesh.size(), config, type(model).__name__)
    return parallelize_module(model, mesh, tensor_parallel_plan(model))


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """Shard a model every rank loaded whole (the same weights on every rank: rank 0's are
    scattered), on ``device``.

    Args:
        model: the causal LM, loaded whole on every rank.
        mesh: the group's 1-D device mesh.
        device: this rank's device.

    Returns:
        The same module on its local shards (:func:`localize`).

    Raises:
        ValueError: the model cannot be split over the mesh (``check_tensor_parallel``).
    """
    return localize(_parallelize(model.to(device), mesh), mesh)


def _meta_model(
    config: Any, mesh: DeviceMesh | None, dtype: torch.dtype, device
) -> torch.nn.Module:
    """The model of ``config``, parallelized over ``mesh`` (None: not), its local shards
    allocated (uninitialised) on ``device``; nothing whole is allocated in a group."""
    return meta_model(
        config, dtype, device, setting="set teacher.tensor_parallel: 1",
        prepare=None if mesh is None else (lambda model: _parallelize(model, mesh)),
    )  # fmt: skip


def _local(param: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """A parameter's local tensor and the dim it is sharded on (None: replicated)."""
    if isinstance(param, DTensor):
        placement = param.placements[0]
        return param.to_local(), (placement.dim if isinstance(placement, Shard) else None)
    return param.data, None


@torch.no_grad()
def init_shards(model: torch.nn.Module, seed: int, rank: int) -> None:
    """Draw random weights into each rank's shards, on their device, as a preset's.

    Matrices ``N(0, config.initializer_range)``, biases 0, norm weights 1 (transformers'
    initialisation). Each tensor has its own generator, seeded by ``seed``, its name and, for a
    sharded one, ``rank``: a replicated tensor is the same on every rank, and one seed gives
    the same group run to run (not the weights of a one-process build of the preset). A tied
    output layer takes its rows of the embedding.

    Args:
        model: a parallelized model whose shards are allocated (``to_empty``).
        seed: the preset seed (``teacher.seed``).
        rank: this rank of the mesh.
    """
    std = init_std(model.config)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    head_param = head.weight
    # tied, but its own tensor since the split (a shared tensor is drawn once, as the embedding)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tied = tied and head_param is not embedding.weight
    for name, param in model.named_parameters():
        if tied and param is head_param:
            continue
        local, dim = _local(param)
        draw_tensor_(local, name, seed, None if dim is None else rank, std)
    if tied:
        local, dim = _local(head_param)
        assert dim in (0, None), dim  # its vocab rows, or all of them (no mesh)
        lo, hi = column_bounds(head_param.shape[0], _mesh_size(head_param), rank)
        local.copy_(embedding.weight[lo:hi])


def _mesh_size(param: torch.Tensor) -> int:
    return param.device_mesh.size() if isinstance(param, DTensor) else 1


def _checkpoint_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> its safetensors file in a checkpoint folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


@torch.no_grad()
def load_shards(model: torch.nn.Module, folder: Path, rank: int) -> None:
    """Fill each rank's shards from a checkpoint folder, reading only its slices.

    Args:
        model: a parallelized model whose shards are allocated (``to_empty``).
        folder: a Hugging Face folder with safetensors weights under transformers' names.
        rank: this rank of the mesh.

    Raises:
        ValueError: a tensor is missing or of another shape (names it).
    """
    from safetensors import safe_open

    index = _checkpoint_index(folder)
    embedding_name = next(
        n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight
    )
    head_param = model.get_output_embeddings().weight
    files: dict[Path, Any] = {}
    try:
        for name, param in model.named_parameters():
            key = name
            if key not in index and param is head_param:
                key = embedding_name  # a tied output layer is the embedding
            if key not in index:
                raise ValueError(
                    f"checkpoint {str(folder)!r} has no tensor {name!r}; a tensor-parallel "
                    "teacher reads transformers' own names: set teacher.tensor_parallel: 1"
                )
            file = index[key]
            if file not in files:
                files[file] = safe_open(str(file), framework="pt")
            view = files[file].get_slice(key)
            if list(view.get_shape()) != list(param.shape):
                raise ValueError(
                    f"checkpoint tensor {key!r} is {view.get_shape()}, the model's {name} is "
                    f"{list(param.shape)}: the folder's config.json does not match its weights"
                )
            local, dim = _local(param)
            if dim is None:
                value = view[:]
            else:
                lo, hi = column_bounds(param.shape[dim], _mesh_size(param), rank)
                value = view[lo:hi] if dim == 0 else view[:, lo:hi]
            local.copy_(value)
    finally:
        files.clear()


def build_sharded_model(
    spec: str,
    mesh: DeviceMesh | None,
    *,
    vocab_size: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> torch.nn.Module:
    """This rank's part of a teacher model, built on ``device`` without the whole model.

    Args:
        spec: a preset name (random weights, ``init_shards``) or a checkpoint folder spec
            (``smollm2``, a GGUF preset, ``gguf:PATH``, a local folder: ``load_shards``).
        mesh: the group's 1-D device mesh; None: one process, the whole model on ``device``,
            built the same way (no DTensors; a benchmark's one-GPU baseline).
        vocab_size: a preset's vocab (required for a preset); a checkpoint's is its own.
        dtype: the parameter dtype.
        device: this rank's device.
        seed: a preset's seed.

    Returns:
        The parallelized causal LM (in eval mode).

    Raises:
        ValueError: as ``model_config``, ``check_tensor_parallel`` and ``load_shards``; a preset
            without ``vocab_size``.
    """
    start = time.perf_counter()
    config, folder = model_config(spec, vocab_size)
    if folder is None and vocab_size is None:
        raise ValueError(f"preset {spec!r} needs vocab_size=...: pass the tokenizer's vocab_size")
    model = _meta_model(config, mesh, dtype, device)
    rank = 0 if mesh is None else mesh.get_local_rank()
    if folder is None:
        init_shards(model, seed, rank)
    else:
        load_shards(model, folder, rank)
    local = sum(_local(p)[0].numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())
    if mesh is not None:
        model = localize(model, mesh)
    logger.info(
        "[teacher] rank %d of %d built its shards of %s (%.1f M of %.1f M params, %s on %s) in "
        "%.1f s",
        rank, 1 if mesh is None else mesh.size(), spec, local / 1e6, whole / 1e6,
        dtype, device, time.perf_counter() - start,
    )  # fmt: skip
    return model.eval()
