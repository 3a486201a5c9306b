"""Document packing: whole documents side by side in rows of the context length, on both sides.

A row of a packed batch holds several documents (``CrossTokenizerCollator(pack=True)``), the
student and the teacher tokens of the same documents in the same order. Nothing of one document
may reach another:

* **attention**: each document's positions start at 0 (``position_ids`` /
  ``teacher_position_ids``), and the forwards mask attention across documents
  (:mod:`xtoken_core.models.documents`);
* **chunks**: each document is aligned on its own; its chunk ids are offset by the chunks of the
  documents before it in the row, so a chunk never spans two documents;
* **next-token targets**: the logits at a document's last token would predict the next
  document's first token. :func:`document_targets` gives the loss a view of the batch where a
  document's first token is no target (``token_mask`` False, chunk id -1, on each side): the
  loss shifts chunk ids and CE targets by one position (``shifted[p] = chunk_id[p + 1]``), so
  every document contributes exactly what it contributes alone, with the same denominators.

Rows are filled by :func:`pack_rows` (best fit, longest documents first) from the documents of
one collator put: a document is never split; one longer than the context is cut at the context,
as without packing, and fills a row alone.

Legend: D documents, R rows, T student tokens, U teacher tokens, C chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from xtoken_core.data import sample as schema

# The separator of document keys in a packed row's key (``<key 1>|<key 2>|...``).
ROW_KEY_SEPARATOR = "|"
# A teacher's fields of an unpacked sample, under teacher 0's names (a row adds its positions).
_TEACHER = tuple(f for f in schema.TEACHER_FIELDS if f not in schema.PACKED_FIELDS)


def pack_rows(
    student_lengths: Sequence[int],
    teacher_lengths: Sequence[int],
    ctx_student: int,
    ctx_teacher: int,
) -> list[list[int]]:
    """Assign documents to rows: best fit decreasing over both sides' lengths.

    The documents are taken longest first (by the larger of their two shares of a row) and each
    goes into the open row with the least student room left that holds it on both sides, or into
    a new row. Each row lists its documents in their input order; rows are ordered by their first
    document. Documents of no tokens on either side go into the first row (they add nothing).

    Args:
        student_lengths: D student token counts, each <= ``ctx_student``.
        teacher_lengths: D teacher token counts, each <= ``ctx_teacher``.
        ctx_student: student tokens per row, >= 1.
        ctx_teacher: teacher tokens per row, >= 1.

    Returns:
        R lists of document indices (every index once; ``[]`` for D = 0).

    Raises:
        ValueError: the lengths differ in count, or a document is longer than a row.
    """
    return pack_rows_per_teacher(student_lengths, [teacher_lengths], ctx_student, [ctx_teacher])


def pack_rows_per_teacher(
    student_lengths: Sequence[int],
    teacher_lengths: Sequence[Sequence[int]],
    ctx_student: int,
    ctx_teacher: Sequence[int],
) -> list[list[int]]:
    """:func:`pack_rows` for N teachers: a row holds a document when it fits the student's row
    and every teacher's (longest first by the largest of its shares over every side).

    Args:
        student_lengths: D student token counts, each <= ``ctx_student``.
        teacher_lengths: N lists of D token counts, teacher i's each <= ``ctx_teacher[i]``.
        ctx_student: student tokens per row, >= 1.
        ctx_teacher: N teacher contexts, each >= 1.

    Returns:
        R lists of document indices (every index once; ``[]`` for D = 0).

    Raises:
        ValueError: no teacher, a count of lengths or contexts that disagrees, or a document
            longer than a row on some side.
    """
    if not teacher_lengths or len(teacher_lengths) != len(ctx_teacher):
        raise ValueError(
            f"{len(teacher_lengths)} teachers' lengths but {len(ctx_teacher)} teacher contexts; "
            "give one list of lengths and one context per teacher (at least one)"
        )
    names = ["teacher"] + [f"teacher{i}" for i in range(1, len(teacher_lengths))]
    for name, lengths in zip(names, teacher_lengths):
        if len(student_lengths) != len(lengths):
            raise ValueError(
                f"{len(student_lengths)} student lengths but {len(lengths)} {name} lengths"
            )
    sides = [list(student_lengths)] + [list(lengths) for lengths in teacher_lengths]
    contexts = [ctx_student, *ctx_teacher]
    docs = list(zip(*sides)) if sides[0] else []
    for i, doc in enumerate(docs):
        if not all(0 <= n <= ctx for n, ctx in zip(doc, contexts)):
            counts = " / ".join(f"{n} {name}" for n, name in zip(doc, ["student", *names]))
            over = " / ".join(str(ctx) for ctx in contexts)
            raise ValueError(
                f"document {i} has {counts} tokens, over a row of {over}: truncate it to the "
                "context first"
            )
    empty = [i for i, doc in enumerate(docs) if not any(doc)]
    order = sorted(
        (i for i, doc in enumerate(docs) if any(doc)),
        key=lambda i: (-max(n / ctx for n, ctx in zip(docs[i], contexts)), i),
    )
    rows: list[list[int]] = []
    room: list[list[int]] = []  # per row: tokens left on each side (student first)
    for i in order:
        doc = docs[i]
        best = None
        for r, left in enumerate(room):
            fits = all(n <= k for n, k in zip(doc, left))
            if fits and (best is None or left[0] < room[best][0]):
                best = r
        if best is None:
            rows.append([i])
            room.append([ctx - n for ctx, n in zip(contexts, doc)])
        else:
            rows[best].append(i)
            room[best] = [k - n for k, n in zip(room[best], doc)]
    rows = sorted((sorted(row) for row in rows), key=lambda row: row[0])
    if empty:
        rows[:1] = [sorted(rows[0] + empty)] if rows else [empty]
    return rows


def join_documents(documents: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed row (a jagged sample with :data:`~xtoken_core.data.sample.PACKED_FIELDS`) from
    the jagged samples of whole documents, in order.

    A document whose ``sample_mask`` is 0 (an empty text) adds no token. Chunk ids are offset by
    the chunks of the documents before (-1 stays -1), each teacher's by its own chunks;
    positions restart at 0 per document, on the student's side and on every teacher's. Teachers
    whose fields are the same tensors in every document (one tokenizer, tokenized once) share
    the row's tensors too.

    Args:
        documents: unpacked jagged samples (``CrossTokenizerCollator.collate_samples`` of one
            text each), in row order, all of the same teachers.

    Returns:
        The row's fields: the schema's of its teachers plus ``position_ids`` [T],
        ``teacher_position_ids`` [U] and each further teacher's ``teacher{i}_position_ids``
        [U_i] (int32). ``sample_mask`` is 1.0 when the row holds a token, else 0.0.

    Raises:
        ValueError: a document breaks the schema, is already a packed row, or has other
            teachers than the first.
    """
    n = schema.num_teachers_of(documents[0]) if documents else 1
    kept = []
    for doc in documents:
        schema.validate_sample(doc, n)
        if schema.is_packed(doc):
            raise ValueError("join_documents takes unpacked samples; this one is a packed row")
        if float(doc["sample_mask"]) != 0.0:
            kept.append(doc)
    out: dict[str, torch.Tensor] = {}
    for spec in schema.SAMPLE_FIELDS:
        if spec.axis != schema.SAMPLE and spec not in schema.TEACHER_FIELDS:
            out[spec.name] = _cat([doc[spec.name] for doc in kept], spec.dtype)
    out["position_ids"] = _positions([int(doc["input_lengths"]) for doc in kept])
    joined: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    for i in range(n):
        views = [
            {f.name: doc[schema.teacher_field_name(f.name, i)] for f in _TEACHER} for doc in kept
        ]
        # the same tensors in every document (one tokenization): the same row, shared
        same = tuple(id(value) for view in views for value in view.values())
        if same not in joined:
            joined[same] = _join_teacher(views)
        for name, value in joined[same].items():
            out[schema.teacher_field_name(name, i)] = value
    out["input_lengths"] = torch.tensor(int(out["input_ids"].numel()), dtype=torch.int64)
    out["sample_mask"] = torch.tensor(1.0 if out["input_ids"].numel() else 0.0)
    return {name: out[name] for name in schema.field_names(n, packed=True)}


def _join_teacher(views: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One teacher's row from its fields of the kept documents (under teacher 0's names): the
    per-token and per-chunk fields concatenated, the chunk ids offset by the chunks before,
    positions restarting per document, the lengths of the row."""
    out: dict[str, torch.Tensor] = {}
    for spec in _TEACHER:
        if spec.axis != schema.SAMPLE:
            out[spec.name] = _cat([view[spec.name] for view in views], spec.dtype)
    offset = 0
    chunk_ids: dict[str, list[torch.Tensor]] = {"student": [], "teacher": []}
    for view in views:
        for side, into in chunk_ids.items():
            ids = view[f"alignment_{side}_chunk_id"]
            into.append(torch.where(ids >= 0, ids + offset, ids))
        offset += int(view["alignment_num_chunks"])
    for side, rows in chunk_ids.items():
        out[f"alignment_{side}_chunk_id"] = _cat(rows, torch.int64)
    out["teacher_position_ids"] = _positions([int(view["teacher_input_lengths"]) for view in views])
    out["teacher_input_lengths"] = torch.tensor(
        int(out["teacher_input_ids"].numel()), dtype=torch.int64
    )
    out["alignment_num_chunks"] = torch.tensor(offset, dtype=torch.int64)
    return out


def _cat(rows: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rows one after the other (an empty tensor of ``dtype`` for none)."""
    return torch.cat(list(rows)) if rows else torch.zeros(0, dtype=dtype)


def _positions(lengths: Sequence[int]) -> torch.Tensor:
    """int32 positions restarting at 0 at each document of the given lengths."""
    return _cat([torch.arange(n, dtype=torch.int32) for n in lengths], torch.int32)


def row_key(keys: Sequence[str]) -> str:
    """The queue key of a packed row: its documents' keys joined by ``|``.

    Args:
        keys: the keys of the row's documents, in row order.

    Returns:
        ``"<key 1>|<key 2>|..."``.
    """
    return ROW_KEY_SEPARATOR.join(keys)


def document_keys(key: str) -> list[str]:
    """The document keys of a packed row's key (a key of one document: itself).

    Args:
        key: a row key made by :func:`row_key`.

    Returns:
        The documents' keys.
    """
    return key.split(ROW_KEY_SEPARATOR)


def document_targets(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss's view of a padded batch: no next-token target crosses a document.

    In a packed batch a document's first token (position 0) is the target of the previous
    document's last logits; here it is no target: ``token_mask`` False (student CE) and chunk id
    -1 on each side (``alignment_student_chunk_id`` at student position 0,
    ``alignment_teacher_chunk_id`` at teacher position 0), for every teacher
    (``teacher{i}_alignment_*_chunk_id``, teacher i's starts read from
    ``teacher{i}_position_ids``). The loss shifts these by one position, so each document's
    logits meet only its own targets, as in a row of its own, where the first token is no
    target either. An unpacked batch is returned as it is.

    Args:
        batch: padded fields ``[B, T]`` / ``[B, U_i]`` (``pad_samples``), packed or not.

    Returns:
        A new dict with the chunk ids and ``token_mask`` replaced (packed), or ``batch`` itself
        (unpacked). The attention still reads the untouched position fields.
    """
    if not schema.is_packed(batch):
        return batch  # type: ignore[return-value]
    out = dict(batch)
    starts_BT = batch["position_ids"] == 0
    out["token_mask"] = batch["token_mask"] & ~starts_BT
    for i in range(schema.num_teachers_of(batch)):

        def name(field: str, i: int = i) -> str:
            return schema.teacher_field_name(field, i)

        positions = batch.get(name("teacher_position_ids"))
        for field, starts in (
            ("alignment_student_chunk_id", starts_BT),
            ("alignment_teacher_chunk_id", None if positions is None else positions == 0),
        ):
            if name(field) in batch and starts is not None:
                out[name(field)] = batch[name(field)].masked_fill(starts, -1)
    return out
