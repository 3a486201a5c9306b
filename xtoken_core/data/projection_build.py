"""Build a dense top-k projection matrix from a student and a teacher tokenizer.

For every student token s (its exact UTF-8 bytes ``b``), the row M[s] is chosen by the first rule
that applies:

1. **special**: a special student token maps one-hot to the teacher special token with the same
   role (bos -> bos, eos -> eos, pad -> pad, unk -> unk, lowest teacher id on several); any other
   special token (chat markers, unused ids), or one whose role the teacher lacks, has no mapping.
2. **exact**: ``b`` equals the bytes of a (non-special) teacher token t: one-hot row
   ``[t, -1, ...] / [1, 0, ...]``. When several teacher tokens share those bytes (e.g. a
   SentencePiece piece and its ``<0xHH>`` byte-fallback twin), the one the teacher tokenizer itself
   produces for ``b`` wins, otherwise the lowest id. O(1) per token through a bytes -> id dict.
3. **re-tokenized**: ``b`` is valid UTF-8 on its own: the teacher tokenizer encodes it as running
   text (``encode_batch_bytes_to_ids``: no specials, no SentencePiece dummy prefix, batched), and
   the result is kept only if it round-trips (the teacher pieces' bytes concatenate back to
   exactly ``b``). Mismatches (normalizers such as NFC, unknown-token pieces) fall to rule 4.
4. **byte fallback**: otherwise (partial UTF-8 characters of byte-level BPE, or a failed round
   trip) ``b`` is split greedily into the longest teacher tokens that match it byte for byte.
   Byte-level BPE teachers have all 256 single bytes and SentencePiece teachers with byte fallback
   have ``<0xHH>`` tokens, so this always succeeds for them; when some byte has no teacher token,
   the row has no mapping.
5. **none**: empty bytes (unused ids) or nothing above applied: the row is all ``-1`` / ``0``.

Weighting of a split into pieces ``t_0 .. t_{n-1}``: piece i gets ``decay ** i`` (default
``decay = 0.5``; the first piece is the one the teacher predicts at the same position, so it
carries the most weight); the row keeps its first ``top_k`` pieces (the heaviest) in order and is
renormalized to sum to 1. A teacher id occurring several times keeps one slot per occurrence
(the sparse matrix sums them), so that only identical tokens ever get a one-hot row: two spaces
split into [" ", " "] is ``[t, t] / [2/3, 1/3]``, not ``[t] / [1]``.
With ``decay = 0.5`` a two-piece row is ``[2/3, 1/3]``, which the relaxed exact map (>= 0.6)
counts as common, while three or more pieces are not.

Shape legend: S student vocab, W teacher vocab, K top-k slots, N pieces over all rows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "MAPPED_ROLES",
    "BuildStats",
    "TokenizerLike",
    "build_projection",
    "build_projection_with_stats",
    "projection_metadata",
    "projection_stats",
    "save_projection",
    "vocab_hash",
]

# Special-token roles that pair a student special with a teacher special; generic "special"
# tokens (chat markers, unused ids) have no counterpart by role.
MAPPED_ROLES = frozenset({"bos", "eos", "pad", "unk"})

# Longest teacher token (in bytes) that the greedy byte fallback tries; longer never matter for
# student tokens, which are themselves short.
_MAX_FALLBACK_PIECE_BYTES = 128


class TokenizerLike(Protocol):
    """What the builder needs from a tokenizer (``xtoken_core.tokenizers.XTokenizer`` has it)."""

    name: str
    vocab_size: int

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes of one token (b"" for special tokens)."""

    def encode_bytes_to_ids(self, text: str) -> list[int]:
        """Token ids for ``text`` as running text: no special tokens, no prefix space."""

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token."""

    def special_role(self, token_id: int) -> str | None:
        """Role of a special token ("bos", "eos", "pad", "unk") or None."""


@dataclass
class BuildStats:
    """Coverage figures of one build (rows are student tokens)."""

    student: str
    teacher: str
    student_vocab_size: int
    teacher_vocab_size: int
    top_k: int
    rows_built: int
    exact_rows: int
    special_rows: int
    retokenized_rows: int
    byte_fallback_rows: int
    unmapped_rows: int
    truncated_rows: int
    mean_pieces_per_mapped_row: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The figures as a plain dict (for JSON)."""
        return asdict(self)


def _all_token_bytes(tok: TokenizerLike) -> list[bytes]:
    """Bytes of every token id, b"" for special tokens."""
    return [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]


def vocab_hash(tok: TokenizerLike) -> str:
    """A short hash of a vocabulary: every id's bytes and whether it is special, in id order.

    Two tokenizers with the same hash give the same projection rows and columns.
    """
    digest = hashlib.sha256()
    for i in range(tok.vocab_size):
        special = tok.is_special(i)
        raw = b"" if special else tok.token_bytes(i)
        digest.update(b"S" if special else b"T")
        digest.update(len(raw).to_bytes(4, "little"))
        digest.update(raw)
    return digest.hexdigest()[:16]


def projection_metadata(student_tok: TokenizerLike, teacher_tok: TokenizerLike) -> dict[str, str]:
    """What a projection file records about the tokenizers it was built for (all strings, so
    that both on-disk formats hold it: a ``"meta"`` dict in a torch.save file, the header
    metadata of a safetensors file).

    Returns:
        ``student`` / ``teacher`` (names), ``student_vocab_size`` / ``teacher_vocab_size`` and
        ``student_vocab_hash`` / ``teacher_vocab_hash`` (:func:`vocab_hash`).
    """
    meta = {}
    for side, tok in (("student", student_tok), ("teacher", teacher_tok)):
        meta[side] = str(tok.name)
        meta[f"{side}_vocab_size"] = str(int(tok.vocab_size))
        meta[f"{side}_vocab_hash"] = vocab_hash(tok)
    return meta


def save_projection(
    result: dict[str, torch.Tensor], path: str | os.PathLike, meta: dict[str, str]
) -> None:
    """Write a dense projection with its tokenizer metadata.

    Args:
        result: ``{"indices", "likelihoods"}`` from :func:`build_projection`.
        path: ``*.safetensors`` (metadata in the header), anything else ``torch.save`` (a
            ``"meta"`` dict of strings beside the arrays; loads with ``weights_only=True``).
        meta: :func:`projection_metadata` of the tokenizers it was built for.
    """
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(result, path, metadata=dict(meta))
    else:
        torch.save({**result, "meta": dict(meta)}, path)


def _encode_many(tok: TokenizerLike, texts: Sequence[str]) -> list[list[int]]:
    """Encode many texts, batched when the tokenizer offers ``encode_batch_bytes_to_ids``."""
    if not texts:
        return []
    batch = getattr(tok, "encode_batch_bytes_to_ids", None)
    if batch is not None:
        return [list(ids) for ids in batch(list(texts))]
    return [list(tok.encode_bytes_to_ids(t)) for t in texts]


def _role_map(tok: TokenizerLike) -> dict[str, int]:
    """role -> lowest special token id with that role (only the roles in ``MAPPED_ROLES``)."""
    roles: dict[str, int] = {}
    for i in range(tok.vocab_size):
        if tok.is_special(i):
            role = tok.special_role(i)
            if role in MAPPED_ROLES and role not in roles:
                roles[role] = i
    return roles


def _teacher_bytes_index(teacher: TokenizerLike, teacher_bytes: list[bytes]) -> dict[bytes, int]:
    """bytes -> teacher id, resolving byte strings that several teacher ids spell.

    The id the teacher itself produces wins (the single piece it encodes the bytes to as running
    text); otherwise the lowest id.
    """
    index: dict[bytes, int] = {}
    dups: dict[bytes, list[int]] = {}
    for t, b in enumerate(teacher_bytes):
        if not b:
            continue
        if b in index:
            dups.setdefault(b, [index[b]]).append(t)
        else:
            index[b] = t
    decodable = []
    for b in dups:
        try:
            decodable.append((b, b.decode("utf-8")))
        except UnicodeDecodeError:
            pass
    alone = _encode_many(teacher, [text for _, text in decodable])
    for (b, _), ids in zip(decodable, alone):
        if len(ids) == 1 and ids[0] in dups[b]:
            index[b] = ids[0]
    if dups:
        logger.debug("[projection] %d teacher byte strings have several token ids", len(dups))
    return index


def _greedy_split(b: bytes, index: dict[bytes, int], max_len: int) -> list[int] | None:
    """Longest-match split of ``b`` into teacher tokens, or None when some byte has no token."""
    out: list[int] = []
    i, n = 0, len(b)
    while i < n:
        for j in range(min(n, i + max_len), i, -1):
            t = index.get(b[i:j])
            if t is not None:
                out.append(t)
                i = j
                break
        else:
            return None
    return out


def _round_trip(ids: Sequence[int], b: bytes, teacher_bytes: list[bytes]) -> list[int] | None:
    """The teacher ``ids`` when their bytes spell exactly ``b``, else None."""
    if not ids or not all(0 <= t < len(teacher_bytes) for t in ids):
        return None
    return list(ids) if b"".join(teacher_bytes[t] for t in ids) == b else None


def _rows_from_pieces(
    rows_N: np.ndarray,
    pos_N: np.ndarray,
    teacher_N: np.ndarray,
    *,
    num_rows: int,
    top_k: int,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Weight pieces by position, keep the first ``top_k`` of each row, renormalize (vectorized).

    Piece weights decay with the position, so the first K pieces are the K heaviest.

    Returns:
        ``(indices_SK int64, likelihoods_SK float32, truncated_rows)``.
    """
    indices_SK = np.full((num_rows, top_k), -1, dtype=np.int64)
    likelihoods_SK = np.zeros((num_rows, top_k), dtype=np.float32)
    if rows_N.size == 0:
        return torch.from_numpy(indices_SK), torch.from_numpy(likelihoods_SK), 0
    truncated = int(np.unique(rows_N[pos_N >= top_k]).size)
    keep_N = pos_N < top_k
    rows_N, pos_N, teacher_N = rows_N[keep_N], pos_N[keep_N], teacher_N[keep_N]
    weight_N = np.power(decay, pos_N.astype(np.float64))
    row_sum_S = np.bincount(rows_N, weights=weight_N, minlength=num_rows)
    indices_SK[rows_N, pos_N] = teacher_N
    likelihoods_SK[rows_N, pos_N] = (weight_N / row_sum_S[rows_N]).astype(np.float32)
    return torch.from_numpy(indices_SK), torch.from_numpy(likelihoods_SK), truncated


def build_projection_with_stats(
    student_tok: TokenizerLike,
    teacher_tok: TokenizerLike,
    top_k: int,
    *,
    student_ids: Iterable[int] | None = None,
    decay: float = 0.5,
) -> tuple[dict[str, torch.Tensor], BuildStats]:
    """Build the dense top-k projection (see the module doc for the rules) and its coverage stats.

    Args:
        student_tok: student tokenizer (rows).
        teacher_tok: teacher tokenizer (columns).
        top_k: slots per row, K >= 1.
        student_ids: build only these rows (others stay unmapped); default all of the vocab.
        decay: weight ratio between consecutive pieces, in (0, 1].

    Returns:
        ``({"indices": LongTensor[V_s, K], "likelihoods": FloatTensor[V_s, K]}, stats)`` where
        V_s = ``student_tok.vocab_size``; -1 / 0.0 pad unused slots, mapped rows sum to 1.

    Raises:
        ValueError: ``top_k`` < 1, ``decay`` outside (0, 1], or a student id outside the vocab.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay!r}")
    start = time.perf_counter()
    num_s, num_t = int(student_tok.vocab_size), int(teacher_tok.vocab_size)
    if student_ids is None:
        rows = list(range(num_s))
    else:
        rows = sorted({int(s) for s in student_ids})
        bad = [s for s in rows if not 0 <= s < num_s]
        if bad:
            raise ValueError(
                f"student_ids {bad[:5]} are outside the student vocab [0, {num_s}); pass ids of "
                f"{student_tok.name!r}"
            )

    teacher_bytes = _all_token_bytes(teacher_tok)
    index = _teacher_bytes_index(teacher_tok, teacher_bytes)
    max_len = min(_MAX_FALLBACK_PIECE_BYTES, max((len(b) for b in index), default=1))
    teacher_roles = _role_map(teacher_tok)

    # (row, piece position, teacher id) triples; one-hot rows are single pieces at position 0.
    piece_rows: list[int] = []
    piece_pos: list[int] = []
    piece_ids: list[int] = []

    def add(row: int, ids: Sequence[int]) -> None:
        piece_rows.extend([row] * len(ids))
        piece_pos.extend(range(len(ids)))
        piece_ids.extend(ids)

    counts = dict.fromkeys(("exact", "special", "retok", "fallback", "none"), 0)
    to_encode: list[tuple[int, bytes, str]] = []
    to_split: list[tuple[int, bytes]] = []
    for s in rows:
        if student_tok.is_special(s):
            t = teacher_roles.get(student_tok.special_role(s))
            if t is None:
                counts["none"] += 1
            else:
                add(s, [t])
                counts["special"] += 1
            continue
        b = student_tok.token_bytes(s)
        if not b:
            counts["none"] += 1
            continue
        t = index.get(b)
        if t is not None:
            add(s, [t])
            counts["exact"] += 1
            continue
        try:
            to_encode.append((s, b, b.decode("utf-8")))
        except UnicodeDecodeError:
            to_split.append((s, b))

    encoded = _encode_many(teacher_tok, [text for _, _, text in to_encode])
    for (s, b, _), raw_ids in zip(to_encode, encoded):
        ids = _round_trip(raw_ids, b, teacher_bytes)
        if ids is None:
            to_split.append((s, b))
        else:
            add(s, ids)
            counts["retok"] += 1
    for s, b in to_split:
        ids = _greedy_split(b, index, max_len)
        if ids is None:
            counts["none"] += 1
        else:
            add(s, ids)
            counts["fallback"] += 1

    indices_SK, likelihoods_SK, truncated = _rows_from_pieces(
        np.asarray(piece_rows, dtype=np.int64),
        np.asarray(piece_pos, dtype=np.int64),
        np.asarray(piece_ids, dtype=np.int64),
        num_rows=num_s,
        top_k=top_k,
        decay=decay,
    )
    mapped = len(rows) - counts["none"]
    stats = BuildStats(
        student=str(getattr(student_tok, "name", "student")),
        teacher=str(getattr(teacher_tok, "name", "teacher")),
        student_vocab_size=num_s,
        teacher_vocab_size=num_t,
        top_k=top_k,
        rows_built=len(rows),
        exact_rows=counts["exact"],
        special_rows=counts["special"],
        retokenized_rows=counts["retok"],
        byte_fallback_rows=counts["fallback"],
        unmapped_rows=counts["none"],
        truncated_rows=truncated,
        mean_pieces_per_mapped_row=len(piece_ids) / mapped if mapped else 0.0,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "[projection] built %s -> %s: %d rows, exact %d, special %d, re-tokenized %d, "
        "byte fallback %d, unmapped %d, %.2f pieces/row, %.1f s",
        stats.student, stats.teacher, stats.rows_built, stats.exact_rows, stats.special_rows,
        stats.retokenized_rows, stats.byte_fallback_rows, stats.unmapped_rows,
        stats.mean_pieces_per_mapped_row, stats.seconds,
    )  # fmt: skip
    return {"indices": indices_SK, "likelihoods": likelihoods_SK}, stats


def build_projection(
    student_tok: TokenizerLike,
    teacher_tok: TokenizerLike,
    top_k: int,
    *,
    student_ids: Iterable[int] | None = None,
    decay: float = 0.5,
) -> dict[str, torch.Tensor]:
    """Build the dense top-k projection matrix of a tokenizer pair.

    Args:
        student_tok: student tokenizer (rows).
        teacher_tok: teacher tokenizer (columns).
        top_k: slots per row, K >= 1.
        student_ids: build only these rows (others stay unmapped); default all of the vocab.
        decay: weight ratio between consecutive pieces, in (0, 1].

    Returns:
        ``{"indices": LongTensor[V_s, K], "likelihoods": FloatTensor[V_s, K]}``, ready for
        ``torch.save`` and loadable with ``weights_only=True``.

    Raises:
        ValueError: see :func:`build_projection_with_stats`.
    """
    result, _ = build_projection_with_stats(
        student_tok, teacher_tok, top_k, student_ids=student_ids, decay=decay
    )
    return result


def projection_stats(indices: torch.Tensor, likelihoods: torch.Tensor) -> dict[str, Any]:
    """Summary figures of a dense top-k projection, read back from its arrays.

    Args:
        indices: LongTensor[V_s, K] teacher ids, -1 = no entry.
        likelihoods: FloatTensor[V_s, K] weights.

    Returns:
        Dict with ``student_rows``, ``top_k``, ``max_teacher_id``, ``one_hot_rows`` (a single
        entry of weight 1), ``empty_rows``, ``mean_entries_per_nonempty_row``,
        ``rows_full`` (all K slots used) and ``max_row_sum_error`` (of non-empty rows).

    Raises:
        ValueError: the shapes differ or are not 2-D.
    """
    if indices.dim() != 2 or indices.shape != likelihoods.shape:
        raise ValueError(
            f"indices {tuple(indices.shape)} and likelihoods {tuple(likelihoods.shape)} must both "
            f"be [student_vocab, top_k]"
        )
    valid_SK = indices >= 0
    entries_S = valid_SK.sum(dim=1)
    nonempty_S = entries_S > 0
    one_hot_S = (entries_S == 1) & ((likelihoods * valid_SK).sum(dim=1) == 1.0)
    row_sum_S = (likelihoods * valid_SK).sum(dim=1)
    err = (row_sum_S[nonempty_S] - 1.0).abs().max().item() if bool(nonempty_S.any()) else 0.0
    return {
        "student_rows": int(indices.shape[0]),
        "top_k": int(indices.shape[1]),
        "max_teacher_id": int(indices.max()),
        "one_hot_rows": int(one_hot_S.sum()),
        "empty_rows": int((~nonempty_S).sum()),
        "mean_entries_per_nonempty_row": (
            float(entries_S[nonempty_S].float().mean()) if bool(nonempty_S.any()) else 0.0
        ),
        "rows_full": int((entries_S == indices.shape[1]).sum()),
        "max_row_sum_error": float(err),
    }
