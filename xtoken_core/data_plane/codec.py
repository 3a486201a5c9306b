"""Jagged <-> padded codec: per-token fields travel jagged, padding is paid only on materialize.

``pad_jagged`` right-pads jagged rows into a rectangle (the padding under the trainer's batch,
:func:`xtoken_core.data.batch.pad_batch`); ``materialize`` turns the fields of a claim into
rectangular tensors, each jagged field padded with its own pad value; ``columns_to_samples``
splits claimed columns into per-sample rows (the trainer's feed sorts and groups them into
micro-batches), ``samples_to_columns`` is its inverse. xtoken has no BatchedDataDict:
``materialize`` returns a plain ``dict[str, Tensor | np.ndarray]``, which is what the trainer
indexes and what ``torch`` ops accept directly.

Legend: N rows (samples), S padded sequence length, L_i the length of row i, R = sum L_i the
total rows of a jagged values tensor, D... trailing per-token dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from xtoken_core.wire.tensors import JaggedColumn, is_jagged

Layout = Literal["padded", "jagged"]
LAYOUTS: tuple[str, ...] = ("padded", "jagged")
# pad_jagged copies row by row on the CPU when rows are at least this long on average.
_ROW_COPY_MIN_MEAN_LEN = 64
# pad_sequence fills with a float64: integers up to this magnitude come through exactly.
_EXACT_FLOAT64_INT = 2**53


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
