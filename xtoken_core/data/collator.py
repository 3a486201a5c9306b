"""CrossTokenizerCollator: tokenize a text with the student's and each teacher's tokenizer,
truncate, align the student with each teacher, pack.

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
* Several teachers (``teacher_tokenizers=[...]``): teacher 0's fields keep the one-teacher names,
  teacher i's are named ``teacher{i}_*`` (:func:`xtoken_core.data.sample.teacher_field_name`),
  each with its own context, divisor and pad id. A text is tokenized once per distinct teacher
  tokenizer (the same object) and aligned once per distinct teacher tokenization: teachers that
  share a tokenizer, a context and a ``kd_where_agrees`` share the tensors of their fields.
  ``kd_where_agrees`` narrows every teacher's chunks (one tokenizer) or each its own (one entry
  per teacher, None: not narrowed); the student's agreement with it is computed once per text.

Shape legend: B texts, T student tokens, U teacher tokens, C chunks (alignment pairs), N teachers.
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
    """Tokenize with the student and every teacher, align the student with each teacher, return
    tensors (padded batch or one jagged sample).

    Args:
        student_tokenizer: XTokenizer of the student model.
        teacher_tokenizer: XTokenizer of the teacher model (one teacher); or give
            ``teacher_tokenizers``.
        aligner: a ``TokenAligner`` (used through ``align_tokenized(student, teacher)``, once
            per text and distinct teacher tokenization; the batch is padded with
            ``AlignmentBatch.from_samples``).
        ctx_length_student: student token cap per text, >= 1.
        ctx_length_teacher: teacher token cap per text, >= 1; one for every teacher or one per
            teacher.
        make_seq_div_by_student: pad T to a multiple of this (e.g. TP * CP * 2), >= 1.
        make_seq_div_by_teacher: pad U to a multiple of this, >= 1; one for every teacher or
            one per teacher.
        add_special_tokens: let each tokenizer add its usual specials (BOS...).
        pack: put several whole documents into each sample (a row of ``ctx_length_*`` tokens
            per side) instead of one text per sample; see :mod:`xtoken_core.data.packing`.
        kd_where_agrees: a third tokenizer: a chunk stays ``pair_valid`` (a KD term) only where
            each of its student tokens is also one token of this tokenizer, covering the same
            bytes (:func:`restrict_to_agreement`). One tokenizer narrows every teacher's chunks;
            a list or tuple gives one entry per teacher (None: that teacher not narrowed).
            None: every chunk as aligned.
        teacher_tokenizers: the XTokenizers of N >= 1 teachers (teacher 0 first), instead of
            ``teacher_tokenizer``.

    Raises:
        ValueError: on a context length or divisor < 1 (or not an int), a list of them that is
            not one per teacher, no teacher or both ``teacher_tokenizer`` and
            ``teacher_tokenizers``, or a tokenizer that is None.
    """

    def __init__(
        self,
        *,
        student_tokenizer: Any,
        teacher_tokenizer: Any | None = None,
        aligner: Any,
        ctx_length_student: int,
        ctx_length_teacher: int | Sequence[int],
        make_seq_div_by_student: int = 1,
        make_seq_div_by_teacher: int | Sequence[int] = 1,
        add_special_tokens: bool = True,
        pack: bool = False,
        kd_where_agrees: Any | Sequence[Any | None] | None = None,
        teacher_tokenizers: Sequence[Any] | None = None,
    ) -> None:
        teachers = _teacher_list(teacher_tokenizer, teacher_tokenizers)
        if student_tokenizer is None:
            raise ValueError("student_tokenizer is None; give the student's XTokenizer")
        n = len(teachers)
        ctx_teacher = _per_teacher("ctx_length_teacher", ctx_length_teacher, n)
        div_teacher = _per_teacher("make_seq_div_by_teacher", make_seq_div_by_teacher, n)
        for name, value in (
            ("ctx_length_student", ctx_length_student),
            *ctx_teacher,
            ("make_seq_div_by_student", make_seq_div_by_student),
            *div_teacher,
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(kd_where_agrees, list | tuple):
            if len(kd_where_agrees) != n:
                raise ValueError(
                    f"kd_where_agrees has {len(kd_where_agrees)} entries for {n} teachers; give "
                    "one tokenizer (or None) per teacher, or a single tokenizer for all"
                )
            agrees = tuple(kd_where_agrees)
        else:
            agrees = (kd_where_agrees,) * n
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizers: tuple[Any, ...] = teachers
        self.num_teachers = n
        self.aligner = aligner
        self.ctx_length_student = int(ctx_length_student)
        self.ctx_lengths_teacher: tuple[int, ...] = tuple(int(v) for _, v in ctx_teacher)
        self.make_seq_div_by_student = int(make_seq_div_by_student)
        self.make_seq_divs_teacher: tuple[int, ...] = tuple(int(v) for _, v in div_teacher)
        self.add_special_tokens = bool(add_special_tokens)
        self.pack = bool(pack)
        self.kd_where_agrees = kd_where_agrees
        self.agree_tokenizers: tuple[Any, ...] = agrees
        self.student_pad_id = resolve_pad_id(student_tokenizer)
        self.teacher_pad_ids: tuple[int, ...] = tuple(resolve_pad_id(t) for t in teachers)
        # teacher 0's settings under the one-teacher names
        self.teacher_tokenizer = teachers[0]
        self.ctx_length_teacher = self.ctx_lengths_teacher[0]
        self.make_seq_div_by_teacher = self.make_seq_divs_teacher[0]
        self.teacher_pad_id = self.teacher_pad_ids[0]
        # each teacher's first teacher of the same tokenizer and context: one tokenization
        self._same_tokens = tuple(
            next(
                j
                for j in range(i + 1)
                if teachers[j] is teachers[i]
                and self.ctx_lengths_teacher[j] == self.ctx_lengths_teacher[i]
            )
            for i in range(n)
        )

    # ---- public ---------------------------------------------------------------------------
    def pad_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`xtoken_core.data.sample.pad_samples` matching this collator.

        Returns:
            ``{"student_pad_id", "teacher_pad_id", "make_seq_div_by_student",
            "make_seq_div_by_teacher"}``: ints for one teacher, the two teacher entries a tuple
            per teacher for several.
        """
        several = self.num_teachers > 1
        return {
            "student_pad_id": self.student_pad_id,
            "teacher_pad_id": self.teacher_pad_ids if several else self.teacher_pad_id,
            "make_seq_div_by_student": self.make_seq_div_by_student,
            "make_seq_div_by_teacher": (
                self.make_seq_divs_teacher if several else self.make_seq_div_by_teacher
            ),
        }

    def pad_values(self) -> dict[str, int | float | bool]:
        """Pad value of every padded output field, of every teacher (see ``sample.pad_values``).

        Returns:
            ``{field name: pad value}``.
        """
        return schema.pad_values(
            student_pad_id=self.student_pad_id, teacher_pad_id=self.teacher_pad_ids
        )

    def field_names(self) -> tuple[str, ...]:
        """The fields of this collator's samples (what a consumer claims).

        Returns:
            :func:`xtoken_core.data.sample.field_names` of its teachers (packed rows' position
            fields included with ``pack``).
        """
        return schema.field_names(self.num_teachers, packed=self.pack)

    def tokenize(self, texts: Sequence[str]) -> tuple[list[TokenizedText], ...]:
        """Tokenize every text with the student's and each teacher's tokenizer, truncated to the
        context lengths; each distinct tokenizer encodes the texts once.

        Args:
            texts: B strings.

        Returns:
            ``(student, teacher_0, ..., teacher_{N-1})``: lists of B ``TokenizedText`` (ids,
            byte spans, roles); ``(student, teacher)`` for one teacher. Teachers of the same
            tokenizer and context get the same list.
        """
        texts = list(texts)
        # encode_batch: the tokenizer may batch natively (one call per tokenizer per batch).
        student = [
            x.truncated(self.ctx_length_student)
            for x in self.student_tokenizer.encode_batch(texts, self.add_special_tokens)
        ]
        return (student, *self._teacher_tokens(texts))

    def __call__(self, batch: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Collate B texts into one right-padded batch.

        Args:
            batch: B items, each a str or a mapping with a string ``"text"`` key.

        Returns:
            ``input_ids`` [B, T] int64, ``input_lengths`` [B] int64, ``token_mask`` [B, T] bool,
            ``sample_mask`` [B] float32, ``teacher_input_ids`` [B, U] int64,
            ``teacher_input_lengths`` [B] int64, ``teacher_token_mask`` [B, U] bool, and
            ``alignment_<field>`` for every AlignmentBatch field ([B, C], [B, T], [B, U], [B]);
            teacher i >= 1's the same under ``teacher{i}_`` names, [B, U_i] and [B, C_i].
            With ``pack``: B is the number of packed rows (``pad_samples`` of
            ``collate_samples(batch)``), with ``position_ids`` [B, T] and
            ``teacher_position_ids`` [B, U] (``teacher{i}_position_ids`` [B, U_i]) too.

        Raises:
            ValueError: on an empty batch or an item without text; UnicodeEncodeError (a
                ValueError) for a text holding a lone surrogate.
        """
        if len(batch) == 0:
            raise ValueError("CrossTokenizerCollator needs at least one text, got an empty batch")
        if self.pack:
            return schema.pad_samples(self.collate_samples(batch), **self.pad_kwargs())
        texts = [_text_of(item, i) for i, item in enumerate(batch)]
        student, *teachers = self.tokenize(texts)
        lengths_s = [len(t) for t in student]
        width_s = schema.round_up(max(lengths_s), self.make_seq_div_by_student)
        out: dict[str, torch.Tensor] = {}
        out["input_ids"] = _pad_rows([t.ids for t in student], width_s, self.student_pad_id)
        out["input_lengths"] = torch.tensor(lengths_s, dtype=torch.int64)
        out["token_mask"] = _length_mask(out["input_lengths"], width_s)
        out["sample_mask"] = torch.tensor([1.0 if t else 0.0 for t in texts], dtype=torch.float32)
        agreements: dict[int, list[np.ndarray | None]] = {}
        aligned: dict[tuple[int, int], list[Any]] = {}
        padded: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        for i, teacher in enumerate(teachers):
            other, div = self.agree_tokenizers[i], self.make_seq_divs_teacher[i]
            key = (id(teacher), id(other))
            if key not in aligned:
                agree = agreements.get(id(other))
                if agree is None and other is not None:
                    agree = agreements[id(other)] = [
                        student_agreement(s, other, self.aligner) if len(s) else None
                        for s in student
                    ]
                aligned[key] = [
                    self._align(s, t, other, None if agree is None else agree[b])
                    for b, (s, t) in enumerate(zip(student, teacher))
                ]
            if (*key, div) not in padded:
                padded[(*key, div)] = self._padded_teacher(
                    teacher, aligned[key], width_s, div, self.teacher_pad_ids[i]
                )
            for name, value in padded[(*key, div)].items():
                out[schema.teacher_field_name(name, i)] = value
        return {name: out[name] for name in schema.field_names(self.num_teachers)}

    def collate_one(self, text: Any) -> dict[str, torch.Tensor]:
        """Collate one text into a jagged sample (no padding).

        Args:
            text: a str or a mapping with a string ``"text"`` key.

        Returns:
            The fields of :func:`xtoken_core.data.sample.sample_fields` of the collator's
            teachers: per-student-token fields [T], teacher i's per-teacher-token fields [U_i],
            its per-chunk fields [C_i] (its ``alignment_num_chunks``), per-sample 0-d tensors,
            T and U_i being this sample's own lengths.

        Raises:
            ValueError: if the item has no text.
        """
        return self.collate_samples([text])[0]

    def collate_samples(self, batch: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """Collate B texts into B jagged samples (what a collator worker puts on the queue).

        Same result as ``[collate_one(x) for x in batch]``, tokenizing with each tokenizer in one
        call. With ``pack``: the packed rows of :meth:`pack_samples`.

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
        ``ctx_length_student`` tokens and each teacher's ``ctx_length_teacher`` (best fit,
        longest first).

        Args:
            batch: B items, each a str or a mapping with a string ``"text"`` key.

        Returns:
            R ``(indices, row)`` pairs: the indices of the texts the row holds, in order (every
            text in exactly one row; an empty text adds no token), and the row's jagged sample
            with ``position_ids`` and every teacher's position field.

        Raises:
            ValueError: if an item has no text.
        """
        from xtoken_core.data.packing import join_documents, pack_rows_per_teacher

        documents = self._documents(batch)
        counted = [float(d["sample_mask"]) != 0.0 for d in documents]
        teacher_lengths = [
            [
                int(d[schema.teacher_field_name("teacher_input_lengths", i)]) if c else 0
                for d, c in zip(documents, counted)
            ]
            for i in range(self.num_teachers)
        ]
        rows = pack_rows_per_teacher(
            [int(d["input_lengths"]) if c else 0 for d, c in zip(documents, counted)],
            teacher_lengths,
            self.ctx_length_student,
            self.ctx_lengths_teacher,
        )
        return [(row, join_documents([documents[i] for i in row])) for row in rows]

    def _documents(self, batch: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """One unpacked jagged sample per text."""
        texts = [_text_of(item, i) for i, item in enumerate(batch)]
        return [self.pack_sample(*tokens) for tokens in zip(*self.tokenize(texts))]

    def tokenize_sampled(self, rows: Sequence[Sequence[int]]) -> tuple[list[TokenizedText], ...]:
        """Place token ids the student sampled on the text they spell, and tokenize that text
        with each teacher's tokenizer (all truncated to the context lengths).

        Args:
            rows: B sequences of student ids as sampled (prompt and continuation; specials
                such as a BOS included, padding and anything past an EOS excluded).

        Returns:
            ``(student, teacher_0, ..., teacher_{N-1})``: lists of B ``TokenizedText``
            (``(student, teacher)`` for one teacher). The student ids are the sampled ones, cut
            before the first token whose bytes are no valid UTF-8
            (:func:`xtoken_core.tokenizers.sampled.decode_sampled`); a teacher's ids are its
            tokenization of the decoded text, its specials added as for a text (each distinct
            tokenizer encodes once; teachers that share one get the same list).

        Raises:
            ValueError: an id outside the student vocabulary.
        """
        student = [
            decode_sampled(self.student_tokenizer, row).truncated(self.ctx_length_student)
            for row in rows
        ]
        return (student, *self._teacher_tokens([s.text for s in student]))

    def collate_sampled(self, rows: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        """Jagged samples of token sequences the student sampled (on-policy samples): the student
        ids as sampled, each teacher's ids of the decoded text, the same alignments and fields
        as :meth:`collate_samples` (``collate_sampled([ids])`` equals ``collate_samples([text])``
        when ``ids`` is the student tokenization of ``text``).

        Args:
            rows: B sequences of sampled student ids (see :meth:`tokenize_sampled`).

        Returns:
            B sample dicts (see :meth:`collate_one`).

        Raises:
            ValueError: an id outside the student vocabulary.
        """
        return [self.pack_sample(*tokens) for tokens in zip(*self.tokenize_sampled(rows))]

    def pack_sample(
        self, student: TokenizedText, *teachers: TokenizedText
    ) -> dict[str, torch.Tensor]:
        """One jagged sample of a text tokenized by the student and every teacher: align the
        student with each teacher (once per distinct teacher tokenization), pack the fields.

        Args:
            student: the student tokens of the text (``student.text`` is the text).
            *teachers: each teacher's tokens of the same text, teacher 0 first (one per
                teacher; the same object for teachers that share it, as :meth:`tokenize` gives).

        Returns:
            The sample dict (see :meth:`collate_one`); ``sample_mask`` is 0.0 for an empty text.
            Teachers given the same tokens (and ``kd_where_agrees``) share their tensors.

        Raises:
            ValueError: not one teacher tokenization per teacher.
        """
        if len(teachers) != self.num_teachers:
            raise ValueError(
                f"pack_sample got {len(teachers)} teacher tokenizations for "
                f"{self.num_teachers} teachers; pass one per teacher, in order (tokenize() "
                "gives them)"
            )
        s = student
        out: dict[str, torch.Tensor] = {
            "input_ids": torch.from_numpy(np.array(s.ids, dtype=np.int64)),
            "input_lengths": torch.tensor(len(s), dtype=torch.int64),
            "token_mask": torch.ones(len(s), dtype=torch.bool),
            "sample_mask": torch.tensor(1.0 if s.text else 0.0, dtype=torch.float32),
        }
        agreements: dict[int, np.ndarray] = {}
        done: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for i, t in enumerate(teachers):
            other = self.agree_tokenizers[i]
            fields = done.get((id(t), id(other)))
            if fields is None:
                if other is not None and id(other) not in agreements:
                    agreements[id(other)] = student_agreement(s, other, self.aligner)
                alignment = self._align(s, t, other, agreements.get(id(other)))
                fields = {
                    "teacher_input_ids": torch.from_numpy(np.array(t.ids, dtype=np.int64)),
                    "teacher_input_lengths": torch.tensor(len(t), dtype=torch.int64),
                    "teacher_token_mask": torch.ones(len(t), dtype=torch.bool),
                    **alignment.to_flat_dict(prefix=schema.ALIGNMENT_PREFIX),
                }
                done[(id(t), id(other))] = fields
            for name, value in fields.items():
                out[schema.teacher_field_name(name, i)] = value
        return {name: out[name] for name in schema.field_names(self.num_teachers)}

    # ---- internals --------------------------------------------------------------------------
    def _teacher_tokens(self, texts: list[str]) -> list[list[TokenizedText]]:
        """Each teacher's truncated tokens of ``texts``: one ``encode_batch`` per distinct
        tokenizer, one list per distinct tokenizer and context."""
        encoded: dict[int, list[TokenizedText]] = {}
        out: list[list[TokenizedText]] = []
        for i, tokenizer in enumerate(self.teacher_tokenizers):
            first = self._same_tokens[i]
            if first < i:
                out.append(out[first])
                continue
            if id(tokenizer) not in encoded:
                encoded[id(tokenizer)] = tokenizer.encode_batch(texts, self.add_special_tokens)
            out.append([x.truncated(self.ctx_lengths_teacher[i]) for x in encoded[id(tokenizer)]])
        return out

    def _padded_teacher(
        self, teacher: list[TokenizedText], alignments: list[Any], width_s: int, div: int, pad: int
    ) -> dict[str, torch.Tensor]:
        """One teacher's padded fields under teacher 0's names: its ids, lengths, mask and the
        alignment batch (student side padded to ``width_s``)."""
        lengths_u = [len(t) for t in teacher]
        width_u = schema.round_up(max(lengths_u), div)
        alignment = AlignmentBatch.from_samples(
            alignments,
            student_len=width_s,
            teacher_len=width_u,
            max_pairs=max([1] + [int(a.num_chunks) for a in alignments]),
        ).to_flat_dict(prefix=schema.ALIGNMENT_PREFIX)
        out = {"teacher_input_ids": _pad_rows([t.ids for t in teacher], width_u, pad)}
        out["teacher_input_lengths"] = torch.tensor(lengths_u, dtype=torch.int64)
        out["teacher_token_mask"] = _length_mask(out["teacher_input_lengths"], width_u)
        out.update(alignment)
        return out

    def _align(
        self,
        student: TokenizedText,
        teacher: TokenizedText,
        other: Any | None,
        agree_T: np.ndarray | None,
    ) -> Any:
        alignment = self.aligner.align_tokenized(student, teacher)
        if other is None or len(student) == 0:
            return alignment
        return restrict_to_agreement(alignment, student, other, self.aligner, agree_T=agree_T)


def _teacher_list(one: Any | None, many: Sequence[Any] | None) -> tuple[Any, ...]:
    """The teacher tokenizers as a tuple of N >= 1, from exactly one of the two arguments."""
    if many is not None and one is not None:
        raise ValueError(
            "give teacher_tokenizer (one teacher) or teacher_tokenizers (a list), not both"
        )
    if many is None:
        if one is None:
            raise ValueError(
                "teacher_tokenizer is None; give the teacher's XTokenizer "
                "(xtoken_core.tokenizers.load_tokenizer), or teacher_tokenizers for several"
            )
        return (one,)
    if isinstance(many, str) or not isinstance(many, Sequence):
        raise ValueError(
            f"teacher_tokenizers is a {type(many).__name__}; give a list of XTokenizers"
        )
    if not many:
        raise ValueError("teacher_tokenizers is empty; give at least one teacher tokenizer")
    for i, tokenizer in enumerate(many):
        if tokenizer is None:
            raise ValueError(
                f"teacher_tokenizers[{i}] is None; give teacher {i}'s XTokenizer "
                "(xtoken_core.tokenizers.load_tokenizer)"
            )
    return tuple(many)


def _per_teacher(name: str, value: Any, n: int) -> list[tuple[str, Any]]:
    """``value`` as N ``(name, value)`` pairs: a single value for every teacher, or a list or
    tuple of one per teacher (named ``name[i]``)."""
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} entries for {n} teachers; give one per teacher or a "
                "single int"
            )
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return [(name, value)] * n


def student_agreement(student: TokenizedText, other_tokenizer: Any, aligner: Any) -> np.ndarray:
    """Which student tokens are one token of ``other_tokenizer`` over the same bytes (a 1:1
    chunk of the student and ``other_tokenizer`` tokenizations of the same text).

    Args:
        student: the student tokens (``student.text`` is the text).
        other_tokenizer: the third tokenizer.
        aligner: a ``TokenAligner``.

    Returns:
        bool ``[T]``.
    """
    other = other_tokenizer.encode_batch([student.text], False)[0]
    # the other tokens that start before the student's last byte ends (content spans are
    # non-decreasing): past it nothing is compared
    end = int(student.spans_N2[:, 1].max()) if len(student) else 0
    other = other.truncated(int(np.searchsorted(other.spans_N2[:, 0], end, side="left")))
    agree = aligner.align_tokenized(student, other).student_exact_partition_mask
    return np.asarray(agree, dtype=bool)


def restrict_to_agreement(
    alignment: Any,
    student: TokenizedText,
    other_tokenizer: Any,
    aligner: Any,
    *,
    agree_T: np.ndarray | None = None,
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
        agree_T: :func:`student_agreement` of ``student`` and ``other_tokenizer`` when already
            computed (one per text for every teacher); None: computed here.

    Returns:
        A ``SampleAlignment`` (the same one, ``pair_valid`` narrowed).
    """
    if agree_T is None:
        agree_T = student_agreement(student, other_tokenizer, aligner)
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
