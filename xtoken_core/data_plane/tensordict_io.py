"""TensorDict <-> queue fields: how a user's ``TensorDict [N]`` crosses the wire and comes back.

The queue's fields are tensors and jagged columns only, and the wire does not change for
TensorDicts:

* a ``torch.jagged`` nested leaf ``[N, j, *D]`` is its ``JaggedColumn`` (values + offsets
  views: one values and one offsets frame whatever N is); a dense leaf ``[N, ...]`` passes
  through;
* a non-tensor leaf is a jagged ``uint8`` field whose row i is the msgpack bytes of
  ``ExtType(OBJECT_ROW_EXT, msgpack(obj_i))`` (``OBJECT_DATA_EXT`` for a ``NonTensorData``,
  one object for the whole batch, repeated on every row). The server sees an ordinary field;
  a reader recognizes such a column by every row being exactly one such ext value and gives it
  back as a ``NonTensorStack`` (``NonTensorData`` when every row is the same batch-wide
  object). Objects are msgpack values (None, bool, int, float, str, bytes, lists, maps):
  tuples come back as lists. A zero-row column cannot be told from a ``uint8`` one and comes
  back as a nested tensor.

Back from a claim or a get, jagged columns become nested tensors over the same values (no copy:
views of the received frames or of the server's shared-memory pool).

Legend: N rows (samples), R total rows of a jagged values tensor, D... trailing per-token dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch

from xtoken_core.data_plane.njt import is_njt, njt_from_parts, njt_parts
from xtoken_core.jagged import JaggedColumn

__all__ = [
    "OBJECT_DATA_EXT",
    "OBJECT_ROW_EXT",
    "NonTensorLeafError",
    "fields_to_tensordict",
    "is_tensordict",
    "tensordict_to_fields",
]

# msgpack ext codes of a non-tensor row (inside a uint8 field's bytes, never a wire ext type).
OBJECT_ROW_EXT = 79  # "O": row i of a NonTensorStack
OBJECT_DATA_EXT = 68  # "D": the one object of a NonTensorData, repeated on every row
_EXT_CODES = (OBJECT_ROW_EXT, OBJECT_DATA_EXT)
# msgpack ext headers: fixext 1/2/4/8/16 (0xd4..0xd8) and ext 8/16/32 (0xc7..0xc9)
_EXT_HEADS = frozenset((0xD4, 0xD5, 0xD6, 0xD7, 0xD8, 0xC7, 0xC8, 0xC9))


class NonTensorLeafError(ValueError, TypeError):
    """A non-tensor leaf holds a value msgpack cannot carry (a ValueError for callers that
    check input, a TypeError for those that check serializability)."""


def is_tensordict(x: Any) -> bool:
    """True for a ``TensorDictBase`` (without importing tensordict when nobody did)."""
    import sys

    td_mod = sys.modules.get("tensordict")
    return td_mod is not None and isinstance(x, td_mod.TensorDictBase)


def tensordict_to_fields(
    td: Any, keys: Sequence[str] | None = None
) -> dict[str, torch.Tensor | JaggedColumn]:
    """Turn a TensorDict ``[N]`` into the ``fields`` of a queue put (no tensor is copied).

    Args:
        td: ``TensorDict`` with ``batch_size=[N]``: ``torch.jagged`` nested tensors
            ``[N, j, *D]`` (ragged dim 1), tensors ``[N, ...]``, ``NonTensorStack`` /
            ``NonTensorData`` of msgpack values.
        keys: the put's N keys, to check the batch size against (None: not checked).

    Returns:
        name -> ``JaggedColumn`` (jagged and non-tensor leaves) or tensor ``[N, ...]``.

    Raises:
        NonTensorLeafError: a non-tensor leaf msgpack cannot carry (one line naming the key).
        ValueError: a batch size that is not ``[len(keys)]``, a nested TensorDict, a strided
            nested tensor or one ragged in another dim, a ``uint8`` jagged leaf whose rows read
            as objects (names the key).
        TypeError: ``td`` is not a TensorDict.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if not isinstance(td, TensorDictBase):
        raise TypeError(f"expected a TensorDict, got {type(td).__name__}")
    if len(td.batch_size) != 1:
        raise ValueError(
            f"TensorDict batch_size={list(td.batch_size)}: a put needs a 1-D batch [N], one row "
            "per key (reshape it, or move extra batch dims into the leaves)"
        )
    n = int(td.batch_size[0])
    if keys is not None and len(keys) != n:
        raise ValueError(f"TensorDict batch_size=[{n}] but {len(keys)} keys: give one key per row")
    out: dict[str, torch.Tensor | JaggedColumn] = {}
    for name in td.keys():
        val = td.get(name)
        if isinstance(val, NonTensorStack):
            out[name] = _object_column(name, val.tolist(), OBJECT_ROW_EXT, n)
        elif isinstance(val, NonTensorData):
            out[name] = _object_column(name, [val.data], OBJECT_DATA_EXT, n)
        elif isinstance(val, TensorDictBase):
            raise ValueError(
                f"leaf {name!r} is a nested {type(val).__name__}; queue fields are flat: put "
                "td.flatten_keys('.')"
            )
        elif is_njt(val):
            try:
                col = JaggedColumn(*njt_parts(val))
            except ValueError as e:
                raise ValueError(f"leaf {name!r}: {e}") from None
            if col.values.dtype == torch.uint8 and _objects(col) is not None:
                raise ValueError(
                    f"leaf {name!r} is uint8 rows that read back as msgpack objects; put it as "
                    "a NonTensorStack of its objects, or as another dtype"
                )
            out[name] = col
        elif isinstance(val, torch.Tensor) and val.is_nested:
            raise ValueError(
                f"leaf {name!r} is a nested tensor of layout {val.layout}; the wire carries "
                "torch.jagged only: build it with torch.nested.nested_tensor(rows, "
                "layout=torch.jagged)"
            )
        elif isinstance(val, torch.Tensor):
            out[name] = val
        else:
            raise TypeError(
                f"leaf {name!r} is a {type(val).__name__}; a TensorDict for the queue holds "
                "tensors, jagged nested tensors and NonTensorStack/NonTensorData"
            )
    return out


def fields_to_tensordict(fields: Mapping[str, Any], keys: Sequence[str] | None = None) -> Any:
    """Turn the ``fields`` of a claim or get reply into a TensorDict ``[N]`` (no tensor copied).

    Args:
        fields: name -> ``JaggedColumn``, jagged nested tensor ``[N, j, *D]`` or tensor
            ``[N, ...]``; non-tensor columns (module docstring) are recognized.
        keys: the reply's keys: N = ``len(keys)`` (else the fields' row count, 0 without).

    Returns:
        ``TensorDict`` with ``batch_size=[N]``: jagged fields as ``torch.jagged`` nested
        tensors whose ``values()`` are the received values tensors, dense fields unchanged,
        non-tensor columns as ``NonTensorStack`` (``NonTensorData`` for a put's
        ``NonTensorData``).

    Raises:
        ValueError: fields that disagree on N, or with ``keys``.
        TypeError: a field of another type (names it).
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    out: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for name, val in fields.items():
        col = val if isinstance(val, JaggedColumn) else None
        if col is None and is_njt(val):
            col = JaggedColumn(*njt_parts(val))
        if col is not None:
            counts[name] = col.num_rows
            found = _objects(col) if col.values.dtype == torch.uint8 else None
            if found is None:
                out[name] = val if is_njt(val) else njt_from_parts(col.values, col.offsets)
                continue
            code, items = found
            if code == OBJECT_DATA_EXT and all(o == items[0] for o in items):
                out[name] = NonTensorData(items[0], batch_size=[col.num_rows])
            else:
                # one NonTensorData per row: from_list would turn list items into dims
                out[name] = NonTensorStack(*(NonTensorData(o) for o in items))
        elif isinstance(val, torch.Tensor) and not val.is_nested and val.ndim >= 1:
            counts[name] = int(val.shape[0])
            out[name] = val
        else:
            raise TypeError(
                f"field {name!r} is a {type(val).__name__}; expected a JaggedColumn, a jagged "
                "nested tensor or a tensor [N, ...]"
            )
    if keys is not None:
        counts["(keys)"] = len(keys)
    if len(set(counts.values())) > 1:
        raise ValueError(f"fields disagree on the number of rows: {counts}")
    n = next(iter(counts.values()), 0)
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)
    if new_unsafe is not None:  # every leaf's rows were counted above: skip the re-checks
        return new_unsafe(out, batch_size=torch.Size([n]))
    return TensorDict(out, batch_size=[n])  # pragma: no cover - older tensordict


def _object_column(name: str, objects: list[Any], code: int, n: int) -> JaggedColumn:
    """N rows of msgpack ext values as one uint8 column (``objects`` has N entries, or 1)."""
    try:
        rows = [
            msgpack.packb(msgpack.ExtType(code, msgpack.packb(o, use_bin_type=True)))
            for o in objects
        ]
    except (TypeError, ValueError, OverflowError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NonTensorLeafError(
            f"non-tensor leaf {name!r} holds a value msgpack cannot carry ({reason}); non-tensor "
            "leaves hold None, bool, int, float, str, bytes, lists and maps of them"
        ) from None
    if len(rows) != n:
        rows = rows * n  # NonTensorData: the same bytes on every row
    lengths_N = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets_N1 = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths_N, 0, out=offsets_N1[1:])
    data = b"".join(rows)
    values_R = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return JaggedColumn(values_R, offsets_N1)


def _objects(col: JaggedColumn) -> tuple[int, list[Any]] | None:
    """(ext code, N objects) when every row of a uint8 column is exactly one object ext value,
    else None. Reads one header first: a column of other bytes costs next to nothing."""
    if col.values.ndim != 1 or col.num_rows == 0:
        return None
    offsets = col.offsets.tolist()
    if offsets[1] == offsets[0] or int(col.values[offsets[0]]) not in _EXT_HEADS:
        return None
    values = col.values if col.values.device.type == "cpu" else col.values.cpu()
    data = memoryview(values.contiguous().numpy())
    codes: set[int] = set()

    def ext_hook(code: int, payload: bytes) -> Any:
        if code not in _EXT_CODES:
            raise ValueError("not an object row")
        codes.add(code)
        return _Object(msgpack.unpackb(payload, raw=False, strict_map_key=False))

    objects: list[Any] = []
    try:
        for start, end in zip(offsets[:-1], offsets[1:]):
            if end == start or data[start] not in _EXT_HEADS:
                return None
            # exactly one value per row (ExtraData otherwise), and that value the ext itself
            row = msgpack.unpackb(data[start:end], ext_hook=ext_hook)
            if not isinstance(row, _Object):
                return None
            objects.append(row.value)
    except (ValueError, msgpack.UnpackException):
        return None
    return (OBJECT_DATA_EXT if codes == {OBJECT_DATA_EXT} else OBJECT_ROW_EXT), objects


class _Object:
    """The decoded payload of one object row (tells it apart from a value the row held)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value
