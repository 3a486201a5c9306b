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

Several teachers (``CrossTokenizerCollator(teacher_tokenizers=[...])``): teacher 0's fields keep
the names above; teacher ``i >= 1`` has its own copy of every field that depends on the teacher
(:data:`TEACHER_FIELDS`), named by :func:`teacher_field_name`: ``teacher_<x>`` becomes
``teacher{i}_<x>`` (``teacher1_input_ids``, ``teacher1_token_mask``, ``teacher1_position_ids``)
and ``alignment_<x>`` becomes ``teacher{i}_alignment_<x>``, the key the loss reads for teacher
``i``. Its teacher-token fields are on its own axis ``U_i`` (``teacher{i}_token``, length
``teacher{i}_input_lengths``, padded to a multiple of its divisor with its pad id), its chunk
fields on its own axis ``C_i`` (``teacher{i}_chunk``, length ``teacher{i}_alignment_num_chunks``);
its student-token fields (``teacher{i}_alignment_student_chunk_id``, ...) are on the shared
``T``. The student fields and ``sample_mask`` are shared by every teacher.
:func:`sample_fields` lists every field of a sample of N teachers.

Cached teachers (a run's ``data.teacher_cache``): a sample carries a cached teacher's top-K
targets, :data:`TOPK_FIELDS`, on that teacher's token axis (``teacher_topk_ids`` ``[U, K]``
int32, ``teacher_topk_logprobs`` ``[U, K]`` float32, ``teacher_topk_rest`` and
``teacher_topk_lse`` ``[U]`` float32; teacher i's as ``teacher{i}_topk_...``): the ``topk``
transport's payload, decoded by the trainer with ``xtoken_core.wire.topk.decode_topk``. The
``[U, K]`` fields have one trailing dim (:attr:`FieldSpec.inner`); the pads of a padded batch
(ids 0, log-probs, rest and log-partition 0) are masked by ``teacher_token_mask``. Beside them,
``teacher_topk_cached`` (bool, per sample, :data:`TOPK_CACHED`): False for a sample the cache
lacks (``data.teacher_cache_missing: online``), whose targets are zeros the trainer never reads:
it asks the live teacher for that sample instead.
"""

from __future__ import annotations

import dataclasses
import re
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
        inner: trailing dims of each entry (1 for the ``[U, K]`` top-K fields, else 0).
    """

    name: str
    dtype: torch.dtype
    axis: str
    pad: int | float | bool | str | None
    inner: int = 0


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
# A cached teacher's top-K targets (data.teacher_cache), per teacher token: K ids, their K
# log-probabilities, the log of the mass outside them and the log-partition.
TOPK_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("teacher_topk_ids", torch.int32, TEACHER_TOKEN, 0, inner=1),
    FieldSpec("teacher_topk_logprobs", torch.float32, TEACHER_TOKEN, 0.0, inner=1),
    FieldSpec("teacher_topk_rest", torch.float32, TEACHER_TOKEN, 0.0),
    FieldSpec("teacher_topk_lse", torch.float32, TEACHER_TOKEN, 0.0),
)
# Whether a sample's top-K targets came from the cache (False: the cache lacks the sample, its
# targets are zeros, and the trainer asks the live teacher for it).
TOPK_CACHED = FieldSpec("teacher_topk_cached", torch.bool, SAMPLE, None)
FIELDS_BY_NAME: dict[str, FieldSpec] = {
    f.name: f for f in SAMPLE_FIELDS + PACKED_FIELDS + TOPK_FIELDS + (TOPK_CACHED,)
}
# The fields every sample has (a trainer's claim requires them).
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SAMPLE_FIELDS)
PACKED_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in PACKED_FIELDS)

# Per-sample field that holds each jagged axis' length.
LENGTH_FIELD: dict[str, str] = {
    STUDENT_TOKEN: "input_lengths",
    TEACHER_TOKEN: "teacher_input_lengths",
    CHUNK: "alignment_num_chunks",
}

# Teacher 0's fields that every further teacher has a copy of (its tokens and its alignment with
# the student); the others (the student's tokens, ``sample_mask``) are shared by every teacher.
TEACHER_FIELDS: tuple[FieldSpec, ...] = tuple(
    f for f in SAMPLE_FIELDS + PACKED_FIELDS if f.name.startswith(("teacher_", ALIGNMENT_PREFIX))
)
_TEACHER_FIELD_NAMES = frozenset(f.name for f in TEACHER_FIELDS + TOPK_FIELDS + (TOPK_CACHED,))
# teacher{i}_<rest> with i >= 1 (teacher 0 has no number)
_NUMBERED = re.compile(r"teacher([1-9][0-9]*)_(.+)")


def teacher_field_name(name: str, teacher: int) -> str:
    """The name of teacher ``teacher``'s copy of one of teacher 0's fields.

    ``teacher_<x>`` becomes ``teacher{i}_<x>`` and ``alignment_<x>`` becomes
    ``teacher{i}_alignment_<x>`` (the loss's per-teacher key); teacher 0 keeps the name.

    Args:
        name: a field of :data:`TEACHER_FIELDS` (``"teacher_input_ids"``,
            ``"alignment_pair_valid"``, ...).
        teacher: the teacher's index, >= 0.

    Returns:
        The field name, e.g. ``"teacher1_input_ids"``, ``"teacher1_alignment_pair_valid"``.

    Raises:
        ValueError: ``name`` is no per-teacher field, or ``teacher`` < 0.
    """
    if name not in _TEACHER_FIELD_NAMES:
        raise ValueError(
            f"{name!r} is not a per-teacher field; use one of {sorted(_TEACHER_FIELD_NAMES)}"
        )
    if isinstance(teacher, bool) or not isinstance(teacher, int) or teacher < 0:
        raise ValueError(f"teacher index must be an int >= 0, got {teacher!r}")
    if teacher == 0:
        return name
    if name.startswith("teacher_"):
        return f"teacher{teacher}_{name.removeprefix('teacher_')}"
    return f"teacher{teacher}_{name}"


def teacher_axis(axis: str, teacher: int) -> str:
    """Teacher ``teacher``'s copy of an axis: ``teacher{i}_token`` for the teacher tokens,
    ``teacher{i}_chunk`` for its chunks; the student-token and sample axes are shared.

    Args:
        axis: one of ``"student_token"``, ``"teacher_token"``, ``"chunk"``, ``"sample"``.
        teacher: the teacher's index, >= 0 (0: the axis itself).

    Returns:
        The axis name.
    """
    if teacher == 0 or axis in (STUDENT_TOKEN, SAMPLE):
        return axis
    return f"teacher{teacher}_token" if axis == TEACHER_TOKEN else f"teacher{teacher}_chunk"


def teacher_pad_symbol(teacher: int) -> str:
    """The symbolic pad value of teacher ``teacher``'s ids (``"teacher_pad_id"``,
    ``"teacher1_pad_id"``, ...), resolved by :func:`pad_values`.

    Args:
        teacher: the teacher's index, >= 0.

    Returns:
        The symbol.
    """
    return TEACHER_PAD_ID if teacher == 0 else f"teacher{teacher}_pad_id"


def teacher_fields(teacher: int, *, packed: bool = False) -> tuple[FieldSpec, ...]:
    """The field specs of one teacher: its token ids, lengths, mask and alignment (and its
    positions in packed rows), on its own axes with its own pad id.

    Args:
        teacher: the teacher's index, >= 0 (0: the unprefixed fields).
        packed: include ``teacher{i}_position_ids``.

    Returns:
        The specs, in schema order.
    """
    return tuple(
        FieldSpec(
            teacher_field_name(f.name, teacher),
            f.dtype,
            teacher_axis(f.axis, teacher),
            teacher_pad_symbol(teacher) if f.pad == TEACHER_PAD_ID else f.pad,
        )
        for f in TEACHER_FIELDS
        if packed or f not in PACKED_FIELDS
    )


def topk_fields(teacher: int) -> tuple[FieldSpec, ...]:
    """The top-K target fields of cached teacher ``teacher`` (:data:`TOPK_FIELDS` and
    :data:`TOPK_CACHED`, named as :func:`teacher_field_name` names its fields, on its own token
    axis).

    Args:
        teacher: the teacher's index, >= 0 (0: ``teacher_topk_ids``, ...).

    Returns:
        The five specs: ids, log-probs, rest, log-partition, and whether the cache held them.
    """
    return tuple(
        dataclasses.replace(
            f, name=teacher_field_name(f.name, teacher), axis=teacher_axis(f.axis, teacher)
        )
        for f in (*TOPK_FIELDS, TOPK_CACHED)
    )


def cached_teachers_of(sample: Mapping[str, object]) -> tuple[int, ...]:
    """The teachers whose top-K targets a sample (or a padded batch) carries.

    Args:
        sample: a jagged sample or a padded batch.

    Returns:
        Their indices, increasing.
    """
    n = num_teachers_of(sample)
    return tuple(i for i in range(n) if teacher_field_name(TOPK_FIELDS[0].name, i) in sample)


def sample_fields(
    num_teachers: int = 1, *, packed: bool = False, cached: Sequence[int] = ()
) -> tuple[FieldSpec, ...]:
    """Every field of a sample of ``num_teachers`` teachers: the one-teacher schema
    (:data:`SAMPLE_FIELDS`, and :data:`PACKED_FIELDS` when packed), then teacher 1's fields,
    teacher 2's, ... (:func:`teacher_fields`), then the top-K targets of each cached teacher
    (:func:`topk_fields`).

    Args:
        num_teachers: N >= 1.
        packed: packed rows (the position fields of the student and of every teacher).
        cached: the teachers (indices < N) whose top-K targets the samples carry.

    Returns:
        The specs; for one teacher exactly ``SAMPLE_FIELDS`` (``+ PACKED_FIELDS``).

    Raises:
        ValueError: ``num_teachers`` < 1, or a cached teacher index outside ``[0, N)``.
    """
    n = _check_num_teachers(num_teachers)
    specs = SAMPLE_FIELDS + (PACKED_FIELDS if packed else ())
    for i in range(1, n):
        specs += teacher_fields(i, packed=packed)
    for i in sorted(set(cached)):
        if not 0 <= i < n:
            raise ValueError(f"cached teacher {i}: the samples have teachers 0..{n - 1}")
        specs += topk_fields(i)
    return specs


def field_names(
    num_teachers: int = 1, *, packed: bool = False, cached: Sequence[int] = ()
) -> tuple[str, ...]:
    """Names of :func:`sample_fields` (what a consumer of N teachers' samples claims).

    Args:
        num_teachers: N >= 1.
        packed: packed rows.
        cached: the teachers whose top-K targets the samples carry.

    Returns:
        The names, in schema order.
    """
    return tuple(f.name for f in sample_fields(num_teachers, packed=packed, cached=cached))


def num_teachers_of(sample: Mapping[str, object]) -> int:
    """How many teachers a sample (or a padded batch) carries fields of: 1 + the highest ``i``
    of a ``teacher{i}_<field>`` key naming a per-teacher field.

    Args:
        sample: a jagged sample or a padded batch.

    Returns:
        N >= 1.
    """
    highest = 0
    for key in sample:
        match = _NUMBERED.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            continue
        rest = match.group(2)
        if rest in _TEACHER_FIELD_NAMES or f"teacher_{rest}" in _TEACHER_FIELD_NAMES:
            highest = max(highest, int(match.group(1)))
    return highest + 1


def length_fields(num_teachers: int = 1) -> dict[str, str]:
    """The per-sample field holding each jagged axis' length, for N teachers.

    Args:
        num_teachers: N >= 1.

    Returns:
        ``{axis: length field}``: :data:`LENGTH_FIELD`, then ``teacher{i}_token`` ->
        ``teacher{i}_input_lengths`` and ``teacher{i}_chunk`` ->
        ``teacher{i}_alignment_num_chunks`` for each further teacher.
    """
    out = dict(LENGTH_FIELD)
    for i in range(1, _check_num_teachers(num_teachers)):
        for axis in (TEACHER_TOKEN, CHUNK):
            out[teacher_axis(axis, i)] = teacher_field_name(LENGTH_FIELD[axis], i)
    return out


def _check_num_teachers(num_teachers: int) -> int:
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 1:
        raise ValueError(f"num_teachers must be an int >= 1, got {num_teachers!r}")
    return num_teachers


def _per_teacher(name: str, value: object, n: int | None) -> tuple[int, ...] | None:
    """``value`` as one int per teacher (a sequence), or None for a single int."""
    if isinstance(value, list | tuple):
        if n is not None and len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} entries for {n} teachers; give one per teacher"
            )
        if not value:
            raise ValueError(f"{name} is empty; give one entry per teacher")
        return tuple(int(v) for v in value)
    return None


def fields_on_axis(axis: str, num_teachers: int = 1) -> tuple[str, ...]:
    """Names of the fields on one axis (packed rows' position fields included).

    Args:
        axis: ``"student_token"``, ``"teacher_token"``, ``"chunk"``, ``"sample"``, or a further
            teacher's ``"teacher{i}_token"`` / ``"teacher{i}_chunk"`` (:func:`teacher_axis`).
        num_teachers: N >= 1, the teachers whose fields count.

    Returns:
        The field names, in schema order.

    Raises:
        ValueError: on an axis no field of N teachers is on.
    """
    specs = sample_fields(num_teachers, packed=True)
    axes = list(dict.fromkeys(f.axis for f in specs))
    if axis not in axes:
        raise ValueError(f"unknown axis {axis!r}; use one of {', '.join(axes)}")
    return tuple(f.name for f in specs if f.axis == axis)


def pad_values(
    *, student_pad_id: int, teacher_pad_id: int | Sequence[int]
) -> dict[str, int | float | bool]:
    """Concrete pad value of every padded field for one run.

    Args:
        student_pad_id: id written into padding of ``input_ids``.
        teacher_pad_id: id written into padding of ``teacher_input_ids``, or one per teacher
            (teacher i's into ``teacher{i}_input_ids``).

    Returns:
        ``{field name: pad value}`` for every field that is not per-sample (packed rows'
        position fields included), of every teacher.

    Raises:
        ValueError: an empty sequence of teacher pad ids.
    """
    per_teacher = _per_teacher("teacher_pad_id", teacher_pad_id, None)
    teacher_ids = per_teacher if per_teacher is not None else (int(teacher_pad_id),)
    resolved: dict[str, int] = {STUDENT_PAD_ID: int(student_pad_id)}
    for i, pad_id in enumerate(teacher_ids):
        resolved[teacher_pad_symbol(i)] = pad_id
    return {
        f.name: resolved.get(f.pad, f.pad) if isinstance(f.pad, str) else f.pad
        for f in sample_fields(len(teacher_ids), packed=True, cached=range(len(teacher_ids)))
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


def _has_packed_field(sample: Mapping[str, torch.Tensor], n: int) -> bool:
    """Whether any position field of the student or of N teachers is in ``sample``."""
    names = [f.name for f in PACKED_FIELDS]
    names += [teacher_field_name(PACKED_FIELDS[1].name, i) for i in range(1, n)]
    return any(name in sample for name in names)


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


def validate_sample(sample: Mapping[str, torch.Tensor], num_teachers: int | None = None) -> None:
    """Check that a jagged sample follows the schema.

    Args:
        sample: ``{field name: tensor}`` as made by ``CrossTokenizerCollator.collate_one``.
            Extra keys are allowed (e.g. a key or teacher handle added later); a packed row
            has the position fields of the student and of every teacher.
        num_teachers: the teachers the sample must carry (every teacher's fields checked);
            None: as many as its keys name (:func:`num_teachers_of`).

    Raises:
        ValueError: on a missing field (of any teacher), fields of more teachers than
            ``num_teachers``, a wrong dtype or rank, or a length that disagrees with its length
            field; the message names the field.
    """
    found = num_teachers_of(sample)
    n = found if num_teachers is None else _check_num_teachers(num_teachers)
    if found > n:
        raise ValueError(
            f"sample carries fields of teacher {found - 1} but {n} teacher(s) were expected; "
            f"collate it with {n} teacher tokenizer(s) or expect {found}"
        )
    packed = _has_packed_field(sample, n)
    specs = sample_fields(n, packed=packed, cached=cached_teachers_of(sample))
    missing = [spec.name for spec in specs if spec.name not in sample]
    if missing:
        raise ValueError(
            f"sample lacks fields {missing}; build it with collate_one() of a collator of "
            f"{n} teacher(s)"
        )
    for spec in specs:
        value = sample[spec.name]
        if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"field {spec.name!r}: expected a {spec.dtype} tensor, got {got}")
        want_dim = (0 if spec.axis == SAMPLE else 1) + spec.inner
        if value.dim() != want_dim:
            raise ValueError(
                f"field {spec.name!r}: expected {want_dim}-d, got shape {tuple(value.shape)}"
            )
    lengths = length_fields(n)
    for spec in specs:
        if spec.axis == SAMPLE:
            continue
        length = int(sample[lengths[spec.axis]])
        if sample[spec.name].shape[0] != length:
            raise ValueError(
                f"field {spec.name!r} has {sample[spec.name].shape[0]} entries but "
                f"{lengths[spec.axis]} = {length}"
            )


def pad_samples(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    student_pad_id: int,
    teacher_pad_id: int | Sequence[int],
    make_seq_div_by_student: int = 1,
    make_seq_div_by_teacher: int | Sequence[int] = 1,
) -> dict[str, torch.Tensor]:
    """Materialize a right-padded batch from jagged samples: each row is copied once, into its
    rectangle (:func:`xtoken_core.data_plane.codec.pad_rows`).

    Args:
        samples: B jagged samples (see :func:`validate_sample`), e.g. row views of claimed
            columns (:func:`xtoken_core.data_plane.codec.columns_to_samples`), all of the same
            teachers.
        student_pad_id: pad id of ``input_ids``.
        teacher_pad_id: pad id of ``teacher_input_ids``; for samples of N > 1 teachers one per
            teacher (``CrossTokenizerCollator.pad_kwargs()`` gives them).
        make_seq_div_by_student: T is rounded up to a multiple of this.
        make_seq_div_by_teacher: U is rounded up to a multiple of this; one for every teacher,
            or one per teacher (teacher i's ``U_i``).

    Returns:
        ``{field: tensor}``: per-student-token fields [B, T], teacher i's per-teacher-token
        fields [B, U_i], its per-chunk fields [B, C_i], per-sample [B]; dtypes as in
        :func:`sample_fields`.

    Raises:
        ValueError: on an empty ``samples``, a divisor < 1, a sample that breaks the schema,
            samples of different teachers, pad ids or divisors that are not one per teacher, or
            packed rows mixed with unpacked samples.
    """
    if not samples:
        raise ValueError("pad_samples needs at least one sample, got an empty sequence")
    pad_ids = _per_teacher("teacher_pad_id", teacher_pad_id, None)
    n = num_teachers_of(samples[0]) if pad_ids is None else len(pad_ids)
    if pad_ids is None and n > 1:
        raise ValueError(
            f"the samples carry {n} teachers but teacher_pad_id is one int; pass one pad id per "
            "teacher (CrossTokenizerCollator.pad_kwargs())"
        )
    for sample in samples:
        validate_sample(sample, n)
    cached = cached_teachers_of(samples[0])
    if any(cached_teachers_of(s) != cached for s in samples[1:]):
        raise ValueError(
            "samples carry the cached top-K targets of different teachers; a batch comes from "
            "one run (its data.teacher_cache)"
        )
    packed = [is_packed(s) for s in samples]
    if any(packed) and not all(packed):
        raise ValueError(
            f"{sum(packed)} of {len(samples)} samples are packed rows (position_ids) and the "
            "others are not; a batch comes from one setting (the run's pack)"
        )
    teacher_divs = _per_teacher("make_seq_div_by_teacher", make_seq_div_by_teacher, n)
    if teacher_divs is None:
        teacher_divs = (int(make_seq_div_by_teacher),) * n
    for arg, div in (
        ("make_seq_div_by_student", make_seq_div_by_student),
        *(("make_seq_div_by_teacher", d) for d in teacher_divs),
    ):
        if int(div) < 1:
            raise ValueError(f"{arg} must be >= 1, got {div!r}")
    divisors = {STUDENT_TOKEN: int(make_seq_div_by_student)}
    for i in range(n):
        divisors[teacher_axis(TEACHER_TOKEN, i)] = teacher_divs[i]
        divisors[teacher_axis(CHUNK, i)] = 1
    pads = pad_values(
        student_pad_id=student_pad_id,
        teacher_pad_id=pad_ids if pad_ids is not None else teacher_pad_id,
    )
    widths = {
        axis: round_up(max(int(s[length]) for s in samples), divisors[axis])
        for axis, length in length_fields(n).items()
    }
    batch: dict[str, torch.Tensor] = {}
    for spec in sample_fields(n, packed=packed[0], cached=cached):
        rows = [s[spec.name] for s in samples]
        if spec.axis == SAMPLE:
            batch[spec.name] = torch.stack(rows)
        else:
            batch[spec.name] = pad_rows(rows, pads[spec.name], widths[spec.axis])
    return batch
