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
    if len(student_lengths) != len(teacher_lengths):
        raise ValueError(
            f"{len(student_lengths)} student lengths but {len(teacher_lengths)} teacher lengths"
        )
    for i, (s, u) in enumerate(zip(student_lengths, teacher_lengths)):
        if not (0 <= s <= ctx_student and 0 <= u <= ctx_teacher):
            raise ValueError(
                f"document {i} has {s} student / {u} teacher tokens, over a row of "
                f"{ctx_student} / {ctx_teacher}: truncate it to the context first"
            )
    empty = [i for i, (s, u) in enumerate(zip(student_lengths, teacher_lengths)) if s == u == 0]
    order = sorted(
        (i for i, (s, u) in enumerate(zip(student_lengths, teacher_lengths)) if s or u),
        key=lambda i: (-max(student_lengths[i] / ctx_student, teacher_lengths[i] / ctx_teacher), i),
    )
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # per row: (student, teacher) tokens left
    for i in order:
        s, u = student_lengths[i], teacher_lengths[i]
        best = None
        for r, (left_s, left_u) in enumerate(room):
            if s <= left_s and u <= left_u and (best is None or left_s < room[best][0]):
                best = r
        if best is None:
            rows.append([i])
            room.append((ctx_student - s, ctx_teacher - u))
        else:
            rows[best].append(i)
            room[best] = (room[best][0] - s, room[best][1] - u)
    rows = sorted((sorted(row) for row in rows), key=lambda row: row[0])
    if empty:
        rows[:1] = [sorted(rows[0] + empty)] if rows else [empty]
    return rows


def join_documents(documents: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed row (a jagged sample with :data:`~xtoken_core.data.sample.PACKED_FIELDS`) from
    the jagged samples of whole documents, in order.

    A document whose ``sample_mask`` is 0 (an empty text) adds no token. Chunk ids are offset by
    the chunks of the documents before (-1 stays -1); positions restart at 0 per document.

    Args:
        documents: unpacked jagged samples (``CrossTokenizerCollator.collate_samples`` of one
            text each), in row order.

    Returns:
        The row's fields: the schema's, plus ``position_ids`` [T] and ``teacher_position_ids``
        [U] (int32). ``sample_mask`` is 1.0 when the row holds a token, else 0.0.

    Raises:
        ValueError: a document breaks the schema or is already a packed row.
    """
    kept = []
    for doc in documents:
        schema.validate_sample(doc)
        if schema.is_packed(doc):
            raise ValueError("join_documents takes unpacked samples; this one is a packed row")
        if float(doc["sample_mask"]) != 0.0:
            kept.append(doc)
    out: dict[str, torch.Tensor] = {}
    for spec in schema.SAMPLE_FIELDS:
        if spec.axis == schema.SAMPLE:
            continue
        rows = [doc[spec.name] for doc in kept]
        out[spec.name] = torch.cat(rows) if rows else torch.zeros(0, dtype=spec.dtype)
    offset = 0
    student_ids, teacher_ids = [], []
    for doc in kept:
        for side, into in (("student", student_ids), ("teacher", teacher_ids)):
            ids = doc[f"alignment_{side}_chunk_id"]
            into.append(torch.where(ids >= 0, ids + offset, ids))
        offset += int(doc["alignment_num_chunks"])
    for side, rows in (("student", student_ids), ("teacher", teacher_ids)):
        name = f"alignment_{side}_chunk_id"
        out[name] = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    for name, length in (
        ("position_ids", "input_lengths"),
        ("teacher_position_ids", "teacher_input_lengths"),
    ):
        positions = [torch.arange(int(doc[length]), dtype=torch.int32) for doc in kept]
        out[name] = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int32)
    out["input_lengths"] = torch.tensor(int(out["input_ids"].numel()), dtype=torch.int64)
    out["teacher_input_lengths"] = torch.tensor(
        int(out["teacher_input_ids"].numel()), dtype=torch.int64
    )
    out["sample_mask"] = torch.tensor(1.0 if out["input_ids"].numel() else 0.0)
    out["alignment_num_chunks"] = torch.tensor(offset, dtype=torch.int64)
    return {name: out[name] for name in schema.FIELD_NAMES + schema.PACKED_FIELD_NAMES}


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
    ``alignment_teacher_chunk_id`` at teacher position 0). The loss shifts these by one position,
    so each document's logits meet only its own targets, as in a row of its own, where the first
    token is no target either. An unpacked batch is returned as it is.

    Args:
        batch: padded fields ``[B, T]`` / ``[B, U]`` (``pad_samples``), packed or not.

    Returns:
        A new dict with the three fields replaced (packed), or ``batch`` itself (unpacked). The
        attention still reads the untouched ``position_ids``.
    """
    if not schema.is_packed(batch):
        return batch  # type: ignore[return-value]
    out = dict(batch)
    starts_BT = batch["position_ids"] == 0
    starts_BU = batch["teacher_position_ids"] == 0
    out["token_mask"] = batch["token_mask"] & ~starts_BT
    for name, starts in (
        ("alignment_student_chunk_id", starts_BT),
        ("alignment_teacher_chunk_id", starts_BU),
    ):
        if name in batch:
            out[name] = batch[name].masked_fill(starts, -1)
    return out
