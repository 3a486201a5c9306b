"""Jagged <-> padded: per-token fields travel jagged, and the padding is paid once, where a
rectangle is needed.

Two families of helpers share this file:

* **Rows** (the trainer's hot path). ``columns_to_samples`` splits the columns of a claim (one
  values + one offsets tensor per jagged field, as the wire delivers them) into per-sample row
  views without copying; ``pad_rows`` copies each row once into its rectangle;
  ``samples_to_columns`` is the way back (samples into the columns of one put). The
  schema-driven batch on top (which pad value and width each field gets) is
  :func:`xtoken_core.data.sample.pad_samples`.
* **TensorDicts** (the interface of TensorDict-based data planes: a ``TensorDict`` with
  ``batch_size=[N]`` whose per-token fields are ``torch.jagged`` nested tensors and whose
  object fields are ``NonTensorStack`` leaves). Writers strip padding off rectangular fields
  (``to_nested_by_length``, ``maybe_pack_jagged``, ``pack_per_token_field``,
  ``pack_jagged_fields``, ``stack_or_nest``, ``response_from_nested``); readers turn a wire
  TensorDict back into rectangles (``materialize``: per-field pad values, ``pad_to_seqlen``,
  non-tensor leaves as object arrays). How such a TensorDict crosses the queue is
  :mod:`xtoken_core.data_plane.tensordict_io`.

``tensordict`` is imported on first use: the trainer's rows path never pays for it.

Legend: N rows (samples), S padded sequence length, L_i the length of row i, R the total rows of
a jagged values tensor (sum of L_i), D... trailing per-token dims, P_i / A_i the prompt / response
length of row i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from xtoken_core.data_plane.njt import is_njt, njt_from_parts, njt_parts
from xtoken_core.jagged import JaggedColumn, is_jagged

__all__ = [
    "LAYOUTS",
    "Layout",
    "columns_to_samples",
    "materialize",
    "maybe_pack_jagged",
    "pack_jagged_fields",
    "pack_per_token_field",
    "pad_rows",
    "response_from_nested",
    "samples_to_columns",
    "stack_or_nest",
    "to_nested_by_length",
    "unwrap_wire_stripped_payload",
]

Layout = Literal["padded", "jagged"]
LAYOUTS: tuple[str, ...] = ("padded", "jagged")

# pad_sequence fills with a float64: integers up to this magnitude come through exactly.
_EXACT_FLOAT64_INT = 2**53


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = "nested tensor" if x.is_nested else "tensor"
        return f"{kind} shape={tuple(x.shape)} dtype={x.dtype}"
    return type(x).__name__


# -- rows: the trainer's path -----------------------------------------------------------------


def pad_rows(
    rows: Sequence[torch.Tensor], pad_value: int | float | bool = 0, width: int = 0
) -> torch.Tensor:
    """Right-pad rows into a rectangle, each row copied once.

    Args:
        rows: N >= 1 tensors ``[L_i, *D]`` of one dtype and device, same D (e.g. row views of
            claimed jagged columns).
        pad_value: value of the padding positions.
        width: pad to this S (>= the longest row); 0 = the longest row.

    Returns:
        ``[N, S, *D]``, a new tensor on the rows' device.

    Raises:
        ValueError: no rows, or a row longer than ``width``.
    """
    if not rows:
        raise ValueError("pad_rows needs at least one row, got none")
    longest = max(int(r.shape[0]) for r in rows)
    if width and longest > width:
        raise ValueError(
            f"a row has {longest} positions > width={width}; raise the width or truncate the rows"
        )
    width = width or longest
    exact = not isinstance(pad_value, int) or abs(pad_value) <= _EXACT_FLOAT64_INT
    if width == longest and exact:
        # one C++ loop of row copies into the rectangle (bool and integer pads are exact)
        return pad_sequence(list(rows), batch_first=True, padding_value=pad_value)
    first = rows[0]
    out_NSD = torch.full(
        (len(rows), width, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device
    )
    for i, row in enumerate(rows):
        out_NSD[i, : row.shape[0]] = row
    return out_NSD


def columns_to_samples(columns: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Split columns (tensors ``[N, ...]``, jagged nested, JaggedColumn) into N sample dicts.

    Args:
        columns: field -> column, all with N rows.

    Returns:
        N dicts of row views (no copies).

    Raises:
        ValueError: columns disagree on N.
        TypeError: a column of another type.
    """
    rows: dict[str, list[torch.Tensor]] = {}
    for name, col in columns.items():
        if isinstance(col, JaggedColumn) or is_jagged(col):
            c = col if isinstance(col, JaggedColumn) else JaggedColumn.from_nested(col)
            rows[name] = c.rows()
        elif isinstance(col, torch.Tensor) and not col.is_nested and col.ndim >= 1:
            rows[name] = list(col.unbind(0))
        else:
            raise TypeError(f"column {name!r} is a {_describe(col)}; expected a tensor with rows")
    counts = {name: len(r) for name, r in rows.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"columns disagree on the number of rows: {counts}")
    n = next(iter(counts.values()), 0)
    return [{name: r[i] for name, r in rows.items()} for i in range(n)]


def samples_to_columns(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Pack N samples into the columns of one put: the inverse of :func:`columns_to_samples`.

    A 0-d field is stacked to ``[N]``; a field with a sequence dim always becomes a
    ``JaggedColumn`` (one values ``[R, *D]`` + one offsets ``[N+1]`` buffer), even when every row
    happens to have the same length, so that a field's layout never changes between puts.

    Args:
        samples: N >= 1 dicts of the same field names, each field 0-d in every sample or
            ``[L_i, *D]`` in every sample.

    Returns:
        field -> ``[N]`` tensor or ``JaggedColumn`` of N rows, in the first sample's order.

    Raises:
        ValueError: no samples, a sample without a field of the first, or a field that is 0-d
            in one sample and not in another (names the field).
    """
    if not samples:
        raise ValueError("samples_to_columns needs at least one sample, got none")
    out: dict[str, Any] = {}
    for name, first in samples[0].items():
        try:
            rows = [s[name] for s in samples]
        except KeyError:
            raise ValueError(
                f"a sample misses field {name!r}; every sample needs the same fields"
            ) from None
        dims = {r.ndim == 0 for r in rows}
        if len(dims) > 1:
            raise ValueError(f"field {name!r} is 0-d in some samples and not in others")
        try:
            out[name] = torch.stack(rows) if first.ndim == 0 else JaggedColumn.from_rows(rows)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"field {name!r}: {e}") from None
    return out


# -- TensorDicts: the writer's side -----------------------------------------------------------


def _cpu_lengths(lengths: Any, n: int | None = None) -> torch.Tensor:
    """``lengths`` as a 1-D CPU int64 tensor (one device sync for a CUDA tensor)."""
    lengths_N = torch.as_tensor(lengths).detach()
    if lengths_N.device.type != "cpu":
        lengths_N = lengths_N.cpu()  # once: no per-row syncs below
    if lengths_N.ndim != 1 or lengths_N.is_floating_point() or lengths_N.is_complex():
        raise ValueError(f"lengths must be 1-D integers, one per row; got {_describe(lengths_N)}")
    if n is not None and lengths_N.numel() != n:
        raise ValueError(f"{lengths_N.numel()} lengths for {n} rows; give one length per row")
    lengths_N = lengths_N.to(torch.int64)
    if lengths_N.numel() and int(lengths_N.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lengths_N.tolist()}")
    return lengths_N


def _longest(lengths_N: torch.Tensor) -> int:
    return int(lengths_N.max()) if lengths_N.numel() else 0


def _nested(values_RD: torch.Tensor, lengths_N: torch.Tensor) -> torch.Tensor:
    """A ``torch.jagged`` nested tensor over ``values`` with rows of ``lengths`` (CPU)."""
    offsets_N1 = torch.zeros(lengths_N.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths_N, 0, out=offsets_N1[1:])
    return njt_from_parts(values_RD, offsets_N1.to(values_RD.device))


def to_nested_by_length(padded: torch.Tensor, lengths: Any) -> torch.Tensor:
    """Strip right-padding off a rectangular tensor using per-row lengths.

    Args:
        padded: ``[N, S, *D]`` tensor (S may exceed the longest row: trailing padding of any
            width is dropped).
        lengths: ``[N]`` valid lengths (tensor or sequence of ints); a CUDA tensor is read once.

    Returns:
        A ``torch.jagged`` nested tensor ``[N, j, *D]`` whose row i is ``padded[i, :L_i]``.
        Its values are a view of ``padded`` when every row fills S, else one gather (a copy).

    Raises:
        ValueError: ``padded`` has fewer than 2 dims or is nested, the lengths are not N
            non-negative integers, or a length exceeds S.
    """
    if not isinstance(padded, torch.Tensor) or padded.is_nested or padded.ndim < 2:
        raise ValueError(
            f"to_nested_by_length needs a rectangular tensor [N, S, ...], got {_describe(padded)}"
        )
    n, s = int(padded.shape[0]), int(padded.shape[1])
    lengths_N = _cpu_lengths(lengths, n)
    longest = _longest(lengths_N)
    if longest > s:
        raise ValueError(f"a row length of {longest} exceeds the {s} positions of the tensor")
    if n and int(lengths_N.min()) == s:
        values_RD = padded.reshape(n * s, *padded.shape[2:])  # full rows: a view
    else:
        keep_NS = torch.arange(s) < lengths_N[:, None]
        values_RD = padded[keep_NS.to(padded.device)]
    return _nested(values_RD, lengths_N)


def stack_or_nest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack equal-shape rows; reconstruct as a jagged nested tensor when ragged.

    Args:
        tensors: N per-row tensors ``[L_i, *D]`` (or all of one shape), one dtype.

    Returns:
        ``torch.empty(0)`` for no rows; ``torch.stack(tensors)`` when every row has the same
        shape; else a ``torch.jagged`` nested tensor ``[N, j, *D]`` (the rows concatenated once).

    Raises:
        ValueError: rows that differ in anything but their first dim (dims, D or dtype), or
            0-d rows of different shapes.
    """
    if not tensors:
        return torch.empty(0)
    first = tensors[0]
    if all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
        return torch.stack(list(tensors))
    for i, t in enumerate(tensors):
        if t.ndim < 1 or t.ndim != first.ndim or t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"row {i} has shape {tuple(t.shape)}, row 0 {tuple(first.shape)}: rows may differ "
                "in their first (sequence) dim only"
            )
        if t.dtype != first.dtype:
            raise ValueError(f"row {i} is {t.dtype}, row 0 {first.dtype}: rows share one dtype")
    lengths_N = torch.tensor([int(t.shape[0]) for t in tensors], dtype=torch.int64)
    return _nested(torch.cat(list(tensors), 0), lengths_N)


def maybe_pack_jagged(val: Any, lengths: Any) -> Any:
    """Convert ``val`` to jagged iff it looks like a per-token field of these rows.

    Shape-strict, so that a 3-D extra (image features ``[N, K, H]``) is not mistaken for a
    per-token field: only ``val.shape == (N, max(lengths), ...)`` with ``N == len(lengths)``
    qualifies. Every write site using it gives all per-token fields the same row lengths.

    Args:
        val: a value of a column dict (anything; only a rectangular tensor may change).
        lengths: ``[N]`` valid row lengths.

    Returns:
        A ``torch.jagged`` nested tensor (:func:`to_nested_by_length`) when the shape matches;
        otherwise ``val`` unchanged.
    """
    if not isinstance(val, torch.Tensor) or is_njt(val) or val.is_nested or val.ndim < 2:
        return val
    lengths_N = _cpu_lengths(lengths)
    n = lengths_N.numel()
    if n == 0 or val.shape[0] != n or val.shape[1] != _longest(lengths_N):
        return val
    return to_nested_by_length(val, lengths_N)


def pack_per_token_field(val: Any, lengths: Any) -> Any:
    """Force-jaggedize a known per-token field, tolerating sequence-parallel padding.

    For write-back sites that know the field is per-token (log-probs of a forward pass): a
    sequence-parallel forward rounds its seq dim up to a multiple of the parallel size, so the
    value may be wider than ``max(lengths)``; each row is cut to its own length and the trailing
    padding dropped.

    Args:
        val: per-token tensor ``[N, S, *D]`` with ``S >= max(lengths)``.
        lengths: ``[N]`` valid row lengths.

    Returns:
        A ``torch.jagged`` nested tensor when the shape allows; ``val`` unchanged when it
        cannot be jaggedized (already nested, not a tensor, < 2 dims, another batch dim, or a
        seq dim shorter than ``max(lengths)``).
    """
    if not isinstance(val, torch.Tensor) or is_njt(val) or val.is_nested or val.ndim < 2:
        return val
    lengths_N = _cpu_lengths(lengths)
    if val.shape[0] != lengths_N.numel() or val.shape[1] < _longest(lengths_N):
        return val
    return to_nested_by_length(val, lengths_N)


def pack_jagged_fields(
    fields: Mapping[str, Any], *, lengths: Any | None
) -> Any:  # -> tensordict.TensorDict
    """Pack a column dict into the wire layout of a put: a ``TensorDict`` ``[N]``.

    A layout transform, not serialization (the queue client encodes it): per-token tensors
    ``[N, max(lengths), ...]`` become ``torch.jagged`` views (:func:`maybe_pack_jagged`), other
    tensors pass through rectangular, jagged nested tensors pass through, numeric numpy arrays
    become tensors (zero copy), object arrays and lists become ``NonTensorStack`` leaves (one
    object per row).

    Args:
        fields: column name -> tensor ``[N, ...]``, jagged nested tensor, ``np.ndarray``
            (numeric or ``dtype=object``) or list of N objects.
        lengths: ``[N]`` valid row lengths deciding which tensors become jagged; None turns
            nothing jagged (every tensor passes through rectangular).

    Returns:
        ``TensorDict`` with ``batch_size=[N]``: N from ``lengths``, else from the first field's
        rows (0 without fields).

    Raises:
        TypeError: a value of another type (names the field).
        ValueError: a field whose row count is not N (names the field).
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

    lengths_N = None if lengths is None else _cpu_lengths(lengths)
    out: dict[str, Any] = {}
    for name, val in fields.items():
        if isinstance(val, np.ndarray) and val.dtype != object:
            val = torch.from_numpy(val)
        if isinstance(val, torch.Tensor):
            out[name] = val if lengths_N is None else maybe_pack_jagged(val, lengths_N)
        elif isinstance(val, np.ndarray | list):
            out[name] = NonTensorStack(*(NonTensorData(o) for o in list(val)))
        elif isinstance(val, NonTensorStack | TensorDictBase):
            out[name] = val
        else:
            raise TypeError(
                f"field {name!r} is a {type(val).__name__}; pack_jagged_fields takes tensors, "
                "numpy arrays and lists of per-row objects"
            )
    if lengths_N is not None:
        n = lengths_N.numel()
    else:
        n = next((_rows_of(v) for v in out.values()), 0)
    for name, val in out.items():
        if _rows_of(val) != n:
            raise ValueError(f"field {name!r} has {_rows_of(val)} rows, the batch {n}")
    if not out:
        return TensorDict({}, batch_size=[n])
    return TensorDict(out, batch_size=[n])


def _rows_of(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.shape[0]) if val.ndim else 0
    return int(val.batch_size[0]) if len(val.batch_size) else 0


def response_from_nested(full: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Extract the response slice from a (prompt + response) nested tensor, shifted left by one.

    For per-token outputs of a forward pass (log-probs): position t predicts token t + 1, so the
    values for the A_i response tokens of row i are ``full[i, P_i - 1 : P_i + A_i - 1]``.

    Args:
        full: ``torch.jagged`` nested tensor ``[N, P_i + A_i, *D]``.
        response_mask: ``torch.jagged`` nested tensor ``[N, A_i]``; only its row lengths are
            read (the response lengths).

    Returns:
        ``torch.jagged`` nested tensor ``[N, A_i, *D]`` (one gather of ``full``'s values).

    Raises:
        ValueError: either is not a jagged nested tensor, they disagree on N, or a row has no
            prompt token before its response (its first response token has no prediction).
    """
    for arg, x in (("full", full), ("response_mask", response_mask)):
        if not is_njt(x):
            raise ValueError(
                f"{arg} must be a torch.jagged nested tensor, got {_describe(x)}; build it with "
                "to_nested_by_length"
            )
    values_RD, offsets_N1 = njt_parts(full)
    offsets_N1 = offsets_N1.cpu()
    full_N = offsets_N1.diff()
    _, resp_offsets = njt_parts(response_mask)
    resp_N = resp_offsets.cpu().diff()
    if full_N.numel() != resp_N.numel():
        raise ValueError(f"full has {full_N.numel()} rows, response_mask {resp_N.numel()}")
    prompt_N = full_N - resp_N
    short = (prompt_N < 1) & (resp_N > 0)
    if bool(short.any()):
        i = int(short.nonzero()[0])
        raise ValueError(
            f"row {i} has {int(full_N[i])} tokens for a {int(resp_N[i])}-token response: a "
            "response needs at least one prompt token before it (the left shift)"
        )
    # row i's response values start at offsets[i] + P_i - 1 of full's values
    starts_N = offsets_N1[:-1] + prompt_N - 1
    total = int(resp_N.sum())
    out_starts_N = torch.cumsum(resp_N, 0) - resp_N  # where row i starts in the output
    index_A = torch.arange(total) + torch.repeat_interleave(starts_N - out_starts_N, resp_N)
    return _nested(values_RD.index_select(0, index_A.to(values_RD.device)), resp_N)


def unwrap_wire_stripped_payload(item: Any) -> Any:
    """Recover the payload of a possibly wire-stripped ``NonTensorData``.

    An encoder that serializes a ``TensorDictBase`` by its tensor items only turns a
    ``NonTensorData`` (payload outside the tensor items) into an empty ``TensorDict({},
    batch_size=[])``. Exactly that signature maps to None (the payload is gone); anything else
    passes through unchanged, so that real data is never dropped: a TensorDict with tensor
    fields or a batch size, a ``NonTensorData`` that kept its payload, any non-TensorDict value.

    Args:
        item: a value read back from a TensorDict-carrying transport.

    Returns:
        None for a stripped ``NonTensorData``, else ``item``.
    """
    import sys

    td_mod = sys.modules.get("tensordict")
    if td_mod is None or not isinstance(item, td_mod.TensorDictBase):
        return item  # no TensorDict was ever built in this process: nothing was stripped
    payload = getattr(item, "_non_tensordict", None)
    if payload and any(v is not None for v in payload.values()):
        return item
    if len(item.batch_size) or len(list(item.keys())):
        return item
    return None


# -- TensorDicts: the reader's side -----------------------------------------------------------


def materialize(
    td: Any,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, int | float | bool] | None = None,
    pad_to_seqlen: int = 0,
) -> dict[str, Any]:
    """Turn a wire TensorDict (or a claim's fields) into the tensors a trainer consumes.

    Args:
        td: ``TensorDict`` ``[N]`` (jagged nested tensors, tensors ``[N, ...]``,
            ``NonTensorStack`` / ``NonTensorData``), or a mapping of field -> the same or
            ``JaggedColumn`` (``QueueClient.claim(...)["fields"]``).
        layout: ``"padded"``: each jagged field right-padded to ``[N, S, *D]`` with
            ``pad_value_dict[field]`` (0 when absent), S its longest row; ``"jagged"``: jagged
            fields as ``torch.jagged`` nested tensors (for callers that consume them so).
            Rectangular fields pass through either way.
        pad_value_dict: pad value per field name (names not in ``td`` are ignored).
        pad_to_seqlen: with ``"padded"`` and > 0, S is this absolute length for every jagged
            field (a forward pass's fixed target); 0 keeps each field's natural S.

    Returns:
        field -> tensor (rectangular or nested) or ``np.ndarray(dtype=object)`` of N objects
        for non-tensor fields, in ``td``'s order.

    Raises:
        ValueError: an unknown layout, a negative ``pad_to_seqlen``, a field longer than
            ``pad_to_seqlen``, a fractional pad value for an integer field (names the field).
        TypeError: a field of a type it cannot materialize (names it).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if int(pad_to_seqlen) < 0:
        raise ValueError(f"pad_to_seqlen={pad_to_seqlen} must be >= 0 (0: the longest row)")
    pads = pad_value_dict or {}
    out: dict[str, Any] = {}
    for name, val in _leaves(td):
        if isinstance(val, JaggedColumn):
            val = njt_from_parts(val.values, val.offsets) if layout == "jagged" else val
        elif isinstance(val, torch.Tensor) and not is_njt(val) and val.is_nested:
            if layout == "padded":  # a strided nested tensor: torch pads it
                val = torch.nested.to_padded_tensor(val, float(pads.get(name, 0)))
            out[name] = val
            continue
        if isinstance(val, JaggedColumn) or is_njt(val):
            if layout == "padded":
                val = _pad_jagged(name, val, pads.get(name, 0), int(pad_to_seqlen))
            out[name] = val
        elif isinstance(val, torch.Tensor):
            out[name] = val
        elif _is_non_tensor(val):
            out[name] = _object_array(val.tolist())
        else:
            raise TypeError(
                f"field {name!r} is a {_describe(val)}; materialize takes tensors, jagged "
                "nested tensors, JaggedColumns and NonTensorStack/NonTensorData"
            )
    return out


def _leaves(td: Any) -> list[tuple[str, Any]]:
    """(name, leaf) pairs of a TensorDict (``get``: non-tensor leaves stay wrapped) or mapping."""
    if isinstance(td, Mapping):
        return list(td.items())
    if hasattr(td, "batch_size") and hasattr(td, "get"):
        return [(name, td.get(name)) for name in td.keys()]
    raise TypeError(f"materialize takes a TensorDict or a mapping of fields, got {_describe(td)}")


def _is_non_tensor(val: Any) -> bool:
    import sys

    td_mod = sys.modules.get("tensordict")
    return td_mod is not None and isinstance(val, td_mod.NonTensorData | td_mod.NonTensorStack)


def _object_array(items: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of ``items`` (lists stay objects, never become dims)."""
    arr = np.empty(len(items), dtype=object)
    arr[:] = [None] * len(items)  # placeholder so that list items are not broadcast
    for i, item in enumerate(items):
        arr[i] = item
    return arr


def _pad_jagged(
    name: str, val: torch.Tensor | JaggedColumn, pad: int | float | bool, width: int
) -> torch.Tensor:
    """``[N, S, *D]`` of a jagged field, each row copied once (S = ``width`` or the longest)."""
    if isinstance(val, JaggedColumn):
        values_RD, offsets_N1 = val.values, val.offsets
    else:
        values_RD, offsets_N1 = njt_parts(val)
    if isinstance(pad, float) and not pad.is_integer() and not values_RD.is_floating_point():
        raise ValueError(
            f"field {name!r} is {values_RD.dtype} and cannot be padded with {pad}; give it an "
            "integer pad value in pad_value_dict"
        )
    lengths = offsets_N1.diff().tolist()
    longest = max(lengths, default=0)
    if width and longest > width:
        raise ValueError(
            f"field {name!r} has a row of {longest} positions > pad_to_seqlen={width}; raise "
            "pad_to_seqlen or truncate the rows"
        )
    if not lengths:
        return values_RD.new_empty((0, width, *values_RD.shape[1:]))
    if longest == 0:  # pad_sequence cannot size a rectangle of empty rows
        return torch.full(
            (len(lengths), width, *values_RD.shape[1:]),
            pad,
            dtype=values_RD.dtype,
            device=values_RD.device,
        )
    return pad_rows(values_RD.split(lengths), pad, width)
