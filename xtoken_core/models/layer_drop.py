"""Pruned students: a model spec with ``:drop=A-B,C`` loses those decoder layers before training.

``smollm2:drop=10-19`` is SmolLM2 without its decoder layers 10 to 19 (inclusive, counted from 0
in the full model); any spec takes the suffix (``gguf:/m/x.gguf:drop=3``, a folder, a preset).
The kept layers are renumbered 0..n-1 wherever a layer knows its index (attention's
``layer_idx``, which the KV cache is indexed by) and the config follows
(``num_hidden_layers``, the per-layer ``layer_types`` of sliding / full attention), so that the
model is an ordinary model of n layers: ``save_pretrained`` / ``export_hf`` write a folder that
loads as that model.
"""

from __future__ import annotations

import logging

import torch

from xtoken_core.models.layers import LAYER_PATHS

logger = logging.getLogger(__name__)

DROP_SEP = ":drop="


def parse_drop(text: str) -> tuple[int, ...]:
    """Layer indices from ``"10-19"``, ``"3"`` or ``"1,4-5"`` (ranges inclusive).

    Args:
        text: comma-separated indices and ``A-B`` ranges.

    Returns:
        The sorted distinct indices.

    Raises:
        ValueError: an empty item, a non-integer, a negative index or a range with A > B.
    """
    out: set[int] = set()
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ValueError(
                f"drop={text!r}: {item.strip()!r} is not a layer index or range; write e.g. "
                "drop=10-19 or drop=2,5-7"
            ) from None
        if a < 0 or b < a:
            raise ValueError(
                f"drop={text!r}: {item.strip()!r} is no range of layer indices (>= 0, A <= B)"
            )
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def split_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """A model spec without its ``:drop=`` suffix, and the layers it drops.

    Args:
        spec: e.g. ``"smollm2:drop=10-19"`` or ``"student-25m"``.

    Returns:
        ``(base spec, indices)``; no suffix: ``(spec, ())``.

    Raises:
        ValueError: a suffix that does not parse (see :func:`parse_drop`) or an empty base.
    """
    base, sep, drop = spec.rpartition(DROP_SEP)
    if not sep:
        return spec, ()
    if not base:
        raise ValueError(f"model {spec!r}: name the model before {DROP_SEP!r}, e.g. smollm2:drop=2")
    try:
        return base, parse_drop(drop)
    except ValueError as e:
        raise ValueError(f"model {spec!r}: {e}") from None


def _layer_list(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    for path in LAYER_PATHS:
        parent: object = model
        *parents, leaf = path.split(".")
        for part in parents:
            parent = getattr(parent, part, None)
        layers = getattr(parent, leaf, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return parent, leaf, layers  # type: ignore[return-value]
    raise ValueError(
        f"{type(model).__name__} keeps its decoder layers at none of {LAYER_PATHS}; drop= works "
        "on Hugging Face causal LMs of those layouts"
    )


def drop_layers(model: torch.nn.Module, drop: tuple[int, ...] | list[int]) -> torch.nn.Module:
    """Remove decoder layers of a causal LM in place and renumber the rest.

    Args:
        model: a Hugging Face causal LM (decoder layers at one of ``LAYER_PATHS``).
        drop: indices of the layers to remove (of the full model, from 0).

    Returns:
        ``model``, with ``len(layers) - len(drop)`` layers, ``config.num_hidden_layers`` and
        ``config.layer_types`` (where it has them) matching, each kept layer's ``layer_idx``
        its new position.

    Raises:
        ValueError: an index past the last layer, or dropping every layer.
    """
    parent, leaf, layers = _layer_list(model)
    n = len(layers)
    drop_set = set(drop)
    if not drop_set:
        return model
    if max(drop_set) >= n:
        raise ValueError(
            f"drop={sorted(drop_set)}: the model has {n} decoder layers (0-{n - 1}); drop "
            "indices below it"
        )
    keep = [i for i in range(n) if i not in drop_set]
    if not keep:
        raise ValueError(f"drop={sorted(drop_set)} removes all {n} decoder layers; keep one")
    setattr(parent, leaf, torch.nn.ModuleList([layers[i] for i in keep]))
    for new, old in enumerate(keep):
        for module in layers[old].modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new
    config = getattr(model, "config", None)
    for cfg in {id(c): c for c in _configs(config)}.values():
        if isinstance(getattr(cfg, "layer_types", None), list) and len(cfg.layer_types) == n:
            cfg.layer_types = [cfg.layer_types[i] for i in keep]
        if getattr(cfg, "num_hidden_layers", None) == n:
            cfg.num_hidden_layers = len(keep)
    logger.info("[models] dropped decoder layers %s: %d of %d kept", sorted(drop_set), len(keep), n)
    return model


def _configs(config) -> list:
    """The config and its text config (multimodal configs nest the decoder's)."""
    if config is None:
        return []
    out = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        out.append(get_text())
    return out
