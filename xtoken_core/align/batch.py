"""AlignmentBatch (padded torch tensors, the loss's view) and SampleAlignment (jagged, per text).

Legend: B batch, T student tokens, U teacher tokens, C chunks (max_pairs when padded).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

# Field order and dtypes are the contract with the loss (docs/design.md, "The byte alignment").
ALIGNMENT_FIELDS: tuple[str, ...] = (
    "pair_valid",
    "pair_is_correct",
    "student_exact_partition_mask",
    "teacher_exact_partition_mask",
    "student_chunk_id",
    "teacher_chunk_id",
    "num_chunks",
)
FIELD_DTYPES: dict[str, torch.dtype] = {
    "pair_valid": torch.bool,
    "pair_is_correct": torch.bool,
    "student_exact_partition_mask": torch.bool,
    "teacher_exact_partition_mask": torch.bool,
    "student_chunk_id": torch.int64,
    "teacher_chunk_id": torch.int64,
    "num_chunks": torch.int64,
}


@dataclass
class SampleAlignment:
    """The alignment of one text, unpadded (numpy), as put on the queue.

    Chunks are ordered by byte position. Chunk slots include one-sided chunks (tail past the
    shorter truncated side, unmatched special tokens, bytes one side does not cover): they are
    never ``pair_valid`` and their tokens get chunk id -1.

    Attributes:
        pair_valid: bool [C] the chunk has tokens on both sides covering identical bytes.
        pair_is_correct: bool [C] both sides cover exactly the same bytes (same as pair_valid
            for two-sided chunks; False for one-sided ones).
        student_exact_partition_mask: bool [T] token is a 1:1 content chunk (identical bytes).
        teacher_exact_partition_mask: bool [U] same, teacher side.
        student_chunk_id: int64 [T] chunk of each token, -1 = none (masked out, one-sided).
        teacher_chunk_id: int64 [U] same, teacher side.
        num_chunks: C.
    """

    pair_valid: np.ndarray
    pair_is_correct: np.ndarray
    student_exact_partition_mask: np.ndarray
    teacher_exact_partition_mask: np.ndarray
    student_chunk_id: np.ndarray
    teacher_chunk_id: np.ndarray
    num_chunks: int

    def to_flat_dict(self, prefix: str = "alignment_") -> dict[str, torch.Tensor]:
        """Jagged per-sample tensors keyed ``<prefix><field>`` (num_chunks as a 0-d int64).

        Args:
            prefix: key prefix.

        Returns:
            dict of CPU tensors: pair_* [C], *_exact_partition_mask and *_chunk_id [T] / [U].
        """
        out = {}
        for name in ALIGNMENT_FIELDS:
            value = getattr(self, name)
            out[prefix + name] = torch.as_tensor(np.asarray(value)).to(FIELD_DTYPES[name])
        return out


@dataclass
class AlignmentBatch:
    """Right-padded alignment of a batch, all CPU torch tensors (docs/design.md, byte alignment).

    Attributes:
        pair_valid: bool [B, C] slot holds a two-sided chunk covering identical bytes.
        pair_is_correct: bool [B, C] both sides cover exactly the same text.
        student_exact_partition_mask: bool [B, T] token is a 1:1 chunk with identical text.
        teacher_exact_partition_mask: bool [B, U] same, teacher side.
        student_chunk_id: int64 [B, T] chunk index of the token, -1 = none (pad, one-sided).
        teacher_chunk_id: int64 [B, U] same, teacher side.
        num_chunks: int64 [B] chunk slots used by each sample (one-sided ones included).

    C = max_pairs >= 1.
    """

    pair_valid: torch.Tensor
    pair_is_correct: torch.Tensor
    student_exact_partition_mask: torch.Tensor
    teacher_exact_partition_mask: torch.Tensor
    student_chunk_id: torch.Tensor
    teacher_chunk_id: torch.Tensor
    num_chunks: torch.Tensor

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.num_chunks.shape[0])

    @property
    def max_pairs(self) -> int:
        """C, the padded chunk axis (>= 1)."""
        return int(self.pair_valid.shape[1])

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The 7 field names, in contract order."""
        return ALIGNMENT_FIELDS

    def to_flat_dict(self, prefix: str = "alignment_") -> dict[str, torch.Tensor]:
        """``{prefix + field: tensor}`` for every field (what the loss reads).

        Args:
            prefix: key prefix.

        Returns:
            dict of the 7 tensors.
        """
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_flat_dict(cls, data: Mapping, prefix: str = "alignment_") -> AlignmentBatch:
        """Rebuild from ``to_flat_dict`` keys (extra keys are ignored).

        Args:
            data: mapping holding ``prefix + field`` for every field.
            prefix: key prefix.

        Returns:
            AlignmentBatch.

        Raises:
            ValueError: if a field is missing.
        """
        missing = [prefix + n for n in ALIGNMENT_FIELDS if prefix + n not in data]
        if missing:
            raise ValueError(
                f"alignment keys {missing} missing from the batch (have {sorted(data)[:20]}); "
                f"the collator must put every AlignmentBatch field with prefix {prefix!r}"
            )
        return cls(**{n: torch.as_tensor(data[prefix + n]) for n in ALIGNMENT_FIELDS})

    def to(self, device: torch.device | str) -> AlignmentBatch:
        """A copy with every tensor on ``device``."""
        return AlignmentBatch(**{n: getattr(self, n).to(device) for n in ALIGNMENT_FIELDS})

    def validate(self) -> None:
        """Check shapes, dtypes and invariants.

        Raises:
            ValueError: naming the field that breaks the contract.
        """
        b = self.batch_size
        for name in ALIGNMENT_FIELDS:
            t = getattr(self, name)
            if t.dtype != FIELD_DTYPES[name]:
                raise ValueError(f"{name} has dtype {t.dtype}, expected {FIELD_DTYPES[name]}")
            want_dim = 1 if name == "num_chunks" else 2
            if t.dim() != want_dim or t.shape[0] != b:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [B={b}, ...]")
        if self.max_pairs < 1:
            raise ValueError(f"max_pairs={self.max_pairs} must be >= 1")
        if self.pair_is_correct.shape != self.pair_valid.shape:
            raise ValueError("pair_is_correct and pair_valid must have the same shape")
        for side in ("student", "teacher"):
            ids = getattr(self, f"{side}_chunk_id")
            if ids.numel() and (ids.min() < -1 or ids.max() >= self.max_pairs):
                raise ValueError(f"{side}_chunk_id out of [-1, max_pairs={self.max_pairs})")

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[SampleAlignment],
        student_len: int | None = None,
        teacher_len: int | None = None,
        max_pairs: int | None = None,
    ) -> AlignmentBatch:
        """Right-pad per-sample alignments into a batch.

        Args:
            samples: B SampleAlignment.
            student_len: padded T (default: longest student sample).
            teacher_len: padded U (default: longest teacher sample).
            max_pairs: padded C (default: max(1, most chunks)).

        Returns:
            AlignmentBatch with chunk id -1 and False masks at padding.

        Raises:
            ValueError: if a sample is longer than the requested padded length.
        """
        b = len(samples)
        t_max = max((len(s.student_chunk_id) for s in samples), default=0)
        u_max = max((len(s.teacher_chunk_id) for s in samples), default=0)
        c_max = max([1] + [int(s.num_chunks) for s in samples])
        t = t_max if student_len is None else student_len
        u = u_max if teacher_len is None else teacher_len
        c = c_max if max_pairs is None else max_pairs
        if t < t_max or u < u_max or c < c_max:
            raise ValueError(
                f"padded sizes (T={t}, U={u}, C={c}) are smaller than the longest sample "
                f"(T={t_max}, U={u_max}, C={c_max}); pass larger sizes or None"
            )
        pair_valid_BC = np.zeros((b, c), dtype=bool)
        pair_is_correct_BC = np.zeros((b, c), dtype=bool)
        s_exact_BT = np.zeros((b, t), dtype=bool)
        t_exact_BU = np.zeros((b, u), dtype=bool)
        s_chunk_BT = np.full((b, t), -1, dtype=np.int64)
        t_chunk_BU = np.full((b, u), -1, dtype=np.int64)
        num_chunks_B = np.zeros(b, dtype=np.int64)
        for i, s in enumerate(samples):
            n_c, n_t, n_u = int(s.num_chunks), len(s.student_chunk_id), len(s.teacher_chunk_id)
            pair_valid_BC[i, :n_c] = s.pair_valid
            pair_is_correct_BC[i, :n_c] = s.pair_is_correct
            s_exact_BT[i, :n_t] = s.student_exact_partition_mask
            t_exact_BU[i, :n_u] = s.teacher_exact_partition_mask
            s_chunk_BT[i, :n_t] = s.student_chunk_id
            t_chunk_BU[i, :n_u] = s.teacher_chunk_id
            num_chunks_B[i] = n_c
        return cls(
            pair_valid=torch.from_numpy(pair_valid_BC),
            pair_is_correct=torch.from_numpy(pair_is_correct_BC),
            student_exact_partition_mask=torch.from_numpy(s_exact_BT),
            teacher_exact_partition_mask=torch.from_numpy(t_exact_BU),
            student_chunk_id=torch.from_numpy(s_chunk_BT),
            teacher_chunk_id=torch.from_numpy(t_chunk_BU),
            num_chunks=torch.from_numpy(num_chunks_B),
        )


def alignment_stats(batch: AlignmentBatch) -> dict[str, float]:
    """Summary figures of a batch for demos and dashboards.

    Args:
        batch: an AlignmentBatch.

    Returns:
        dict: ``chunks`` (slots used), ``valid_chunks``, ``valid_fraction`` (valid / chunks),
        ``one_sided`` (chunks with tokens on at most one side), ``one_to_one_fraction`` (valid
        chunks that are 1:1 exact on the student side / valid chunks), ``student_tokens_per_chunk``
        and ``teacher_tokens_per_chunk`` (mean over valid chunks).
    """
    c = batch.max_pairs
    used_BC = torch.arange(c)[None, :] < batch.num_chunks[:, None]
    chunks = int(used_BC.sum())
    valid = int(batch.pair_valid.sum())
    s_ids, t_ids = batch.student_chunk_id, batch.teacher_chunk_id
    s_sizes_BC = _chunk_sizes(s_ids, c)
    t_sizes_BC = _chunk_sizes(t_ids, c)
    two_sided = int(((s_sizes_BC > 0) & (t_sizes_BC > 0) & used_BC).sum())
    exact = int(batch.student_exact_partition_mask.sum())
    vmask = batch.pair_valid
    return {
        "chunks": float(chunks),
        "valid_chunks": float(valid),
        "valid_fraction": valid / chunks if chunks else 0.0,
        "one_sided": float(chunks - two_sided),
        "one_to_one_fraction": exact / valid if valid else 0.0,
        "student_tokens_per_chunk": float(s_sizes_BC[vmask].float().mean()) if valid else 0.0,
        "teacher_tokens_per_chunk": float(t_sizes_BC[vmask].float().mean()) if valid else 0.0,
    }


def _chunk_sizes(chunk_id_BT: torch.Tensor, c: int) -> torch.Tensor:
    """Tokens per chunk: int64 [B, C] from chunk ids [B, T] (-1 ignored)."""
    b = chunk_id_BT.shape[0]
    sizes_BC = torch.zeros((b, c + 1), dtype=torch.int64)
    idx_BT = torch.where(chunk_id_BT >= 0, chunk_id_BT, torch.full_like(chunk_id_BT, c))
    sizes_BC.scatter_add_(1, idx_BT, torch.ones_like(idx_BT))
    return sizes_BC[:, :c]
