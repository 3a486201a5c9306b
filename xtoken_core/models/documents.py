"""Document-boundary attention for packed rows: the mask that keeps each document's attention
within the document, in the form the model's attention implementation takes.

A packed row (:mod:`xtoken_core.data.packing`) holds several documents whose positions restart
at 0; a document's tokens may attend only to earlier tokens of the same document. The forward
gets the restarting ``position_ids`` (rotary positions as in a row of its own) and, as its
``attention_mask``, a mask built here, ready for the attention layers (transformers passes a
prepared mask through unchanged):

* ``sdpa`` (the default implementation; the CPU reference): a bool ``[B, 1, T, T]`` mask,
  True where attention is allowed;
* ``eager``: the same as an additive float mask (0 or the dtype's lowest value);
* ``flex_attention`` (the CUDA path): a ``BlockMask`` of the same rule
  (``torch.nn.attention.flex_attention.create_block_mask``), whose blocks that lie across
  documents are skipped by the kernels, not computed and masked.

Pad tokens (position 0 each) are documents of one token: no row is fully masked. Models whose
config lists ``layer_types`` (Qwen3, Gemma3...) take one mask per layer type: full attention and
sliding-window attention (the window applied within the document) are built; a model with a
``sliding_window`` and no layer types gets the window in its one mask.

Legend: B rows, T tokens of a row, D documents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Attention implementations a document mask is built for.
IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
# Settings of ``packed_attention`` (trainer and teacher).
PACKED_ATTENTION = ("auto", "flex_attention", "sdpa")
_LAYER_WINDOWS = {"full_attention": False, "sliding_attention": True}


def document_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Index of each token's document within its row: a new document starts at position 0.

    Args:
        position_ids_BT: ``[B, T]`` integer positions restarting at 0 per document.

    Returns:
        ``[B, T]`` int64, 0 for the row's first document (or -1 before it, when a row does not
        start at position 0).
    """
    return (position_ids_BT == 0).to(torch.int64).cumsum(dim=1) - 1


def _window(config: Any) -> int | None:
    """The sliding window of a model without layer types (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _dense_mask(doc_BT: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool ``[B, 1, T, T]``: causal, same document, within the window."""
    T = doc_BT.shape[1]
    pos_T = torch.arange(T, device=doc_BT.device)
    allowed_TT = pos_T[:, None] >= pos_T[None, :]
    if window is not None:
        allowed_TT = allowed_TT & (pos_T[:, None] - pos_T[None, :] < window)
    same_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
    return (same_BTT & allowed_TT)[:, None]


@functools.cache
def _compiled_create_block_mask() -> Callable[..., Any]:
    """``create_block_mask`` compiled once per process: it then evaluates the mask block by block
    on the GPU, never materializing ``[B, T, T]``; the document ids it closes over are inputs,
    so one compiled function serves every batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _block_mask(doc_BT: torch.Tensor, window: int | None) -> Any:
    """A FlexAttention ``BlockMask`` of the same rule as :func:`_dense_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q, kv):
        allowed = (doc_BT[b, q] == doc_BT[b, kv]) & (q >= kv)
        if window is not None:
            allowed = allowed & (q - kv < window)
        return allowed

    B, T = doc_BT.shape
    create = _compiled_create_block_mask() if doc_BT.is_cuda else create_block_mask
    return create(document_causal, B, None, T, T, device=doc_BT.device)


def document_attention_mask(
    config: Any, position_ids_BT: torch.Tensor, dtype: torch.dtype = torch.float32
) -> Any:
    """The ``attention_mask`` of a forward over packed rows.

    Args:
        config: the model's config (``_attn_implementation``, ``layer_types``,
            ``sliding_window``).
        position_ids_BT: ``[B, T]`` positions restarting at 0 per document, on the forward's
            device.
        dtype: the forward's compute dtype (the ``eager`` mask's values).

    Returns:
        A bool ``[B, 1, T, T]`` tensor (sdpa), a float one (eager) or a ``BlockMask``
        (flex_attention); a dict of them by layer type when the config lists ``layer_types``.

    Raises:
        ValueError: an attention implementation or a layer type this mask is not built for.
    """
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"packed rows need document-boundary attention, built here for "
            f"{', '.join(IMPLEMENTATIONS)}; the model runs {implementation!r}: load it with "
            "attn_implementation='sdpa', or set pack: false"
        )
    doc_BT = document_ids(position_ids_BT)

    def build(window: int | None) -> Any:
        if implementation == "flex_attention":
            return _block_mask(doc_BT, window)
        allowed = _dense_mask(doc_BT, window)
        if implementation == "sdpa":
            return allowed
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)

    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return build(_window(config))
    out = {}
    for kind in dict.fromkeys(layer_types):
        if kind not in _LAYER_WINDOWS:
            raise ValueError(
                f"packed rows: the model has {kind!r} layers; document masks are built for "
                f"{', '.join(_LAYER_WINDOWS)} layers only; set pack: false"
            )
        out[kind] = build(int(config.sliding_window) if _LAYER_WINDOWS[kind] else None)
    return out


def packed_attention(setting: str, device: torch.device | str) -> str:
    """The attention implementation a model runs for packed rows.

    Args:
        setting: ``auto``, ``flex_attention`` or ``sdpa`` (``trainer.compute.packed_attention``,
            ``teacher.packed_attention``).
        device: the model's device.

    Returns:
        ``flex_attention`` for ``auto`` on a CUDA device (its kernels skip the blocks across
        documents), ``sdpa`` for ``auto`` elsewhere (the CPU reference), else ``setting``.

    Raises:
        ValueError: an unknown setting.
    """
    if setting not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention={setting!r}: use one of {', '.join(PACKED_ATTENTION)}")
    if setting != "auto":
        return setting
    return "flex_attention" if torch.device(device).type == "cuda" else "sdpa"


def use_packed_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch a transformers model to ``implementation`` for packed rows (before it is compiled).

    Args:
        model: a transformers ``PreTrainedModel``.
        implementation: ``sdpa``, ``eager`` or ``flex_attention``.

    Raises:
        ValueError: the model cannot switch (not a transformers model).
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == implementation:
        return
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"{type(model).__name__} cannot switch to {implementation!r} attention for packed "
            "rows; set packed_attention: sdpa, or pack: false"
        )
    model.set_attn_implementation(implementation)
