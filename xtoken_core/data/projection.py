"""The loaded projection matrix: :class:`Projection` (one per file version and device, with
every form the losses and kernels use), the exact-token map, the check against the run's
tokenizers. Reading and validating files: :mod:`xtoken_core.data.projection_file`.

A projection matrix M[V_s, V_t] says how likely each student token is expressed by each teacher
token. A file is read once per version and device (:func:`open_projection`: the key is
``(realpath(path), st_mtime_ns, st_size)`` and the device, "cuda" meaning the current one); the
:class:`Projection` keeps every form built from it (COO, top-k arrays, exact maps, kernel
tables). Those are shared: callers must not modify them in place. ``clear_projection_caches()``
forgets every opened file (tests).

Shape legend: S student vocab (rows of the file), W teacher vocab, K top-k slots per row,
N non-zeros of the COO form.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

import torch

from xtoken_core.data.projection_file import (
    parse_projection_file,
    read_layout,
    read_projection_metadata,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EXACT_MAP_RELAXED_MIN_WEIGHT",
    "Projection",
    "build_exact_token_map",
    "check_projection_tokenizers",
    "clear_projection_caches",
    "exact_token_map_from_topk",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "open_projection",
    "parse_projection_file",
    "read_projection_metadata",
]

# Relaxed (xtoken) exact map: a student row whose top weight reaches this is "common".
EXACT_MAP_RELAXED_MIN_WEIGHT = 0.6

# --------------------------------------------------------------------------------------------
# The loaded projection
# --------------------------------------------------------------------------------------------


def _file_key(path: str | os.PathLike) -> tuple[str, int, int]:
    """(realpath, mtime_ns, size): the identity of one version of a file."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise FileNotFoundError(f"projection file not found: {os.fspath(path)!r}") from None
    return (real, st.st_mtime_ns, st.st_size)


def _normalize_device(device: torch.device | str) -> torch.device:
    """torch.device with the current CUDA index filled in ("cuda" and "cuda:0" are one device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _check_teacher_vocab(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"teacher_vocab_size must be a positive int, got {value!r}")
    return value


class Projection:
    """One projection matrix M[V_s, W] on one device, read once, with every form the losses
    and kernels use built on first use and kept (shared: callers must not modify them).

    Forms: :attr:`topk` (the dense ``(indices, likelihoods)`` arrays; None for a file in the
    sparse layout), :meth:`sparse` (COO sized to the vocabularies), :meth:`exact_map` (common /
    uncommon vocab of the gold loss), :meth:`kernel_tables` (the CSC + ELL tables of the fused
    P-KL kernels). Build one with :meth:`from_file` (or :func:`open_projection`, which shares one
    per file version and device) or :meth:`from_topk`.

    Args:
        name: how messages name it (the file path, or "the in-memory projection").
        device: where every form lives.
        indices_2N: CPU int64 [2, N] COO coordinates (student, teacher), -1 teacher ids kept.
        values_N: CPU float32 [N] weights.
        num_rows: student rows (dense: rows of the file; sparse: max student id + 1).
        topk: the dense arrays on ``device``, or None.
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str,
        indices_2N: torch.Tensor,
        values_N: torch.Tensor,
        num_rows: int,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.device = _normalize_device(device)
        keep_N = indices_2N[1] >= 0
        self._indices_2N, self._values_N = indices_2N[:, keep_N], values_N[keep_N]
        self.num_rows = int(num_rows)
        #: the largest teacher id an entry names (-1: none)
        self.max_teacher_id = int(self._indices_2N[1].max()) if self._values_N.numel() else -1
        self.topk = topk
        self._forms: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike, device: torch.device | str) -> Projection:
        """Read a projection file (either layout) onto ``device``.

        Args:
            path: the file.
            device: where its forms live.

        Returns:
            The projection.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: an invalid file (see :func:`parse_projection_file`).
        """
        device = _normalize_device(device)
        layout, ids, weights = read_layout(path)
        if layout == "dense":
            topk = (ids.to(device), weights.to(device))
            return cls._from_dense(repr(os.fspath(path)), device, ids, weights, topk)
        rows = int(ids[0].max()) + 1
        return cls(repr(os.fspath(path)), device, ids, weights, rows)

    @classmethod
    def from_topk(
        cls, indices_SK: torch.Tensor, likelihoods_SK: torch.Tensor, device: torch.device | str
    ) -> Projection:
        """An in-memory dense projection (ids -1 = no entry) onto ``device``.

        Args:
            indices_SK: int [V_rows, K] teacher ids.
            likelihoods_SK: float [V_rows, K] weights.
            device: where its forms live.

        Returns:
            The projection.
        """
        device = _normalize_device(device)
        topk = (indices_SK.to(device), likelihoods_SK.to(device))
        indices_SK, likelihoods_SK = indices_SK.cpu().long(), likelihoods_SK.cpu().float()
        return cls._from_dense("the in-memory projection", device, indices_SK, likelihoods_SK, topk)

    @classmethod
    def _from_dense(cls, name, device, indices_SK, likelihoods_SK, topk) -> Projection:
        num_rows, k = indices_SK.shape
        student_SK = torch.arange(num_rows, dtype=torch.int64).unsqueeze(1).expand(num_rows, k)
        indices_2N = torch.stack([student_SK.reshape(-1), indices_SK.reshape(-1)])
        return cls(name, device, indices_2N, likelihoods_SK.reshape(-1), num_rows, topk)

    def _form(self, key: tuple, build) -> Any:
        with self._lock:
            hit = self._forms.get(key)
        if hit is None:
            hit = build()
            with self._lock:
                hit = self._forms.setdefault(key, hit)
        return hit

    def check_fits(self, student_vocab_size: int, teacher_vocab_size: int) -> None:
        """Refuse a projection wider than the vocabularies of the logits it meets.

        Args:
            student_vocab_size: V, the student logits' width.
            teacher_vocab_size: W, the teacher logits' width (after slicing to the vocab).

        Raises:
            ValueError: a student row >= V or a teacher id >= W (built for other tokenizers).
        """
        if self.num_rows > student_vocab_size:
            raise ValueError(
                f"projection {self.name} has {self.num_rows} student rows but the student vocab "
                f"is {student_vocab_size}; use the projection built for this student tokenizer"
            )
        if self.max_teacher_id >= teacher_vocab_size:
            raise ValueError(
                f"projection {self.name} references teacher id {self.max_teacher_id} but the "
                f"teacher logits have {teacher_vocab_size} columns (teacher vocab "
                f"{teacher_vocab_size}); use the projection built for this teacher tokenizer, or "
                "pass the teacher's full-vocab logits (teacher_vocab_size)"
            )

    def sparse(self, student_vocab_size: int, teacher_vocab_size: int) -> torch.Tensor:
        """M as a coalesced float32 sparse COO ``[V_s, V_t]``, -1 entries dropped, the axes
        ``max(configured, observed + 1)``.

        Args:
            student_vocab_size: minimum student axis.
            teacher_vocab_size: minimum teacher axis.

        Returns:
            The matrix on :attr:`device`.
        """

        def build() -> torch.Tensor:
            shape = (
                max(student_vocab_size, self.num_rows),
                max(teacher_vocab_size, self.max_teacher_id + 1),
            )
            # ids are validated (>= 0) and the shape covers them: no invariant check needed
            matrix = torch.sparse_coo_tensor(
                self._indices_2N, self._values_N, shape, dtype=torch.float32, check_invariants=False
            )
            matrix = matrix.coalesce().to(self.device)
            logger.info(
                "[projection] %s as sparse %s with %d non-zeros on %s",
                self.name,
                shape,
                matrix._nnz(),
                self.device,
            )
            return matrix

        return self._form(("sparse", student_vocab_size, teacher_vocab_size), build)

    def require_topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense arrays, or an error naming the fix for a sparse-layout file.

        Returns:
            :attr:`topk`.

        Raises:
            ValueError: the file is in the sparse ``{(s, t): weight}`` layout.
        """
        if self.topk is None:
            raise ValueError(
                f"projection file {self.name} is in the sparse {{(s, t): weight}} layout; the "
                f"top-k arrays (and the exact-token map of the gold loss) need the dense layout "
                f"{{'indices', 'likelihoods'}}: rebuild it with `xtoken projection build`"
            )
        return self.topk

    def exact_map(
        self,
        teacher_vocab_size: int,
        *,
        xtoken_loss: bool,
        student_vocab_size: int | None = None,
        index_dtype: torch.dtype = torch.int64,
    ) -> dict[str, torch.Tensor]:
        """The common / uncommon vocab partition of the gold loss (:func:`exact_token_map_from_topk`).

        Args:
            teacher_vocab_size: W; teacher ids outside it never map.
            xtoken_loss: the relaxed rule.
            student_vocab_size: V; student ids past the projection's rows are added to
                ``uncommon_student``. None: the rows only.
            index_dtype: int64, or int32 (the kernels' tables: half the bytes per column read).

        Returns:
            The map's tensors of ``index_dtype`` on :attr:`device`.

        Raises:
            ValueError: a sparse-layout file or a non-positive ``teacher_vocab_size``.
        """
        _check_teacher_vocab(teacher_vocab_size)
        key = ("exact", teacher_vocab_size, bool(xtoken_loss), student_vocab_size, index_dtype)

        def build() -> dict[str, torch.Tensor]:
            if index_dtype != torch.int64:
                exact = self.exact_map(
                    teacher_vocab_size,
                    xtoken_loss=xtoken_loss,
                    student_vocab_size=student_vocab_size,
                )
                return {name: ids.to(index_dtype) for name, ids in exact.items()}
            if student_vocab_size is not None and student_vocab_size > self.num_rows:
                exact = dict(self.exact_map(teacher_vocab_size, xtoken_loss=xtoken_loss))
                extra = torch.arange(self.num_rows, student_vocab_size, device=self.device)
                exact["uncommon_student"] = torch.cat([exact["uncommon_student"], extra])
                return exact
            indices_SK, likelihoods_SK = self.require_topk()
            exact = exact_token_map_from_topk(
                indices_SK,
                likelihoods_SK,
                xtoken_loss=bool(xtoken_loss),
                teacher_vocab_size=teacher_vocab_size,
            )
            logger.info(
                "[projection] exact map (%s) of %s: %d common of %d student / %d teacher tokens",
                "relaxed" if xtoken_loss else "strict",
                self.name,
                exact["common_student"].numel(),
                indices_SK.shape[0],
                teacher_vocab_size,
            )
            return exact

        return self._form(key, build)

    def gold_places(
        self, student_vocab_size: int, teacher_vocab_size: int, *, xtoken_loss: bool
    ) -> torch.Tensor:
        """Where each student id's chunk gradient lives in the fused gold kernels' compact
        tables (:func:`xtoken_core.kernels.gold_student.vocab_places` of the int32
        :meth:`exact_map`).

        Args:
            student_vocab_size: V.
            teacher_vocab_size: W.
            xtoken_loss: the relaxed rule.

        Returns:
            ``[V]`` int32 on :attr:`device`.
        """
        from xtoken_core.kernels.gold_student import vocab_places

        def build() -> torch.Tensor:
            exact = self.exact_map(
                teacher_vocab_size,
                xtoken_loss=xtoken_loss,
                student_vocab_size=student_vocab_size,
                index_dtype=torch.int32,
            )
            return vocab_places(
                exact["common_student"], exact["uncommon_student"], student_vocab_size
            )

        key = ("gold places", student_vocab_size, teacher_vocab_size, bool(xtoken_loss))
        return self._form(key, build)

    def kernel_tables(self, student_vocab_size: int, teacher_vocab_size: int) -> Any:
        """The CSC + ELL tables of the fused P-KL kernels
        (:func:`xtoken_core.kernels.pkl_projection.build_projection_tables` of :meth:`sparse`).

        Args:
            student_vocab_size: V.
            teacher_vocab_size: W.

        Returns:
            :class:`xtoken_core.kernels.pkl_projection.ProjectionTables` on :attr:`device`.
        """
        from xtoken_core.kernels.pkl_projection import build_projection_tables

        return self._form(
            ("tables", student_vocab_size, teacher_vocab_size),
            lambda: build_projection_tables(self.sparse(student_vocab_size, teacher_vocab_size)),
        )


_OPEN_LOCK = threading.Lock()
#: (file version, device) -> Projection; one version per file (a rewritten file replaces it)
_OPEN: dict[tuple, Projection] = {}


def open_projection(path: str | os.PathLike, device: torch.device | str) -> Projection:
    """The :class:`Projection` of a file on a device, read once per file version and device.

    Two spellings of one path share it (the key is the real path, mtime and size); a rewritten
    file is read again and the older version dropped. ``"cuda"`` and ``"cuda:<current>"`` share
    one.

    Args:
        path: projection file (either layout).
        device: where its forms live.

    Returns:
        The shared projection.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an invalid file.
    """
    device = _normalize_device(device)
    file_key = _file_key(path)
    key = (file_key, device)
    with _OPEN_LOCK:
        hit = _OPEN.get(key)
    if hit is not None:
        return hit
    projection = Projection.from_file(path, device)
    with _OPEN_LOCK:
        for old in [k for k in _OPEN if k[0][0] == file_key[0] and k[0] != file_key]:
            del _OPEN[old]
        return _OPEN.setdefault(key, projection)


def clear_projection_caches() -> None:
    """Forget every opened projection (:func:`open_projection`): the next open reads the file."""
    with _OPEN_LOCK:
        _OPEN.clear()


def get_sparse_projection_matrix(
    path: str | os.PathLike,
    device: torch.device | str,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> torch.Tensor:
    """The projection as a coalesced float32 sparse COO tensor on ``device`` (:meth:`Projection.sparse`
    of :func:`open_projection`).

    Entries with a -1 teacher id are dropped. Axes are sized
    ``V_s = max(student_vocab_size, max observed student id + 1)`` and likewise ``V_t``.

    Args:
        path: projection file (either layout).
        device: device of the returned tensor.
        student_vocab_size: minimum size of the student axis (keyword-only: avoids a swap).
        teacher_vocab_size: minimum size of the teacher axis.

    Returns:
        ``torch.sparse_coo_tensor`` of shape [V_s, V_t], coalesced, dtype float32. Shared: do not
        modify in place.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: invalid file (see :func:`parse_projection_file`) or a negative/non-int size.
    """
    _check_size("student_vocab_size", student_vocab_size)
    _check_size("teacher_vocab_size", teacher_vocab_size)
    return open_projection(path, device).sparse(student_vocab_size, teacher_vocab_size)


def get_topk_projection(
    path: str | os.PathLike, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense top-k ``(indices, likelihoods)`` arrays on ``device`` (of :func:`open_projection`).

    Args:
        path: projection file in the dense top-k layout.
        device: device of the returned tensors.

    Returns:
        ``(indices, likelihoods)``: LongTensor[V_s, K] (-1 = no entry) and float32 [V_s, K].
        Shared: do not modify in place.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is invalid or in the sparse ``{(s, t): weight}`` layout, which has no
            per-row top-k weights.
    """
    return open_projection(path, device).require_topk()


def exact_token_map_from_topk(
    indices_SK: torch.Tensor,
    likelihoods_SK: torch.Tensor,
    *,
    xtoken_loss: bool,
    teacher_vocab_size: int,
) -> dict[str, torch.Tensor]:
    """Partition both vocabularies into common (exactly mapped) and uncommon tokens.

    Rows are sorted by weight, descending (stable: on equal weights the earlier slot is the top).
    * strict (``xtoken_loss=False``): a row maps when its top weight == 1.0 and slot 1 of the
      unsorted row is -1 (with K == 1 only the weight test applies); on a teacher id claimed by
      several students, the lowest student id wins.
    * relaxed (``xtoken_loss=True``): a row maps when its top weight >= 0.6; on a collision the
      highest top weight wins, ties to the lowest student id.
    A top teacher id of -1 or >= ``teacher_vocab_size`` never maps. Vectorized (scatter_reduce).

    Args:
        indices_SK: LongTensor[V_s, K] teacher ids (-1 = no entry).
        likelihoods_SK: FloatTensor[V_s, K] weights.
        xtoken_loss: relaxed rule when True, strict otherwise.
        teacher_vocab_size: size of the teacher axis W (> 0).

    Returns:
        Dict of int64 tensors on the input's device: ``common_student`` [C] (ascending),
        ``common_teacher`` [C] (paired with common_student), ``uncommon_student`` [V_s - C] and
        ``uncommon_teacher`` [W - C] (ascending).

    Raises:
        ValueError: mismatched shapes or a non-positive ``teacher_vocab_size``.
    """
    if (
        isinstance(teacher_vocab_size, bool)
        or not isinstance(teacher_vocab_size, int)
        or teacher_vocab_size <= 0
    ):
        raise ValueError(f"teacher_vocab_size must be a positive int, got {teacher_vocab_size!r}")
    if indices_SK.dim() != 2 or indices_SK.shape != likelihoods_SK.shape:
        raise ValueError(
            f"indices {tuple(indices_SK.shape)} and likelihoods {tuple(likelihoods_SK.shape)} "
            f"must both be [student_vocab, top_k]"
        )
    device = indices_SK.device
    num_students, k = indices_SK.shape
    sorted_S, order_S = likelihoods_SK.sort(dim=1, descending=True, stable=True)
    top_weight_S = sorted_S[:, 0]
    top_teacher_S = indices_SK.gather(1, order_S[:, :1]).squeeze(1)
    if xtoken_loss:
        has_map_S = top_weight_S >= EXACT_MAP_RELAXED_MIN_WEIGHT
    else:
        has_map_S = top_weight_S == 1.0
        if k > 1:
            has_map_S &= indices_SK[:, 1] == -1
    has_map_S &= (top_teacher_S >= 0) & (top_teacher_S < teacher_vocab_size)

    student_S = torch.arange(num_students, device=device)
    cand_student_C = student_S[has_map_S]
    cand_teacher_C = top_teacher_S[has_map_S]
    if xtoken_loss:
        # Highest weight per teacher id first, then the lowest student among those that reach it.
        cand_weight_C = top_weight_S[has_map_S]
        best_W = torch.full((teacher_vocab_size,), -math.inf, device=device)
        best_W = best_W.scatter_reduce(0, cand_teacher_C, cand_weight_C, reduce="amax")
        at_best_C = cand_weight_C == best_W[cand_teacher_C]
        cand_student_C, cand_teacher_C = cand_student_C[at_best_C], cand_teacher_C[at_best_C]
    winner_W = torch.full((teacher_vocab_size,), num_students, dtype=torch.int64, device=device)
    winner_W = winner_W.scatter_reduce(0, cand_teacher_C, cand_student_C, reduce="amin")
    wins_C = winner_W[cand_teacher_C] == cand_student_C
    common_student = cand_student_C[wins_C]
    common_teacher = cand_teacher_C[wins_C]

    student_common_S = torch.zeros(num_students, dtype=torch.bool, device=device)
    student_common_S[common_student] = True
    teacher_common_W = torch.zeros(teacher_vocab_size, dtype=torch.bool, device=device)
    teacher_common_W[common_teacher] = True
    return {
        "common_student": common_student,
        "common_teacher": common_teacher,
        "uncommon_student": student_S[~student_common_S],
        "uncommon_teacher": torch.arange(teacher_vocab_size, device=device)[~teacher_common_W],
    }


def build_exact_token_map(
    path: str | os.PathLike,
    device: torch.device | str,
    *,
    xtoken_loss: bool,
    teacher_vocab_size: int,
) -> dict[str, torch.Tensor]:
    """The common/uncommon vocab partition of the gold loss from a dense file
    (:meth:`Projection.exact_map` of :func:`open_projection`).

    Rules: see :func:`exact_token_map_from_topk`.

    Args:
        path: projection file in the dense top-k layout.
        device: device of the returned tensors.
        xtoken_loss: relaxed rule (top weight >= 0.6) when True, strict one-hot rule otherwise.
        teacher_vocab_size: size of the teacher axis; teacher ids outside it never map.

    Returns:
        Dict with int64 tensors ``common_student``, ``common_teacher`` (paired, sorted by student
        id), ``uncommon_student``, ``uncommon_teacher`` (ascending) on ``device``. Shared: do not
        modify in place.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: invalid or sparse-layout file, or a non-positive ``teacher_vocab_size``.
    """
    _check_teacher_vocab(teacher_vocab_size)
    return open_projection(path, device).exact_map(teacher_vocab_size, xtoken_loss=xtoken_loss)


# --------------------------------------------------------------------------------------------
# Checked against the run's tokenizers
# --------------------------------------------------------------------------------------------


def check_projection_tokenizers(
    path: str | os.PathLike, student_tok: Any, teacher_tok: Any
) -> dict[str, Any]:
    """Check a projection file against the run's tokenizers; report and require coverage.

    A file records the tokenizers it was built for (names, vocab sizes, vocab hashes); they must
    match ``student_tok`` / ``teacher_tok``. A file without that record (built before it existed)
    is accepted with a logged warning that it cannot be checked. Either way the file must have
    usable rows: a row with at least one teacher id inside the teacher vocab.

    Args:
        path: projection file.
        student_tok: the run's student tokenizer (``name``, ``vocab_size``, ``token_bytes``,
            ``is_special``).
        teacher_tok: the run's teacher tokenizer.

    Returns:
        ``{"checked": bool, "usable_rows": int, "student_vocab": V_s, "coverage": rows / V_s}``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: built for other tokenizers, or no usable row.
    """
    from xtoken_core.data.projection_build import vocab_hash

    path = os.fspath(path)
    meta = read_projection_metadata(path)
    if meta is None:
        logger.warning(
            "[projection] %s records no tokenizers (built before files recorded them): it cannot "
            "be checked against %s -> %s; rebuild it with `xtoken projection build`",
            path,
            student_tok.name,
            teacher_tok.name,
        )
    else:
        for side, tok in (("student", student_tok), ("teacher", teacher_tok)):
            want = (meta[f"{side}_vocab_size"], meta[f"{side}_vocab_hash"])
            got = (str(int(tok.vocab_size)), vocab_hash(tok))
            if want != got:
                raise ValueError(
                    f"projection file {path!r} was built for {side} tokenizer {meta[side]!r} "
                    f"(vocab {want[0]}, hash {want[1]}) but the {side} tokenizer is "
                    f"{tok.name!r} (vocab {got[0]}, hash {got[1]}); build one for "
                    f"{student_tok.name} -> {teacher_tok.name} with `xtoken projection build`"
                )
    indices_2N, _, _, _ = parse_projection_file(path)
    usable_N = (indices_2N[1] >= 0) & (indices_2N[1] < int(teacher_tok.vocab_size))
    usable_N &= indices_2N[0] < int(student_tok.vocab_size)
    rows = int(torch.unique(indices_2N[0][usable_N]).numel())
    v_s = int(student_tok.vocab_size)
    report = {"checked": meta is not None, "usable_rows": rows, "student_vocab": v_s}
    report["coverage"] = rows / max(v_s, 1)
    if rows == 0:
        raise ValueError(
            f"projection file {path!r} has no usable row (no student row maps to a teacher id "
            f"below {teacher_tok.vocab_size}); build it for {student_tok.name} -> "
            f"{teacher_tok.name} with `xtoken projection build` (without --limit)"
        )
    logger.info(
        "[projection] %s covers %d of %d student tokens (%.1f%%)%s",
        path,
        rows,
        v_s,
        100 * report["coverage"],
        "" if meta is not None else " (tokenizers not recorded)",
    )
    return report
