"""TensorDict <-> queue fields: the one conversion between a user's TensorDict and the wire.

A TensorDict ``[N]`` (TransferQueue's convention, reference/codec.md) holds per-token fields as
``torch.jagged`` nested tensors ``[N, j, *D]``, per-sample fields as tensors ``[N, ...]`` and
non-tensor fields as ``NonTensorStack`` (one object per row) or ``NonTensorData`` (one object for
the batch). The queue's ``fields`` carry tensors and ``JaggedColumn``s only, so:

* a jagged field is its ``JaggedColumn`` (values + offsets views: one values and one offsets
  frame on the wire, whatever N is); a dense field passes through;
* a non-tensor field is a jagged ``uint8`` column whose row i is the msgpack bytes of
  ``ExtType(OBJECT_ROW_EXT, msgpack(obj_i))`` (``OBJECT_DATA_EXT`` for a ``NonTensorData``, every
  row then holding the same object). The wire and the server see an ordinary field; a reader
  recognizes such a column by every row being exactly one such ext value, and gives it back as
  a ``NonTensorStack`` (``NonTensorData`` when every row is a ``OBJECT_DATA_EXT`` of one value).
  Objects are msgpack values (None, bool, int, float, str, bytes, lists, str-keyed maps):
  tuples come back as lists. A zero-row column cannot be told apart from a uint8 one and comes
  back as a tensor.

Back from a claim or a get, jagged columns become nested tensors over the same values (no copy:
views of the received frames or of the server's shared-memory pool). :func:`materialize` pads a
TensorDict into the trainer's batch by the sample schema (:func:`xtoken_core.data.batch.pad_batch`:
chunk ids -1, masks False, ids the tokenizers' pad ids).

Legend: N rows (samples), R total rows of a jagged values tensor, D... trailing per-token dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from xtoken_core.data.batch import pad_batch
from xtoken_core.data_plane.codec import LAYOUTS, Layout
from xtoken_core.data_plane.codec import materialize as materialize_fields
from xtoken_core.jagged import JaggedColumn, is_jagged

__all__ = [
    "OBJECT_DATA_EXT",
    "OBJECT_ROW_EXT",
    "fields_to_tensordict",
    "materialize",
    "tensordict_to_fields",
]

# msgpack ext codes of a non-tensor row (inside a uint8 field's bytes, never a wire ext type).
OBJECT_ROW_EXT = 79  # "O": row i of a NonTensorStack
OBJECT_DATA_EXT = 68  # "D": the one object of a NonTensorData, repeated on every row
_EXT_CODES = (OBJECT_ROW_EXT, OBJECT_DATA_EXT)
# msgpack ext headers: fixext 1/2/4/8/16 (0xd4..0xd8) and ext 8/16/32 (0xc7..0xc9).
_FIXEXT_SIZES = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_EXT_LENGTH_BYTES = {0xC7: 1, 0xC8: 2, 0xC9: 4}


def tensordict_to_fields(
    td: TensorDictBase, keys: Sequence[str] | None = None
) -> dict[str, torch.Tensor | JaggedColumn]:
    """Turn a TensorDict ``[N]`` into the ``fields`` of a queue put (no tensor is copied).

    Args:
        td: TensorDict with ``batch_size=[N]``: jagged nested tensors ``[N, j, *D]`` (ragged
            dim 1), tensors ``[N, ...]``, ``NonTensorStack`` / ``NonTensorData`` of msgpack
            values.
        keys: the put's N keys, to check the batch size against (None: not checked).

    Returns:
        name -> ``JaggedColumn`` (jagged and non-tensor fields) or tensor ``[N, ...]``.

    Raises:
        TypeError: ``td`` is not a TensorDict; a field of a type the wire cannot carry (a
            strided nested tensor, a nested TensorDict, a non-msgpack object); names the field.
        ValueError: a batch size that is not ``[len(keys)]``, or a jagged field ragged in a
            dim other than 1; names the field.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"expected a TensorDict, got {type(td).__name__}")
    if len(td.batch_size) != 1:
        raise ValueError(
            f"TensorDict batch_size={list(td.batch_size)}: a put needs a 1-D batch [N], one row "
            "per key (reshape it, or move extra batch dims into the fields)"
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
            raise TypeError(
                f"field {name!r} is a nested {type(val).__name__}; the queue's fields are flat: "
                "td.flatten_keys('.') first"
            )
        elif is_jagged(val):
            try:
                out[name] = JaggedColumn.from_nested(val)
            except ValueError as e:
                raise ValueError(f"field {name!r}: {e}") from None
        elif isinstance(val, torch.Tensor) and val.is_nested:
            raise TypeError(
                f"field {name!r} is a nested tensor of layout {val.layout}; the wire carries "
                "torch.jagged only: build it with torch.nested.nested_tensor(rows, "
                "layout=torch.jagged)"
            )
        elif isinstance(val, torch.Tensor):
            out[name] = val
        else:
            raise TypeError(
                f"field {name!r} is a {type(val).__name__}; a TensorDict for the queue holds "
                "tensors, jagged nested tensors and NonTensorStack/NonTensorData"
            )
    return out


def fields_to_tensordict(
    fields: Mapping[str, Any], keys: Sequence[str] | None = None
) -> TensorDict:
    """Turn the ``fields`` of a claim or get reply into a TensorDict ``[N]`` (no tensor copied).

    Args:
        fields: name -> ``JaggedColumn``, jagged nested tensor ``[N, j, *D]`` or tensor
            ``[N, ...]``; non-tensor columns (see the module docstring) are recognized.
        keys: the reply's keys; N = ``len(keys)`` (else the fields' row count, 0 without fields).

    Returns:
        ``TensorDict`` with ``batch_size=[N]``: jagged fields as ``torch.jagged`` nested
        tensors whose ``values()`` are the received values tensors, dense fields unchanged,
        non-tensor columns as ``NonTensorStack`` (``NonTensorData`` for a put's
        ``NonTensorData``).

    Raises:
        ValueError: fields that disagree on N, or with ``keys``.
        TypeError: a field of another type.
    """
    out: dict[str, Any] = {}
    objects: dict[str, tuple[int, list[Any]]] = {}
    counts: dict[str, int] = {}
    for name, val in fields.items():
        col = val if isinstance(val, JaggedColumn) else None
        if col is None and is_jagged(val):
            col = JaggedColumn.from_nested(val)
        if col is not None:
            counts[name] = col.num_rows
            rows = _objects(col)
            if rows is not None:
                objects[name] = rows
            out[name] = val if is_jagged(val) else col.to_nested()
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
    td = TensorDict({}, batch_size=[n])
    for name, val in out.items():
        if name in objects:
            code, items = objects[name]
            if code == OBJECT_DATA_EXT and all(o == items[0] for o in items):
                val = NonTensorData(items[0], batch_size=[n])
            else:
                # one NonTensorData per row: from_list would stack list items into dims
                val = NonTensorStack(*(NonTensorData(o) for o in items))
        td.set(name, val)
    return td


def materialize(
    td: TensorDictBase,
    layout: Layout = "padded",
    *,
    student_pad_id: int | None = None,
    teacher_pad_id: int | None = None,
    pad_values: Mapping[str, int | float | bool] | None = None,
    make_seq_div_by_student: int = 1,
    make_seq_div_by_teacher: int = 1,
) -> dict[str, Any]:
    """The trainer's batch from a TensorDict of claimed samples.

    Unlike :func:`xtoken_core.data_plane.codec.materialize` (one pad value per field, 0 by
    default), ``"padded"`` pads by the sample schema through
    :func:`xtoken_core.data.batch.pad_batch`: chunk ids with -1, masks with False, ids with the
    pad ids, every field of an axis to one width.

    Args:
        td: TensorDict ``[N]`` (e.g. ``claim(..., as_tensordict=True)["fields"]``).
        layout: ``"padded"`` (rectangular ``[N, T]`` / ``[N, U]`` / ``[N, C]`` tensors) or
            ``"jagged"`` (nested tensors as they are).
        student_pad_id: pad id of ``input_ids``; needed only when the batch has it.
        teacher_pad_id: pad id of ``teacher_input_ids``; needed only when the batch has it.
        pad_values: pad values by field name, replacing the schema's (or 0 for other fields).
        make_seq_div_by_student: T is rounded up to a multiple of this.
        make_seq_div_by_teacher: U is rounded up to a multiple of this.

    Returns:
        name -> tensor (padded or nested) or ``np.ndarray(dtype=object)`` for non-tensor
        fields.

    Raises:
        ValueError: an unknown layout, a missing pad id for a field present, or what
            ``pad_batch`` refuses (rows of one axis that disagree in length, wrong dtypes).
        TypeError: ``td`` is not a TensorDict.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"materialize takes a TensorDict, got {type(td).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if layout == "jagged":
        return materialize_fields(td, "jagged")
    pads = dict(pad_values or {})
    for field, pad_id, arg in (
        ("input_ids", student_pad_id, "student_pad_id"),
        ("teacher_input_ids", teacher_pad_id, "teacher_pad_id"),
    ):
        if field in td.keys() and pad_id is None and field not in pads:
            raise ValueError(
                f"field {field!r} needs a pad id: pass {arg}= (the tokenizer's pad id)"
            )
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for name in td.keys():
        val = td.get(name)
        if isinstance(val, NonTensorData | NonTensorStack):
            objects[name] = val
        else:
            tensors[name] = val
    padded = pad_batch(
        tensors,
        student_pad_id=0 if student_pad_id is None else student_pad_id,
        teacher_pad_id=0 if teacher_pad_id is None else teacher_pad_id,
        pad_values=pads,
        make_seq_div_by_student=make_seq_div_by_student,
        make_seq_div_by_teacher=make_seq_div_by_teacher,
    )
    padded.update(materialize_fields(objects))
    return {name: padded[name] for name in td.keys()}


def _object_column(name: str, objects: list[Any], code: int, n: int) -> JaggedColumn:
    """N rows of msgpack ext values as one uint8 column (``objects`` has N or 1 entries)."""
    try:
        rows = [msgpack.packb(msgpack.ExtType(code, _packb(o)), use_bin_type=True) for o in objects]
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(
            f"field {name!r} holds a value msgpack cannot carry ({e}); non-tensor fields hold "
            "None, bool, int, float, str, bytes, lists and str-keyed maps"
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


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=False)


def _objects(col: JaggedColumn) -> tuple[int, list[Any]] | None:
    """(ext code, N objects) when every row of a uint8 column is one object ext value."""
    if col.values.dtype != torch.uint8 or col.values.ndim != 1 or col.num_rows == 0:
        return None
    data = memoryview(
        col.values.cpu().contiguous().numpy()
    )  # rows are read in place, a header at a time
    offsets = col.offsets.cpu().tolist()
    codes, objects = set(), []
    for start, end in zip(offsets[:-1], offsets[1:]):
        found = _ext_payload(data, start, end)
        if found is None:
            return None
        code, body = found
        try:
            objects.append(msgpack.unpackb(body, raw=False, strict_map_key=False))
        except (ValueError, msgpack.UnpackException):
            return None
        codes.add(code)
    return (OBJECT_DATA_EXT if codes == {OBJECT_DATA_EXT} else OBJECT_ROW_EXT), objects


def _ext_payload(data: memoryview, start: int, end: int) -> tuple[int, memoryview] | None:
    """(code, payload) of the one object ext value that is ``data[start:end]``, else None."""
    if end - start < 3:
        return None
    head = data[start]
    if head in _FIXEXT_SIZES:
        size, at = _FIXEXT_SIZES[head], start + 1
    elif head in _EXT_LENGTH_BYTES:
        at = start + 1 + _EXT_LENGTH_BYTES[head]
        if at >= end:
            return None
        size = int.from_bytes(data[start + 1 : at], "big")
    else:
        return None
    code = data[at] if data[at] < 128 else data[at] - 256
    if code not in _EXT_CODES or at + 1 + size != end:
        return None
    return code, data[at + 1 : end]
