"""Jagged <-> padded codec: per-token fields travel jagged, padding is paid only on materialize.

Writer side: variable-length fields become ``torch.jagged`` nested tensors (``[N, j, *D]``)
before a put (``to_nested_by_length``, ``maybe_pack_jagged``, ``pack_jagged_fields``). Reader
side: ``materialize`` turns the fields of a claim into rectangular tensors, padding each jagged
field with its own pad value. xtoken has no BatchedDataDict: ``materialize`` returns a plain
``dict[str, Tensor | np.ndarray]``, which is what the trainer indexes and what ``torch`` ops
accept directly (the TensorDict batch-size bookkeeping is no help once the rows are padded).

Legend: N rows (samples), S padded sequence length, L_i the length of row i, R = sum L_i the
total rows of a jagged values tensor, D... trailing per-token dims, P_i / Q_i prompt / response
lengths of row i.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from xtoken_core.wire.tensors import JaggedColumn, is_jagged

logger = logging.getLogger(__name__)

Layout = Literal["padded", "jagged"]
LAYOUTS: tuple[str, ...] = ("padded", "jagged")
# pad_jagged copies row by row on the CPU when rows are at least this long on average.
_ROW_COPY_MIN_MEAN_LEN = 64


def _check_lengths(lengths_N: torch.Tensor, n: int, max_len: int | None = None) -> torch.Tensor:
    """Return lengths as a CPU int64 vector after checking them (one device sync at most)."""
    if not isinstance(lengths_N, torch.Tensor) or lengths_N.ndim != 1:
        raise ValueError(f"lengths must be a 1-D tensor [N], got {_describe(lengths_N)}")
    if lengths_N.dtype.is_floating_point or lengths_N.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got dtype {lengths_N.dtype}")
    if lengths_N.numel() != n:
        raise ValueError(f"lengths has {lengths_N.numel()} entries for {n} rows; pass one per row")
    lengths_N = lengths_N.detach().to("cpu", torch.int64)
    if n and int(lengths_N.min()) < 0:
        raise ValueError(f"lengths hold a negative value {int(lengths_N.min())}")
    if max_len is not None and n and int(lengths_N.max()) > max_len:
        raise ValueError(
            f"a length {int(lengths_N.max())} exceeds the padded sequence length {max_len}"
        )
    return lengths_N


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = "nested tensor" if x.is_nested else "tensor"
        return f"{kind} shape={tuple(x.shape)} dtype={x.dtype}"
    return type(x).__name__


def _offsets(lengths_N: torch.Tensor) -> torch.Tensor:
    offsets_N1 = torch.zeros(lengths_N.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths_N, 0, out=offsets_N1[1:])
    return offsets_N1


def to_nested_by_length(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Strip right-padding off a rectangular tensor using per-row lengths.

    One masked gather on the tensor's device; CUDA lengths are moved to the CPU once.

    Args:
        padded: ``[N, S, *D]``.
        lengths: ``[N]`` integer, ``0 <= lengths[i] <= S``.

    Returns:
        ``torch.jagged`` nested tensor ``[N, j, *D]`` whose row i is ``padded[i, :lengths[i]]``
        (a copy: the rows are packed together).

    Raises:
        ValueError: ``padded`` has fewer than 2 dims, or lengths do not fit it.
    """
    if not isinstance(padded, torch.Tensor) or padded.is_nested or padded.ndim < 2:
        raise ValueError(
            f"padded must be a rectangular tensor [N, S, ...], got {_describe(padded)}"
        )
    n, s = padded.shape[0], padded.shape[1]
    lengths_N = _check_lengths(lengths, n, s)
    keep_NS = torch.arange(s).unsqueeze(0) < lengths_N.unsqueeze(1)
    values_RD = padded[keep_NS.to(padded.device)]
    return torch.nested.nested_tensor_from_jagged(values_RD, _offsets(lengths_N).to(padded.device))


def stack_or_nest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack equal-shape rows; rebuild ragged rows as a jagged nested tensor.

    Args:
        tensors: N rows; ragged rows ``[L_i, *D]`` must share D and dtype.

    Returns:
        ``torch.empty(0)`` for no rows; ``[N, *shape]`` when all rows share a shape; otherwise a
        ``torch.jagged`` nested tensor ``[N, j, *D]``.

    Raises:
        ValueError: rows differ in a dim other than the first, in ndim, or in dtype.
    """
    if len(tensors) == 0:
        return torch.empty(0)
    first = tensors[0]
    if all(t.shape == first.shape for t in tensors):
        return torch.stack(list(tensors))
    try:
        return JaggedColumn.from_rows(list(tensors)).to_nested()
    except ValueError as e:
        raise ValueError(
            f"stack_or_nest: rows are neither equal-shape nor ragged in dim 0: {e}"
        ) from None


def unwrap_wire_stripped_payload(item: Any) -> Any:
    """Recover the payload of a possibly wire-stripped ``NonTensorData``.

    A serializer that encodes any TensorDict as its tensor items turns ``NonTensorData`` (whose
    payload is not a tensor) into an empty ``TensorDict({}, batch_size=[])``. Exactly that
    signature maps to ``None``; a ``NonTensorData`` yields its ``.data``; anything else
    (TensorDicts with tensors, with a batch size, or with a salvageable ``_non_tensordict``
    payload) passes through unchanged so that real data is never dropped.

    Args:
        item: any value.

    Returns:
        The payload, ``None`` for the stripped signature, or ``item`` itself.
    """
    if isinstance(item, NonTensorData):
        return item.data
    if isinstance(item, TensorDictBase):
        payload = getattr(item, "_non_tensordict", None)
        if isinstance(payload, dict) and "data" in payload:
            return payload["data"]
        if item.batch_size == torch.Size([]) and item.is_empty():
            return None
    return item


def maybe_pack_jagged(val: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Convert ``val`` to jagged iff it looks like a per-token field.

    Shape-strict on purpose (no false positives on extras such as ``[N, 3, ...]`` features):
    only ``val.shape[:2] == (N, max(lengths))`` qualifies.

    Args:
        val: any tensor (nested tensors pass through).
        lengths: ``[N]`` per-row valid lengths.

    Returns:
        A ``torch.jagged`` nested tensor ``[N, j, *D]``, or ``val`` unchanged.

    Raises:
        ValueError: ``lengths`` is not a 1-D integer tensor or holds negative values.
    """
    n = lengths.shape[0] if isinstance(lengths, torch.Tensor) and lengths.ndim == 1 else -1
    lengths_N = _check_lengths(lengths, n)
    if not isinstance(val, torch.Tensor) or val.is_nested or val.ndim < 2 or n == 0:
        return val
    if val.shape[0] != n or val.shape[1] != int(lengths_N.max()):
        return val
    return to_nested_by_length(val, lengths_N)


def pack_per_token_field(val: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Force a known per-token field to jagged, tolerating extra right-padding.

    Unlike ``maybe_pack_jagged`` the seq dim may be wider than ``max(lengths)`` (e.g. rounded
    up to a multiple of the tensor-parallel size); each row is cut to its own length.

    Args:
        val: ``[N, S, *D]`` with ``S >= max(lengths)``.
        lengths: ``[N]`` per-row valid lengths.

    Returns:
        A ``torch.jagged`` nested tensor ``[N, j, *D]``; ``val`` unchanged when it cannot be
        jaggedized (nested already, fewer than 2 dims, wrong N, or S < max(lengths)).

    Raises:
        ValueError: ``lengths`` is not a 1-D integer tensor or holds negative values.
    """
    n = lengths.shape[0] if isinstance(lengths, torch.Tensor) and lengths.ndim == 1 else -1
    lengths_N = _check_lengths(lengths, n)
    if not isinstance(val, torch.Tensor) or val.is_nested or val.ndim < 2 or val.shape[0] != n:
        return val
    if n and val.shape[1] < int(lengths_N.max()):
        logger.debug("pack_per_token_field: S=%d < max length, left rectangular", val.shape[1])
        return val
    return to_nested_by_length(val, lengths_N)


def pack_jagged_fields(
    fields: Mapping[str, torch.Tensor | np.ndarray], *, lengths: torch.Tensor | None
) -> TensorDict:
    """Pack a column dict into the put layout: per-token fields jagged, others rectangular.

    A layout transform, not serialization: tensors stay views where possible. Numeric numpy
    arrays become tensors (shared memory), object arrays become ``NonTensorStack`` leaves.

    Args:
        fields: column name -> tensor ``[N, ...]``, nested tensor ``[N, j, ...]`` or
            ``np.ndarray`` with N rows.
        lengths: ``[N]`` per-row lengths for ``maybe_pack_jagged``; ``None`` disables jagged
            conversion (every tensor passes through).

    Returns:
        ``TensorDict`` with ``batch_size=[N]``; N from ``lengths``, else from the first field's
        leading dim (0 for no fields: a difference from the reference, whose N would be 0 and
        then could not hold any field).

    Raises:
        TypeError: a value that is not a tensor or numpy array.
        ValueError: fields disagree on N.
    """
    if lengths is not None:
        n = int(lengths.shape[0]) if isinstance(lengths, torch.Tensor) and lengths.ndim == 1 else -1
        _check_lengths(lengths, n)
    else:
        n = None
    out: dict[str, Any] = {}
    for name, val in fields.items():
        if isinstance(val, np.ndarray):
            if val.dtype == object:
                out[name] = NonTensorStack.from_list(list(val))
                rows = len(val)
            else:
                val = torch.from_numpy(val)
        if isinstance(val, torch.Tensor):
            if lengths is not None:
                val = maybe_pack_jagged(val, lengths)
            out[name] = val
            rows = int(val.size(0)) if val.ndim else -1
        elif name not in out:
            raise TypeError(
                f"field {name!r} is a {type(val).__name__}; pack_jagged_fields takes tensors and "
                "numpy arrays"
            )
        n = rows if n is None else n
        if rows != n:
            raise ValueError(
                f"field {name!r} has {rows} rows, expected N={n}: give every field N rows"
            )
    return TensorDict(out, batch_size=[n or 0])


def response_from_nested(full: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Extract the left-shifted response slice of (prompt+response) rows.

    ``full`` follows the next-token convention: ``full[i, p]`` belongs to the prediction of
    token ``p + 1`` (e.g. logprobs). Row i has ``P_i + Q_i`` positions, ``Q_i`` from
    ``response_mask``'s offsets, so the response tokens ``P_i .. P_i+Q_i-1`` are predicted at
    positions ``P_i - 1 .. P_i + Q_i - 2``: that is the slice returned.

    Args:
        full: jagged nested ``[N, j, *D]`` with rows of ``P_i + Q_i`` positions.
        response_mask: jagged nested ``[N, j]``; only its offsets are read (``Q_i``).

    Returns:
        Jagged nested ``[N, j, *D]`` with rows of ``Q_i`` positions.

    Raises:
        ValueError: not jagged, N differs, or a row with ``Q_i > 0`` has no prompt token
            (``P_i == 0``: nothing predicts its first response token).
    """
    if not is_jagged(full) or not is_jagged(response_mask):
        raise ValueError(
            f"full and response_mask must be torch.jagged nested tensors, got {_describe(full)} "
            f"and {_describe(response_mask)}"
        )
    full_col = JaggedColumn.from_nested(full)
    q_N = JaggedColumn.from_nested(response_mask).lengths().cpu()
    if q_N.numel() != full_col.num_rows:
        raise ValueError(f"response_mask has {q_N.numel()} rows, full has {full_col.num_rows}")
    full_off_N1 = full_col.offsets.cpu()
    len_N = full_off_N1.diff()
    bad = (q_N > 0) & (q_N >= len_N)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"row {i} has {int(len_N[i])} positions for a {int(q_N[i])}-token response; it "
            "needs at least one prompt token before the response"
        )
    start_N = full_off_N1[1:] - q_N - 1
    out_off_N1 = _offsets(q_N)
    total = int(out_off_N1[-1])
    index_R = torch.repeat_interleave(start_N - out_off_N1[:-1], q_N, output_size=total)
    index_R += torch.arange(total)
    values = full_col.values[index_R.to(full_col.values.device)]
    return torch.nested.nested_tensor_from_jagged(values, out_off_N1.to(values.device))


def pad_jagged(
    column: JaggedColumn | torch.Tensor, pad_value: int | float | bool = 0, seqlen: int = 0
) -> torch.Tensor:
    """Right-pad jagged rows into a rectangle (one scatter, any dtype, N = 0 allowed).

    Args:
        column: ``JaggedColumn`` or jagged nested tensor ``[N, j, *D]``.
        pad_value: value of the padding positions.
        seqlen: pad to this S (>= the longest row); 0 = the longest row.

    Returns:
        ``[N, S, *D]``.

    Raises:
        ValueError: a row is longer than ``seqlen``.
    """
    col = column if isinstance(column, JaggedColumn) else JaggedColumn.from_nested(column)
    lengths_N = col.lengths().cpu()
    longest = int(lengths_N.max()) if lengths_N.numel() else 0
    if seqlen and longest > seqlen:
        raise ValueError(
            f"a row has {longest} positions > pad_to_seqlen={seqlen}; raise pad_to_seqlen or "
            "truncate the rows"
        )
    s, n = seqlen or longest, col.num_rows
    values_RD = col.values
    out_NSD = torch.full(
        (n, s, *values_RD.shape[1:]), pad_value, dtype=values_RD.dtype, device=values_RD.device
    )
    r = values_RD.shape[0]
    if values_RD.device.type == "cpu" and r >= _ROW_COPY_MIN_MEAN_LEN * n:
        # Long rows on the CPU: one memcpy per row beats any index arithmetic (3-4x measured).
        for i, row in enumerate(col.rows()):
            out_NSD[i, : row.shape[0]] = row
        return out_NSD
    # Short rows or an accelerator: one index_copy_, no per-row launches.
    dest_R = torch.repeat_interleave(
        torch.arange(n) * s - col.offsets[:-1].cpu(), lengths_N, output_size=r
    ) + torch.arange(r)
    out_NSD.view(n * s, *values_RD.shape[1:]).index_copy_(0, dest_R.to(values_RD.device), values_RD)
    return out_NSD


def materialize(
    td: TensorDictBase | Mapping[str, Any],
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, int | float] | None = None,
    pad_to_seqlen: int = 0,
) -> dict[str, Any]:
    """Convert wire fields (a TensorDict or a decoded body's ``fields``) to trainer tensors.

    Args:
        td: TensorDict or mapping of field -> tensor ``[N, ...]``, jagged nested tensor,
            ``JaggedColumn``, ``NonTensorStack`` or ``NonTensorData``.
        layout: ``"padded"`` pads every jagged leaf to ``[N, S, *D]`` with
            ``pad_value_dict.get(name, 0)``; rectangular leaves pass through. ``"jagged"``
            returns jagged leaves as nested tensors (for code that consumes them).
        pad_value_dict: per-field pad values for ``"padded"``.
        pad_to_seqlen: when > 0, jagged leaves are padded to exactly this S (a forward pass's
            target length); rectangular leaves are left alone. 0 = the longest row.

    Returns:
        A plain ``dict``: rectangular tensors (padded) or nested tensors (jagged) and
        ``np.ndarray(dtype=object)`` for non-tensor leaves.

    Raises:
        ValueError: unknown layout, negative ``pad_to_seqlen``, a row longer than it.
        TypeError: a leaf of another type.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if not isinstance(pad_to_seqlen, int) or pad_to_seqlen < 0:
        raise ValueError(f"pad_to_seqlen={pad_to_seqlen!r}: must be an int >= 0 (0 = natural)")
    pads = pad_value_dict or {}
    items = td.items() if isinstance(td, TensorDictBase | Mapping) else None
    if items is None:
        raise TypeError(f"materialize takes a TensorDict or a mapping, got {type(td).__name__}")
    out: dict[str, Any] = {}
    for name, val in items:
        if isinstance(val, NonTensorStack):
            out[name] = _object_array(val.tolist())
        elif isinstance(val, NonTensorData):
            n = val.batch_size[0] if len(val.batch_size) else None
            out[name] = (
                _object_array([val.data] * n) if n is not None else np.array(val.data, dtype=object)
            )
        elif isinstance(val, JaggedColumn) or is_jagged(val):
            if layout == "padded":
                out[name] = pad_jagged(val, pads.get(name, 0), pad_to_seqlen)
            else:
                out[name] = val.to_nested() if isinstance(val, JaggedColumn) else val
        elif isinstance(val, torch.Tensor) and not val.is_nested:
            out[name] = val
        elif isinstance(val, TensorDictBase):
            out[name] = materialize(val, layout, pad_value_dict, pad_to_seqlen)
        else:
            raise TypeError(
                f"field {name!r} is a {_describe(val)}; materialize handles tensors, jagged "
                "nested tensors, JaggedColumn and NonTensorStack/NonTensorData"
            )
    return out


def _object_array(items: list[Any]) -> np.ndarray:
    """1-D object array of the items (list items stay objects, never a 2-D array)."""
    arr = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        arr[i] = x
    return arr


def samples_to_columns(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Turn per-sample dicts into columns: equal-shape fields stacked, ragged ones jagged.

    Args:
        samples: N dicts with the same keys; ``sample[k]`` is ``[L_i, *D]`` or a fixed shape.

    Returns:
        field -> ``[N, ...]`` tensor or jagged nested ``[N, j, *D]`` (``stack_or_nest``).

    Raises:
        ValueError: samples have different keys, or a field is neither stackable nor ragged.
    """
    if not samples:
        return {}
    keys = list(samples[0])
    for i, s in enumerate(samples):
        if list(s) != keys and set(s) != set(keys):
            raise ValueError(f"sample {i} has keys {sorted(s)}, sample 0 has {sorted(keys)}")
    return {k: stack_or_nest([s[k] for s in samples]) for k in keys}


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


def to_wire_fields(td: TensorDictBase | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Return the fields of a TensorDict as a plain dict for a wire ``put`` body.

    Args:
        td: TensorDict (or mapping) of tensors and jagged nested tensors.

    Returns:
        field -> tensor / nested tensor (the same objects: no copy).

    Raises:
        TypeError: a non-tensor leaf (they cannot travel: nothing is pickled on the wire).
    """
    out: dict[str, torch.Tensor] = {}
    for name, val in td.items():
        if isinstance(val, JaggedColumn) or (
            isinstance(val, torch.Tensor) and (not val.is_nested or is_jagged(val))
        ):
            out[name] = val
        else:
            raise TypeError(
                f"field {name!r} is a {_describe(val)}; only tensors and jagged nested tensors "
                "travel on the wire (send strings as msgpack values outside 'fields')"
            )
    return out


def from_wire_fields(fields: Mapping[str, Any]) -> TensorDict:
    """Wrap decoded wire fields (tensors, jagged nested, JaggedColumn) in a ``TensorDict [N]``.

    Args:
        fields: field -> column with N rows.

    Returns:
        ``TensorDict`` with ``batch_size=[N]`` (N = 0 for no fields), columns as nested tensors.

    Raises:
        ValueError: columns disagree on N.
    """
    out = {
        name: (col.to_nested() if isinstance(col, JaggedColumn) else col)
        for name, col in fields.items()
    }
    counts = {name: int(col.size(0)) for name, col in out.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"fields disagree on the number of rows: {counts}")
    return TensorDict(out, batch_size=[next(iter(counts.values()), 0)])
