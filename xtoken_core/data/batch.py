"""The padded batch of claimed jagged fields: the one schema-driven padding of every consumer.

A claim from the queue returns a batch's fields as columns: per-token and per-chunk fields
jagged (``JaggedColumn`` or a ``torch.jagged`` nested tensor; dense ``[B, L]`` when every row has
the same length), per-sample fields dense ``[B]``. :func:`pad_batch` pads them with the pad values
of :data:`xtoken_core.data.sample.SAMPLE_FIELDS` (chunk ids -1, masks False, ids the tokenizers'
pad ids) to the schema's widths; :func:`xtoken_core.data.sample.pad_samples` pads jagged samples
through it too, so a trainer gets the same tensors from a claim as from ``CrossTokenizerCollator``
for the same texts. The padding itself is ``xtoken_core.data_plane.codec.pad_jagged``.

Legend: B samples, T student tokens, U teacher tokens, C chunks, L the common row length of a
dense column, D trailing dims.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from xtoken_core.data import sample as schema
from xtoken_core.data_plane.codec import pad_jagged
from xtoken_core.wire.tensors import JaggedColumn, is_jagged

__all__ = ["pad_batch"]

_PADDED_AXES = (schema.STUDENT_TOKEN, schema.TEACHER_TOKEN, schema.CHUNK)


def _is_jagged(value: Any) -> bool:
    return isinstance(value, JaggedColumn) or is_jagged(value)


def _num_rows(name: str, value: Any) -> int:
    if isinstance(value, JaggedColumn):
        return value.num_rows
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return int(value.size(0))
    got = "a 0-d tensor" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"field {name!r} is {got}; a batch field is a JaggedColumn, a jagged nested tensor or "
        "a tensor [B, ...]"
    )


def _column(name: str, value: Any) -> JaggedColumn:
    """A padded-axis field as a JaggedColumn (dense ``[B, L, *D]``: B rows of length L)."""
    if isinstance(value, JaggedColumn):
        return value
    if is_jagged(value):
        return JaggedColumn.from_nested(value)
    if value.dim() < 2:
        raise ValueError(
            f"field {name!r} has shape {tuple(value.shape)}; a per-token or per-chunk field is "
            "jagged or [B, L]"
        )
    b, length = int(value.size(0)), int(value.size(1))
    offsets_B1 = torch.arange(b + 1, dtype=torch.int64) * length
    return JaggedColumn(value.reshape(b * length, *value.shape[2:]), offsets_B1)


def _dtype(value: Any) -> torch.dtype:
    return value.values.dtype if isinstance(value, JaggedColumn) else value.dtype


def pad_batch(
    fields: Mapping[str, JaggedColumn | torch.Tensor],
    *,
    student_pad_id: int,
    teacher_pad_id: int,
    names: Iterable[str] | None = None,
    pad_values: Mapping[str, int | float | bool] | None = None,
    make_seq_div_by_student: int = 1,
    make_seq_div_by_teacher: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-pad the claimed fields of B samples into a batch.

    Fields of the sample schema pad with its pad values to the widths of ``pad_samples``:
    ``T = round_up(max(1, longest), make_seq_div_by_student)`` (U likewise), ``C = max(1, most
    chunks)``, computed per axis (from the axis' length field when present, else from the rows)
    so that every field of an axis gets the same width. Other jagged fields pad to their longest
    row with ``pad_values[name]``, else :func:`~xtoken_core.data.sample.default_pad` (a
    per-teacher ``teacher<i>_alignment_*`` field like its ``alignment_*`` field: chunk ids -1,
    never 0); dense fields are returned as they are.

    Args:
        fields: name -> ``JaggedColumn`` / jagged nested tensor of B rows, or tensor ``[B, ...]``
            (a claim's ``fields``).
        student_pad_id: pad id of ``input_ids``.
        teacher_pad_id: pad id of ``teacher_input_ids``.
        names: the fields to return (default: all of ``fields``).
        pad_values: pad values that replace the schema's (or the 0 of other fields), by name.
        make_seq_div_by_student: T is rounded up to a multiple of this.
        make_seq_div_by_teacher: U is rounded up to a multiple of this.

    Returns:
        name -> tensor: per-student-token fields ``[B, T]``, per-teacher-token ``[B, U]``,
        per-chunk ``[B, C]``, other jagged fields ``[B, longest, *D]``, dense ones unchanged.
        Padded tensors are new; on the device of their values.

    Raises:
        ValueError: a name not in ``fields``, a divisor < 1, fields with different B, a schema
            field with the wrong dtype or a per-sample field that is jagged, or fields of one axis
            whose rows disagree in length (names both).
    """
    selected = list(fields) if names is None else list(names)
    missing = [n for n in selected if n not in fields]
    if missing:
        raise ValueError(f"pad_batch: no field {missing} in the batch; it has {sorted(fields)}")
    divisors = {
        schema.STUDENT_TOKEN: int(make_seq_div_by_student),
        schema.TEACHER_TOKEN: int(make_seq_div_by_teacher),
        schema.CHUNK: 1,
    }
    for arg, div in (
        ("make_seq_div_by_student", make_seq_div_by_student),
        ("make_seq_div_by_teacher", make_seq_div_by_teacher),
    ):
        if int(div) < 1:
            raise ValueError(f"{arg} must be >= 1, got {div!r}")
    pads: dict[str, Any] = schema.pad_values(
        student_pad_id=student_pad_id, teacher_pad_id=teacher_pad_id
    )
    pads.update(pad_values or {})

    batch_size, first = None, None
    for name, value in fields.items():
        rows = _num_rows(name, value)
        if batch_size is None:
            batch_size, first = rows, name
        elif rows != batch_size:
            raise ValueError(
                f"field {name!r} has {rows} rows but {first!r} has {batch_size}; the fields of a "
                "batch come from one claim"
            )
        spec = schema.FIELDS_BY_NAME.get(name)
        if spec is None:
            continue
        if _dtype(value) != spec.dtype:
            raise ValueError(f"field {name!r}: expected {spec.dtype}, got {_dtype(value)}")
        if spec.axis == schema.SAMPLE and _is_jagged(value):
            raise ValueError(f"field {name!r} is per-sample ([B]) but arrived jagged")

    columns: dict[str, JaggedColumn] = {}
    widths: dict[str, int] = {}
    for axis in _PADDED_AXES:
        length_name = schema.LENGTH_FIELD[axis]
        lengths_B, source = None, None
        if length_name in fields:
            lengths_B, source = fields[length_name].to("cpu", torch.int64), length_name
        for name in schema.fields_on_axis(axis):
            if name not in fields:
                continue
            columns[name] = column = _column(name, fields[name])
            rows_B = column.lengths().cpu()
            if lengths_B is None:
                lengths_B, source = rows_B, name
            elif not torch.equal(rows_B, lengths_B):
                raise ValueError(
                    f"field {name!r} has rows of lengths {rows_B.tolist()} but {source!r} says "
                    f"{lengths_B.tolist()}; the fields of a sample come from one collate_one call"
                )
        if lengths_B is not None:
            longest = int(lengths_B.max()) if lengths_B.numel() else 0
            widths[axis] = schema.round_up(longest, divisors[axis])

    out: dict[str, torch.Tensor] = {}
    for name in selected:
        value = fields[name]
        spec = schema.FIELDS_BY_NAME.get(name)
        if spec is not None and spec.axis != schema.SAMPLE:
            out[name] = pad_jagged(columns[name], pads[name], widths[spec.axis])
        elif _is_jagged(value):
            out[name] = pad_jagged(value, pads.get(name, schema.default_pad(name)))
        else:
            out[name] = value
    return out
