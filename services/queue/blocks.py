"""Stored field blocks: one field of one put, dense [N, ...] or jagged, and reads over them.

Legend: N samples in a request, R rows of a block, S the total tokens of a jagged field (its
``values`` leading dimension).

A put keeps each field as ONE block, usually views into the received wire buffers (zero-copy).
Reads of consecutive rows of one block are slices; other reads gather run by run (a run is a
stretch of consecutive rows of one block), never one tensor op per sample for contiguous rows.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable

import torch

from services.queue.errors import StoreError
from xtoken_core.ipc.shm import ShmTensorHandle
from xtoken_core.wire.shm import ShmField
from xtoken_core.wire.tensors import JaggedColumn, RawJagged, RawTensor, is_jagged, tensor_bytes

# A block whose live rows hold less than this share of its storage bytes is copied down.
COMPACT_BELOW = 0.5

FieldValue = torch.Tensor | JaggedColumn
# What a wire read returns: the rows' bytes, ready for encode_message (no torch op per read).
WireValue = RawTensor | RawJagged


def as_field(name: str, value: object, n: int) -> FieldValue:
    """Normalize a put field to a dense tensor [N, ...] or a JaggedColumn of N rows.

    Args:
        name: field name, for error messages.
        value: dense tensor [N, ...], ``torch.jagged`` nested tensor [N, j, ...], or JaggedColumn.
        n: number of keys in the put.

    Returns:
        The dense tensor or a JaggedColumn.

    Raises:
        StoreError: ``bad_request`` when the row count or the offsets do not match.
    """
    if isinstance(value, torch.Tensor) and value.is_nested:
        if not is_jagged(value):
            raise StoreError(
                "bad_request",
                f"field {name!r}: nested layout {value.layout} is not supported; "
                "send a torch.jagged nested tensor",
            )
        try:
            value = JaggedColumn.from_nested(value)
        except ValueError as e:
            raise StoreError("bad_request", f"field {name!r}: {e}") from None
    if isinstance(value, JaggedColumn):
        if value.num_rows != n:
            raise StoreError(
                "bad_request",
                f"field {name!r}: {value.num_rows} jagged rows do not match {n} keys; "
                "send one row per key",
            )
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() < 1 or value.shape[0] != n:
            raise StoreError(
                "bad_request",
                f"field {name!r}: shape {tuple(value.shape)} does "
                f"not have {n} rows (one per key); send [N, ...] or a jagged tensor",
            )
        return value
    raise StoreError(
        "bad_request",
        f"field {name!r}: {type(value).__name__} is not a tensor; "
        "send a tensor [N, ...] or a torch.jagged nested tensor",
    )


def storage_id(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


class Block:
    """One field of one put: R rows, dense or jagged, plus which rows are still live."""

    __slots__ = (
        "field",
        "values",
        "offsets",
        "offs",
        "jagged",
        "keys",
        "live",
        "storages",
        "nbytes",
        "row_nbytes",
        "live_bytes",
        "partition",
        "_wire",
        "row_stride",
    )

    def __init__(self, partition: str, field_name: str, value: FieldValue, keys: list[str]):
        self.partition = partition
        self.field = field_name
        self.keys: list[str | None] = list(keys)
        self.live = len(keys)
        if isinstance(value, JaggedColumn):
            self.jagged = True
            self.values = value.values
            self.offsets = value.offsets
            self.offs: list[int] = value.offsets.tolist()
            per_token = value.values.element_size() * math.prod(value.values.shape[1:])
            offs = self.offs
            self.row_nbytes = [(offs[i + 1] - offs[i]) * per_token + 8 for i in range(len(keys))]
            tensors = (value.values, value.offsets)
        else:
            self.jagged = False
            self.values = value
            self.offsets = None
            self.offs = []
            row = value.element_size() * math.prod(value.shape[1:])
            self.row_nbytes = [row] * len(keys)
            tensors = (value,)
        self.storages = {storage_id(t) for t in tensors}
        self.nbytes = sum(size for _, size in self.storages)
        self.live_bytes = sum(self.row_nbytes)
        self._wire: memoryview | None = None
        # bytes per value row (per token of a jagged field, per sample of a dense one)
        self.row_stride = self.values.element_size() * math.prod(self.values.shape[1:])

    def wire_bytes(self) -> memoryview | None:
        """The values' bytes as one 1-D memoryview (cached), or None when not contiguous."""
        if self._wire is None:
            if not self.values.is_contiguous():
                return None
            self._wire = tensor_bytes(self.values)
        return self._wire

    def row(self, i: int) -> torch.Tensor:
        if self.jagged:
            return self.values[self.offs[i] : self.offs[i + 1]]
        return self.values[i]


def schema_of(value: FieldValue) -> tuple[bool, torch.dtype, tuple[int, ...]]:
    if isinstance(value, JaggedColumn):
        return (True, value.values.dtype, tuple(value.values.shape[1:]))
    return (False, value.dtype, tuple(value.shape[1:]))


def runs_of(cells: list[tuple[Block, int]]) -> list[tuple[Block, int, int]]:
    """Group (block, row) cells into runs of consecutive rows of one block: (block, r0, r1)."""
    runs: list[tuple[Block, int, int]] = []
    block0, r0 = cells[0]
    prev = r0
    for block, r in cells[1:]:
        if block is block0 and r == prev + 1:
            prev = r
            continue
        runs.append((block0, r0, prev + 1))
        block0, r0, prev = block, r, r
    runs.append((block0, r0, prev + 1))
    return runs


# Called before rows are read: (storage data pointer, first byte, end byte in that storage).
Check = Callable[[int, int, int], None]


def check_cells(cells: list[tuple[Block, int]], check: Check) -> None:
    """Call ``check`` on the bytes each run of the cells' rows occupies in its storage."""
    for block, r0, r1 in runs_of(cells):
        values = block.values
        storage = values.untyped_storage().data_ptr()
        at = values.data_ptr() - storage
        first, stop = (block.offs[r0], block.offs[r1]) if block.jagged else (r0, r1)
        check(storage, at + first * block.row_stride, at + stop * block.row_stride)


def assemble(cells: list[tuple[Block, int]]) -> FieldValue:
    """Build one field of N rows from (block, row) cells; a single run is a zero-copy view."""
    runs = runs_of(cells)
    if not runs[0][0].jagged:
        pieces = [block.values[r0:r1] for block, r0, r1 in runs]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if len(runs) == 1:
        # One run (the common claim/get): a view of values, offsets from the Python copy.
        block, r0, r1 = runs[0]
        start, stop = block.offs[r0], block.offs[r1]
        offsets = block.offsets[r0 : r1 + 1]
        if start and r1 - r0 <= 32:  # a small list beats two tensor ops
            offsets = torch.tensor([o - start for o in block.offs[r0 : r1 + 1]], dtype=torch.int64)
        elif start:
            offsets = offsets - start
        return _trusted_column(block.values[start:stop], offsets)
    values, lengths = [], []
    for block, r0, r1 in runs:
        start, stop = block.offs[r0], block.offs[r1]
        values.append(block.values[start:stop])
        offs = block.offs
        lengths.extend(offs[r + 1] - offs[r] for r in range(r0, r1))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return _trusted_column(torch.cat(values), offsets)


def assemble_wire(cells: list[tuple[Block, int]]) -> FieldValue | WireValue:
    """``assemble`` for a reply: the rows as bytes (RawJagged / RawTensor), no torch op.

    A single run is a zero-copy memoryview slice of the block's values; several runs are joined
    into one bytes object (one copy, as ``assemble`` would make). Falls back to ``assemble``
    for blocks whose values are not contiguous.
    """
    runs = runs_of(cells)
    views = [block.wire_bytes() for block, _, _ in runs]
    if any(v is None for v in views):
        return assemble(cells)
    block0 = runs[0][0]
    stride = block0.row_stride
    dtype, inner = block0.values.dtype, tuple(block0.values.shape[1:])
    if not block0.jagged:
        n = sum(r1 - r0 for _, r0, r1 in runs)
        if len(runs) == 1:
            _, r0, r1 = runs[0]
            data = views[0][r0 * stride : r1 * stride]
        else:
            data = b"".join(v[r0 * stride : r1 * stride] for v, (_, r0, r1) in zip(views, runs))
        return RawTensor(dtype, (n, *inner), data)
    if len(runs) == 1:
        block, r0, r1 = runs[0]
        offs = block.offs
        start, stop = offs[r0], offs[r1]
        offsets = array("q", [o - start for o in offs[r0 : r1 + 1]] if start else offs[r0 : r1 + 1])
        return RawJagged(
            dtype, inner, r1 - r0, stop - start, views[0][start * stride : stop * stride], offsets
        )
    pieces, offsets, total = [], array("q", [0]), 0
    for v, (block, r0, r1) in zip(views, runs):
        offs = block.offs
        start, stop = offs[r0], offs[r1]
        pieces.append(v[start * stride : stop * stride])
        offsets.extend([o - start + total for o in offs[r0 + 1 : r1 + 1]])
        total += stop - start
    return RawJagged(dtype, inner, len(offsets) - 1, total, b"".join(pieces), offsets)


# Where a tensor lives in shared memory: (segment name, segment size, mapping address) or None.
Locate = Callable[[torch.Tensor], tuple[str, int, int] | None]


def assemble_shm(
    cells: list[tuple[Block, int]], locate: Locate
) -> FieldValue | WireValue | ShmField:
    """``assemble_wire`` for a reply that may reference shared memory: rows that are one run of
    a block stored in a shared segment become a ``ShmField`` (values by reference, jagged
    offsets rebased and inline); anything else falls back to ``assemble_wire`` (frames)."""
    runs = runs_of(cells)
    where = locate(runs[0][0].values) if len(runs) == 1 else None
    if where is None or not runs[0][0].values.is_contiguous():
        return assemble_wire(cells)
    name, size, base = where
    block, r0, r1 = runs[0]
    values = block.values
    stride = block.row_stride
    inner = tuple(values.shape[1:])
    at = values.data_ptr() - base
    if not block.jagged:
        shape = (r1 - r0, *inner)
        handle = ShmTensorHandle(
            name, size, at + r0 * stride, (r1 - r0) * stride, values.dtype, shape
        )
        return ShmField(handle)
    offs = block.offs
    start, stop = offs[r0], offs[r1]
    shape = (stop - start, *inner)
    handle = ShmTensorHandle(
        name, size, at + start * stride, (stop - start) * stride, values.dtype, shape
    )
    offsets = array("q", [o - start for o in offs[r0 : r1 + 1]])
    return ShmField(handle, offsets.tobytes())


def _trusted_column(values: torch.Tensor, offsets: torch.Tensor) -> JaggedColumn:
    """A JaggedColumn built from offsets the store already validated (skips re-checking)."""
    column = JaggedColumn.__new__(JaggedColumn)
    column.values, column.offsets = values, offsets
    return column


def gather_rows(value: FieldValue, rows: list[int]) -> FieldValue:
    """Rows ``rows`` of a field (views where the rows are one run)."""
    if isinstance(value, JaggedColumn):
        offs = value.offsets.tolist()
        if rows == list(range(rows[0], rows[-1] + 1)):
            start = offs[rows[0]]
            return JaggedColumn(
                value.values[start : offs[rows[-1] + 1]],
                value.offsets[rows[0] : rows[-1] + 2] - start,
            )
        return JaggedColumn.from_rows([value.values[offs[r] : offs[r + 1]] for r in rows])
    return (
        value[rows[0] : rows[-1] + 1]
        if rows == list(range(rows[0], rows[-1] + 1))
        else value[torch.tensor(rows, dtype=torch.int64)]
    )


def copy_rows(value: FieldValue) -> FieldValue:
    """A compact copy owning its own storage."""
    if isinstance(value, JaggedColumn):
        start, stop = int(value.offsets[0]), int(value.offsets[-1])
        return JaggedColumn(value.values[start:stop].clone(), (value.offsets - start).clone())
    return value.clone()
