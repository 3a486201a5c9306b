"""The sample schema: field names, dtypes, axes and pad values of one collated sample.

A collated sample travels *jagged* (no padding): every per-token field is a 1-D tensor of the
sample's own length, every per-chunk field a 1-D tensor of ``alignment_num_chunks`` entries, and
every per-sample field a 0-d tensor. A trainer materializes a right-padded batch with
:func:`pad_samples`, which yields exactly the tensors that ``CrossTokenizerCollator.__call__``
returns for the same texts (a test holds both to equality).

Shape legend: B samples in a batch, T student tokens, U teacher tokens, C chunks (alignment
pairs). Padded widths: ``T = round_up(max(1, longest student sample), make_seq_div_by_student)``
(same for U with the teacher divisor), ``C = max(1, most chunks in the batch)``; the widths are
never 0, so an all-empty batch still yields [B, >=1] tensors (all padding).

Masks and pads:

* ``token_mask`` / ``teacher_token_mask`` (bool): True on the sample's real tokens, False on
  padding. A per-token loss multiplies by ``token_mask.float()``.
* ``sample_mask`` (float32, 0-d / [B]): 1.0 for a sample with at least one student token, 0.0 for
  an empty text (it stays in the batch, in its slot, but contributes nothing).
* ``input_ids`` pads with the student pad id, ``teacher_input_ids`` with the teacher pad id
  (see ``CrossTokenizerCollator.pad_values``), chunk ids with -1, masks with False.

Packed rows (``CrossTokenizerCollator(pack=True)``, :mod:`xtoken_core.data.packing`): a sample is a
row of several whole documents and carries two more per-token fields, :data:`PACKED_FIELDS`:
``position_ids`` / ``teacher_position_ids`` (int32), each document's positions from 0, so a 0
marks where a document starts. Padding writes 0 there: every pad token is a document of its own.
Either every sample of a batch has them or none; the frames of a put grow by the two fields'
buffers, never per document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from xtoken_core.data_plane.codec import pad_rows

# Axes of a field in one jagged sample.
STUDENT_TOKEN = "student_token"  # [T]
TEACHER_TOKEN = "teacher_token"  # [U]
CHUNK = "chunk"  # [C]
SAMPLE = "sample"  # 0-d

# Symbolic pad values resolved per run by :func:`pad_values`.
STUDENT_PAD_ID = "student_pad_id"
TEACHER_PAD_ID = "teacher_pad_id"

# The alignment fields (AlignmentBatch field names, docs/design.md), prefixed "alignment_" here.
ALIGNMENT_PREFIX = "alignment_"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of a collated sample.

    Attributes:
        name: key in the sample dict and in the padded batch dict.
        dtype: torch dtype (the same in both forms).
        axis: ``"student_token"`` [T], ``"teacher_token"`` [U], ``"chunk"`` [C] or
            ``"sample"`` (0-d in a sample, [B] in a batch; never padded).
        pad: value written into padding: a number/bool, or ``"student_pad_id"`` /
            ``"teacher_pad_id"`` (resolved by :func:`pad_values`); None for per-sample fields.
    """

    name: str
    dtype: torch.dtype
    axis: str
    pad: int | float | bool | str | None


SAMPLE_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("input_ids", torch.int64, STUDENT_TOKEN, STUDENT_PAD_ID),
    FieldSpec("input_lengths", torch.int64, SAMPLE, None),
    FieldSpec("token_mask", torch.bool, STUDENT_TOKEN, False),
    FieldSpec("sample_mask", torch.float32, SAMPLE, None),
    FieldSpec("teacher_input_ids", torch.int64, TEACHER_TOKEN, TEACHER_PAD_ID),
    FieldSpec("teacher_input_lengths", torch.int64, SAMPLE, None),
    FieldSpec("teacher_token_mask", torch.bool, TEACHER_TOKEN, False),
    FieldSpec("alignment_pair_valid", torch.bool, CHUNK, False),
    FieldSpec("alignment_pair_is_correct", torch.bool, CHUNK, False),
    FieldSpec("alignment_student_exact_partition_mask", torch.bool, STUDENT_TOKEN, False),
    FieldSpec("alignment_teacher_exact_partition_mask", torch.bool, TEACHER_TOKEN, False),
    FieldSpec("alignment_student_chunk_id", torch.int64, STUDENT_TOKEN, -1),
    FieldSpec("alignment_teacher_chunk_id", torch.int64, TEACHER_TOKEN, -1),
    FieldSpec("alignment_num_chunks", torch.int64, SAMPLE, None),
)
# Fields of packed rows only (several documents per sample): positions restart at each document.
PACKED_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("position_ids", torch.int32, STUDENT_TOKEN, 0),
    FieldSpec("teacher_position_ids", torch.int32, TEACHER_TOKEN, 0),
)
FIELDS_BY_NAME: dict[str, FieldSpec] = {f.name: f for f in SAMPLE_FIELDS + PACKED_FIELDS}
# The fields every sample has (a trainer's claim requires them).
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SAMPLE_FIELDS)
PACKED_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in PACKED_FIELDS)

# Per-sample field that holds each jagged axis' length.
LENGTH_FIELD: dict[str, str] = {
    STUDENT_TOKEN: "input_lengths",
    TEACHER_TOKEN: "teacher_input_lengths",
    CHUNK: "alignment_num_chunks",
}


def fields_on_axis(axis: str) -> tuple[str, ...]:
    """Names of the fields on one axis (packed rows' position fields included).

    Args:
        axis: one of ``"student_token"``, ``"teacher_token"``, ``"chunk"``, ``"sample"``.

    Returns:
        The field names, in schema order.

    Raises:
        ValueError: on an unknown axis.
    """
    if axis not in (STUDENT_TOKEN, TEACHER_TOKEN, CHUNK, SAMPLE):
        raise ValueError(
            f"unknown axis {axis!r}; use one of {STUDENT_TOKEN}, {TEACHER_TOKEN}, {CHUNK}, {SAMPLE}"
        )
    return tuple(f.name for f in SAMPLE_FIELDS + PACKED_FIELDS if f.axis == axis)


def pad_values(*, student_pad_id: int, teacher_pad_id: int) -> dict[str, int | float | bool]:
    """Concrete pad value of every padded field for one run.

    Args:
        student_pad_id: id written into padding of ``input_ids``.
        teacher_pad_id: id written into padding of ``teacher_input_ids``.

    Returns:
        ``{field name: pad value}`` for every field that is not per-sample (packed rows'
        position fields included).
    """
    resolved = {STUDENT_PAD_ID: int(student_pad_id), TEACHER_PAD_ID: int(teacher_pad_id)}
    return {
        f.name: resolved.get(f.pad, f.pad) if isinstance(f.pad, str) else f.pad
        for f in SAMPLE_FIELDS + PACKED_FIELDS
        if f.axis != SAMPLE
    }


def is_packed(sample: Mapping[str, torch.Tensor]) -> bool:
    """Whether a sample (or a padded batch) is a packed row: it carries the position fields.

    Args:
        sample: a jagged sample or a padded batch.

    Returns:
        True when it has ``position_ids``.
    """
    return PACKED_FIELDS[0].name in sample


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``max(n, 1)`` (padded widths are never 0).

    Args:
        n: length to cover.
        multiple: divisor, >= 1.

    Returns:
        The padded width.
    """
    n = max(int(n), 1)
    return -(-n // multiple) * multiple


def validate_sample(sample: Mapping[str, torch.Tensor]) -> None:
    """Check that a jagged sample follows the schema.

    Args:
        sample: ``{field name: tensor}`` as made by ``CrossTokenizerCollator.collate_one``.
            Extra keys are allowed (e.g. a key or teacher handle added later); a packed row
            has both fields of :data:`PACKED_FIELDS`.

    Raises:
        ValueError: on a missing field, a wrong dtype or rank, or a length that disagrees with
            its length field; the message names the field.
    """
    missing = [name for name in FIELD_NAMES if name not in sample]
    specs = SAMPLE_FIELDS
    if any(name in sample for name in PACKED_FIELD_NAMES):
        missing += [name for name in PACKED_FIELD_NAMES if name not in sample]
        specs = SAMPLE_FIELDS + PACKED_FIELDS
    if missing:
        raise ValueError(f"sample lacks fields {missing}; build it with collate_one()")
    for spec in specs:
        value = sample[spec.name]
        if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"field {spec.name!r}: expected a {spec.dtype} tensor, got {got}")
        want_dim = 0 if spec.axis == SAMPLE else 1
        if value.dim() != want_dim:
            raise ValueError(
                f"field {spec.name!r}: expected {want_dim}-d, got shape {tuple(value.shape)}"
            )
    for spec in specs:
        if spec.axis == SAMPLE:
            continue
        length = int(sample[LENGTH_FIELD[spec.axis]])
        if sample[spec.name].shape[0] != length:
            raise ValueError(
                f"field {spec.name!r} has {sample[spec.name].shape[0]} entries but "
                f"{LENGTH_FIELD[spec.axis]} = {length}"
            )


def pad_samples(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    student_pad_id: int,
    teacher_pad_id: int,
    make_seq_div_by_student: int = 1,
    make_seq_div_by_teacher: int = 1,
) -> dict[str, torch.Tensor]:
    """Materialize a right-padded batch from jagged samples: each row is copied once, into its
    rectangle (:func:`xtoken_core.data_plane.codec.pad_rows`).

    Args:
        samples: B jagged samples (see :func:`validate_sample`), e.g. row views of claimed
            columns (:func:`xtoken_core.data_plane.codec.columns_to_samples`).
        student_pad_id: pad id of ``input_ids``.
        teacher_pad_id: pad id of ``teacher_input_ids``.
        make_seq_div_by_student: T is rounded up to a multiple of this.
        make_seq_div_by_teacher: U is rounded up to a multiple of this.

    Returns:
        ``{field: tensor}``: per-student-token fields [B, T], per-teacher-token [B, U],
        per-chunk [B, C], per-sample [B]; dtypes as in :data:`SAMPLE_FIELDS` (and
        :data:`PACKED_FIELDS` for packed rows).

    Raises:
        ValueError: on an empty ``samples``, a divisor < 1, a sample that breaks the schema, or
            packed rows mixed with unpacked samples.
    """
    if not samples:
        raise ValueError("pad_samples needs at least one sample, got an empty sequence")
    for sample in samples:
        validate_sample(sample)
    packed = [is_packed(s) for s in samples]
    if any(packed) and not all(packed):
        raise ValueError(
            f"{sum(packed)} of {len(samples)} samples are packed rows (position_ids) and the "
            "others are not; a batch comes from one setting (the run's pack)"
        )
    divisors = {
        STUDENT_TOKEN: int(make_seq_div_by_student),
        TEACHER_TOKEN: int(make_seq_div_by_teacher),
        CHUNK: 1,
    }
    for arg, div in (
        ("make_seq_div_by_student", make_seq_div_by_student),
        ("make_seq_div_by_teacher", make_seq_div_by_teacher),
    ):
        if int(div) < 1:
            raise ValueError(f"{arg} must be >= 1, got {div!r}")
    pads = pad_values(student_pad_id=student_pad_id, teacher_pad_id=teacher_pad_id)
    widths = {
        axis: round_up(max(int(s[length]) for s in samples), divisors[axis])
        for axis, length in LENGTH_FIELD.items()
    }
    batch: dict[str, torch.Tensor] = {}
    for spec in SAMPLE_FIELDS + (PACKED_FIELDS if packed[0] else ()):
        rows = [s[spec.name] for s in samples]
        if spec.axis == SAMPLE:
            batch[spec.name] = torch.stack(rows)
        else:
            batch[spec.name] = pad_rows(rows, pads[spec.name], widths[spec.axis])
    return batch
