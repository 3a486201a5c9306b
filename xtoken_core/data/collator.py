"""CrossTokenizerCollator: tokenize a text twice (student, teacher), truncate, align once, pack.

Two outputs from the same steps:

* ``collator(batch)``: a right-padded batch, a flat ``{key: tensor}`` dict (keys, dtypes, pad
  values and widths: see :mod:`xtoken_core.data.sample`).
* ``pack=True``: the same texts as packed rows (:mod:`xtoken_core.data.packing`): whole documents
  side by side in rows of the context lengths, positions restarting per document, chunk ids
  offset per document; ``collate_samples`` returns one sample per row and ``pack_samples`` says
  which texts each row holds.
* ``collator.collate_one(text)`` / ``collate_samples(texts)``: jagged samples (no padding) for
  the transfer queue; ``collate_sampled(rows)`` the same of token ids the student sampled (the
  text they spell, cut at valid UTF-8, tokenized again by the teacher).
  ``sample.pad_samples([collate_one(t) for t in texts], **collator.pad_kwargs())`` equals
  ``collator(texts)`` exactly.

Decisions (documented here once):

* No chat template. ``add_special_tokens=True`` (default) keeps each tokenizer's own specials
  (e.g. BOS for Mistral, nothing for Qwen3); the aligner pairs specials by role.
* Truncation: each side keeps its first ``ctx_length_*`` tokens. A sample is never dropped; the
  two sides may be cut at different bytes (the aligner makes the longer tail one-sided).
* Empty text: kept in its slot with whatever tokens the tokenizers emit for "" (often none),
  ``sample_mask = 0.0`` (contributes nothing). Every non-empty text has ``sample_mask = 1.0``.
* ``token_mask`` is bool: True on real tokens, False on padding.
* Pad id per side: the tokenizer's ``pad_id``, else its ``eos_id``, else 0.
* Widths: ``T = round_up(max(1, longest), make_seq_div_by_*)``: the width may exceed the context
  length when the context length is not a multiple of the divisor (only padding is added).

Shape legend: B texts, T student tokens, U teacher tokens, C chunks (alignment pairs).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xtoken_core.align.batch import AlignmentBatch
from xtoken_core.data import sample as schema
from xtoken_core.tokenizers.base import TokenizedText
from xtoken_core.tokenizers.sampled import decode_sampled

logger = logging.getLogger(__name__)


def resolve_pad_id(tokenizer: Any) -> int:
    """Pad id used for a tokenizer: its ``pad_id``, else its ``eos_id``, else 0.

    Args:
        tokenizer: an XTokenizer (anything with optional ``pad_id`` / ``eos_id`` attributes).

    Returns:
        The id written into padding.
    """
    for attr in ("pad_id", "eos_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def _text_of(item: Any, index: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping) and isinstance(item.get("text"), str):
        return item["text"]
    got = type(item.get("text")).__name__ if isinstance(item, Mapping) else type(item).__name__
    raise ValueError(
        f"batch item {index}: expected a str or a mapping with a string 'text' key, got {got}"
    )


class CrossTokenizerCollator:
    """Tokenize twice, align once, return tensors (padded batch or one jagged sample).

    Args:
        student_tokenizer: XTokenizer of the student model.
        teacher_tokenizer: XTokenizer of the teacher model.
        aligner: a ``TokenAligner`` (used through ``align_tokenized(student, teacher)``, once
            per text; the batch is padded with ``AlignmentBatch.from_samples``).
        ctx_length_student: student token cap per text, >= 1.
        ctx_length_teacher: teacher token cap per text, >= 1.
        make_seq_div_by_student: pad T to a multiple of this (e.g. TP * CP * 2), >= 1.
        make_seq_div_by_teacher: pad U to a multiple of this, >= 1.
        add_special_tokens: let each tokenizer add its usual specials (BOS...).
        pack: put several whole documents into each sample (a row of ``ctx_length_*`` tokens
            per side) instead of one text per sample; see :mod:`xtoken_core.data.packing`.
        kd_where_agrees: a third tokenizer: a chunk stays ``pair_valid`` (a KD term) only where
            each of its student tokens is also one token of this tokenizer, covering the same
            bytes (:func:`restrict_to_agreement`). None: every chunk as aligned.

    Raises:
        ValueError: on a context length or divisor < 1 (or not an int).
    """

    def __init__(
        self,
        *,
        student_tokenizer: Any,
        teacher_tokenizer: Any,
        aligner: Any,
        ctx_length_student: int,
        ctx_length_teacher: int,
        make_seq_div_by_student: int = 1,
        make_seq_div_by_teacher: int = 1,
        add_special_tokens: bool = True,
        pack: bool = False,
        kd_where_agrees: Any | None = None,
    ) -> None:
        for name, value in (
            ("ctx_length_student", ctx_length_student),
            ("ctx_length_teacher", ctx_length_teacher),
            ("make_seq_div_by_student", make_seq_div_by_student),
            ("make_seq_div_by_teacher", make_seq_div_by_teacher),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.aligner = aligner
        self.ctx_length_student = int(ctx_length_student)
        self.ctx_length_teacher = int(ctx_length_teacher)
        self.make_seq_div_by_student = int(make_seq_div_by_student)
        self.make_seq_div_by_teacher = int(make_seq_div_by_teacher)
        self.add_special_tokens = bool(add_special_tokens)
        self.pack = bool(pack)
        self.kd_where_agrees = kd_where_agrees
        self.student_pad_id = resolve_pad_id(student_tokenizer)
        self.teacher_pad_id = resolve_pad_id(teacher_tokenizer)

    # ---- public ---------------------------------------------------------------------------
    def pad_kwargs(self) -> dict[str, int]:
        """Keyword arguments for :func:`xtoken_core.data.sample.pad_samples` matching this collator.

        Returns:
            ``{"student_pad_id", "teacher_pad_id", "make_seq_div_by_student",
            "make_seq_div_by_teacher"}``.
        """
        return {
            "student_pad_id": self.student_pad_id,
            "teacher_pad_id": self.teacher_pad_id,
            "make_seq_div_by_student": self.make_seq_div_by_student,
            "make_seq_div_by_teacher": self.make_seq_div_by_teacher,
        }

    def pad_values(self) -> dict[str, int | float | bool]:
        """Pad value of every padded output field (see ``sample.pad_values``).

        Returns:
            ``{field name: pad value}``.
        """
        return schema.pad_values(
            student_pad_id=self.student_pad_id, teacher_pad_id=self.teacher_pad_id
        )

    def tokenize(self, texts: Sequence[str]) -> tuple[list[Any], list[Any]]:
        """Tokenize every text with both tokenizers and truncate to the context lengths.

        Args:
            texts: B strings.

        Returns:
            (student, teacher): two lists of B ``TokenizedText`` (ids, byte spans, roles).
        """
        texts = list(texts)
        # encode_batch: the tokenizer may batch natively (one call per side per batch).
        student = [
            x.truncated(self.ctx_length_student)
            for x in self.student_tokenizer.encode_batch(texts, self.add_special_tokens)
        ]
        teacher = [
            x.truncated(self.ctx_length_teacher)
            for x in self.teacher_tokenizer.encode_batch(texts, self.add_special_tokens)
        ]
        return student, teacher

    def __call__(self, batch: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Collate B texts into one right-padded batch.

        Args:
            batch: B items, each a str or a mapping with a string ``"text"`` key.

        Returns:
            ``input_ids`` [B, T] int64, ``input_lengths`` [B] int64, ``token_mask`` [B, T] bool,
            ``sample_mask`` [B] float32, ``teacher_input_ids`` [B, U] int64,
            ``teacher_input_lengths`` [B] int64, ``teacher_token_mask`` [B, U] bool, and
            ``alignment_<field>`` for every AlignmentBatch field ([B, C], [B, T], [B, U], [B]).
            With ``pack``: B is the number of packed rows (``pad_samples`` of
            ``collate_samples(batch)``), with ``position_ids`` [B, T] and
            ``teacher_position_ids`` [B, U] too.

        Raises:
            ValueError: on an empty batch or an item without text; UnicodeEncodeError (a
                ValueError) for a text holding a lone surrogate.
        """
        if len(batch) == 0:
            raise ValueError("CrossTokenizerCollator needs at least one text, got an empty batch")
        if self.pack:
            return schema.pad_samples(self.collate_samples(batch), **self.pad_kwargs())
        texts = [_text_of(item, i) for i, item in enumerate(batch)]
        student, teacher = self.tokenize(texts)
        lengths_s = [len(t) for t in student]
        lengths_u = [len(t) for t in teacher]
        widths = {
            schema.STUDENT_TOKEN: schema.round_up(max(lengths_s), self.make_seq_div_by_student),
            schema.TEACHER_TOKEN: schema.round_up(max(lengths_u), self.make_seq_div_by_teacher),
        }
        alignments = [self._align(s, t) for s, t in zip(student, teacher)]
        widths[schema.CHUNK] = max([1] + [int(a.num_chunks) for a in alignments])
        alignment = AlignmentBatch.from_samples(
            alignments,
            student_len=widths[schema.STUDENT_TOKEN],
            teacher_len=widths[schema.TEACHER_TOKEN],
            max_pairs=widths[schema.CHUNK],
        ).to_flat_dict(prefix=schema.ALIGNMENT_PREFIX)
        pads = self.pad_values()

        out: dict[str, torch.Tensor] = {}
        out["input_ids"] = _pad_rows(
            [t.ids for t in student], widths[schema.STUDENT_TOKEN], pads["input_ids"]
        )
        out["input_lengths"] = torch.tensor(lengths_s, dtype=torch.int64)
        out["token_mask"] = _length_mask(out["input_lengths"], widths[schema.STUDENT_TOKEN])
        out["sample_mask"] = torch.tensor([1.0 if t else 0.0 for t in texts], dtype=torch.float32)
        out["teacher_input_ids"] = _pad_rows(
            [t.ids for t in teacher], widths[schema.TEACHER_TOKEN], pads["teacher_input_ids"]
        )
        out["teacher_input_lengths"] = torch.tensor(lengths_u, dtype=torch.int64)
        out["teacher_token_mask"] = _length_mask(
            out["teacher_input_lengths"], widths[schema.TEACHER_TOKEN]
        )
        out.update(alignment)
        return {name: out[name] for name in schema.FIELD_NAMES}

    def collate_one(self, text: Any) -> dict[str, torch.Tensor]:
        """Collate one text into a jagged sample (no padding).

        Args:
            text: a str or a mapping with a string ``"text"`` key.

        Returns:
            The fields of :data:`xtoken_core.data.sample.SAMPLE_FIELDS`: per-student-token
            fields [T], per-teacher-token [U], per-chunk [C] (C = ``alignment_num_chunks``),
            per-sample 0-d tensors, T and U being this sample's own lengths.

        Raises:
            ValueError: if the item has no text.
        """
        return self.collate_samples([text])[0]

    def collate_samples(self, batch: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """Collate B texts into B jagged samples (what a collator worker puts on the queue).

        Same result as ``[collate_one(x) for x in batch]``, tokenizing each side in one call.
        With ``pack``: the packed rows of :meth:`pack_samples`.

        Args:
            batch: B items, each a str or a mapping with a string ``"text"`` key.

        Returns:
            B sample dicts (see :meth:`collate_one`), or R packed rows.

        Raises:
            ValueError: if an item has no text.
        """
        if self.pack:
            return [row for _, row in self.pack_samples(batch)]
        return self._documents(batch)

    def pack_samples(self, batch: Sequence[Any]) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """Collate B texts into packed rows (:mod:`xtoken_core.data.packing`): each text is
        tokenized, truncated and aligned on its own, then whole documents fill rows of
        ``ctx_length_student`` / ``ctx_length_teacher`` tokens (best fit, longest first).

        Args:
            batch: B items, each a str or a mapping with a string ``"text"`` key.

        Returns:
            R ``(indices, row)`` pairs: the indices of the texts the row holds, in order (every
            text in exactly one row; an empty text adds no token), and the row's jagged sample
            with ``position_ids`` and ``teacher_position_ids``.

        Raises:
            ValueError: if an item has no text.
        """
        from xtoken_core.data.packing import join_documents, pack_rows

        documents = self._documents(batch)
        counted = [float(d["sample_mask"]) != 0.0 for d in documents]
        rows = pack_rows(
            [int(d["input_lengths"]) if c else 0 for d, c in zip(documents, counted)],
            [int(d["teacher_input_lengths"]) if c else 0 for d, c in zip(documents, counted)],
            self.ctx_length_student,
            self.ctx_length_teacher,
        )
        return [(row, join_documents([documents[i] for i in row])) for row in rows]

    def _documents(self, batch: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """One unpacked jagged sample per text."""
        texts = [_text_of(item, i) for i, item in enumerate(batch)]
        return [self.pack_sample(s, t) for s, t in zip(*self.tokenize(texts))]

    def tokenize_sampled(
        self, rows: Sequence[Sequence[int]]
    ) -> tuple[list[TokenizedText], list[TokenizedText]]:
        """Place token ids the student sampled on the text they spell, and tokenize that text
        with the teacher tokenizer (both truncated to the context lengths).

        Args:
            rows: B sequences of student ids as sampled (prompt and continuation; specials
                such as a BOS included, padding and anything past an EOS excluded).

        Returns:
            (student, teacher): two lists of B ``TokenizedText``. The student ids are the
            sampled ones, cut before the first token whose bytes are no valid UTF-8
            (:func:`xtoken_core.tokenizers.sampled.decode_sampled`); the teacher ids are the
            teacher tokenization of the decoded text, its specials added as for a text.

        Raises:
            ValueError: an id outside the student vocabulary.
        """
        student = [
            decode_sampled(self.student_tokenizer, row).truncated(self.ctx_length_student)
            for row in rows
        ]
        teacher = [
            x.truncated(self.ctx_length_teacher)
            for x in self.teacher_tokenizer.encode_batch(
                [s.text for s in student], self.add_special_tokens
            )
        ]
        return student, teacher

    def collate_sampled(self, rows: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        """Jagged samples of token sequences the student sampled (on-policy samples): the student
        ids as sampled, the teacher ids of the decoded text, the same alignment and fields as
        :meth:`collate_samples` (``collate_sampled([ids])`` equals ``collate_samples([text])``
        when ``ids`` is the student tokenization of ``text``).

        Args:
            rows: B sequences of sampled student ids (see :meth:`tokenize_sampled`).

        Returns:
            B sample dicts (see :meth:`collate_one`).

        Raises:
            ValueError: an id outside the student vocabulary.
        """
        return [self.pack_sample(s, t) for s, t in zip(*self.tokenize_sampled(rows))]

    def pack_sample(
        self, student: TokenizedText, teacher: TokenizedText
    ) -> dict[str, torch.Tensor]:
        """One jagged sample of a text tokenized on both sides: align once, pack the fields.

        Args:
            student: the student tokens of the text (``student.text`` is the text).
            teacher: the teacher tokens of the same text.

        Returns:
            The sample dict (see :meth:`collate_one`); ``sample_mask`` is 0.0 for an empty text.
        """
        alignment = self._align(student, teacher)
        s, t = student, teacher
        out: dict[str, torch.Tensor] = {
            "input_ids": torch.from_numpy(np.array(s.ids, dtype=np.int64)),
            "input_lengths": torch.tensor(len(s), dtype=torch.int64),
            "token_mask": torch.ones(len(s), dtype=torch.bool),
            "sample_mask": torch.tensor(1.0 if s.text else 0.0, dtype=torch.float32),
            "teacher_input_ids": torch.from_numpy(np.array(t.ids, dtype=np.int64)),
            "teacher_input_lengths": torch.tensor(len(t), dtype=torch.int64),
            "teacher_token_mask": torch.ones(len(t), dtype=torch.bool),
        }
        out.update(alignment.to_flat_dict(prefix=schema.ALIGNMENT_PREFIX))
        return {name: out[name] for name in schema.FIELD_NAMES}

    def _align(self, student: TokenizedText, teacher: TokenizedText) -> Any:
        alignment = self.aligner.align_tokenized(student, teacher)
        if self.kd_where_agrees is None or len(student) == 0:
            return alignment
        return restrict_to_agreement(alignment, student, self.kd_where_agrees, self.aligner)


def restrict_to_agreement(
    alignment: Any, student: TokenizedText, other_tokenizer: Any, aligner: Any
) -> Any:
    """``alignment`` with its chunks' ``pair_valid`` kept only where every student token of the
    chunk is a 1:1 chunk of the student and ``other_tokenizer`` tokenizations of the same text
    (the same bytes, one token each side): KD only where a third tokenizer agrees with the
    student's cut (e.g. KD from a same-tokenizer parent at the positions another teacher's
    tokenizer would also give one-to-one).

    Args:
        alignment: the student-teacher ``SampleAlignment`` of the text.
        student: the student tokens (``student.text`` is the text).
        other_tokenizer: the third tokenizer.
        aligner: a ``TokenAligner``.

    Returns:
        A ``SampleAlignment`` (the same one, ``pair_valid`` narrowed).
    """
    other = other_tokenizer.encode_batch([student.text], False)[0]
    # the other tokens that start before the student's last byte ends (content spans are
    # non-decreasing): past it nothing is compared
    end = int(student.spans_N2[:, 1].max()) if len(student) else 0
    other = other.truncated(int(np.searchsorted(other.spans_N2[:, 0], end, side="left")))
    agree_T = aligner.align_tokenized(student, other).student_exact_partition_mask
    chunk_T = np.asarray(alignment.student_chunk_id)
    disagree = chunk_T[(chunk_T >= 0) & ~np.asarray(agree_T, dtype=bool)]
    if disagree.size:
        valid = np.array(alignment.pair_valid, dtype=bool, copy=True)
        valid[np.unique(disagree)] = False
        alignment = dataclasses.replace(alignment, pair_valid=valid)
    return alignment


def _pad_rows(rows: list[np.ndarray], width: int, pad: int) -> torch.Tensor:
    """Right-pad B 1-D id arrays into an int64 [B, width] tensor."""
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
    return out


def _length_mask(lengths_B: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: True where position < length."""
    return torch.arange(width).unsqueeze(0) < lengths_B.unsqueeze(1)
