"""Jagged -> padded: per-token fields travel jagged, and the padding is paid once, per batch.

``columns_to_samples`` splits the columns of a claim (one values + one offsets tensor per jagged
field, as the wire delivers them) into per-sample row views without copying (the trainer's feed
sorts and groups them into micro-batches); ``pad_rows`` copies each row once into its
rectangle. The schema-driven batch on top (which pad value and width each field gets) is
:func:`xtoken_core.data.sample.pad_samples`.

Legend: N rows (samples), S padded sequence length, L_i the length of row i, D... trailing
per-token dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from xtoken_core.wire.tensors import JaggedColumn, is_jagged

# pad_sequence fills with a float64: integers up to this magnitude come through exactly.
_EXACT_FLOAT64_INT = 2**53


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        kind = "nested tensor" if x.is_nested else "tensor"
        return f"{kind} shape={tuple(x.shape)} dtype={x.dtype}"
    return type(x).__name__


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
