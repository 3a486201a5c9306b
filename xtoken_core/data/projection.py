"""Projection-matrix files: safe parsing, cached device copies, and the exact-token map.

A projection matrix M[V_s, V_t] says how likely each student token is expressed by each teacher
token. Two on-disk layouts are read (both loaded without running code):

* dense top-k: ``{"indices": Long[V_s, K], "likelihoods": Float[V_s, K]}`` where an index of -1
  means "no entry" (its likelihood should be 0). Saved with ``torch.save`` (loaded with
  ``weights_only=True``) or as ``.safetensors``. Other keys (e.g. ``"meta"``) are ignored.
* sparse: ``{(student_id, teacher_id): weight}`` saved with ``torch.save``. Tuple keys of plain
  Python ints load under ``weights_only=True``; numpy scalars do not (re-save with ``int(...)``).

Caches: every cache key starts with ``(realpath(path), st_mtime_ns, st_size)`` so that two
spellings of one file share an entry and a rewritten file is re-read; entries of an older version
of the same file are evicted on the next miss. ``device`` is normalized with ``torch.device`` and
a bare "cuda" gets the current CUDA device index, so "cuda" and "cuda:0" share one entry. Cached
tensors are shared: callers must not modify them in place. ``clear_projection_caches()`` empties
every cache (tests).

Shape legend: S student vocab (rows of the file), W teacher vocab, K top-k slots per row,
N non-zeros of the COO form.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import struct
import threading
from collections.abc import Hashable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "EXACT_MAP_RELAXED_MIN_WEIGHT",
    "build_exact_token_map",
    "check_projection_tokenizers",
    "clear_projection_caches",
    "exact_token_map_from_topk",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "parse_projection_file",
    "read_projection_metadata",
]

# Relaxed (xtoken) exact map: a student row whose top weight reaches this is "common".
EXACT_MAP_RELAXED_MIN_WEIGHT = 0.6

_DENSE_KEYS = ("indices", "likelihoods")

_CACHE_LOCK = threading.Lock()
_SPARSE_PROJECTION_CACHE: dict[tuple, torch.Tensor] = {}
_TOPK_PROJECTION_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_EXACT_TOKEN_MAP_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}
_ALL_CACHES = (_SPARSE_PROJECTION_CACHE, _TOPK_PROJECTION_CACHE, _EXACT_TOKEN_MAP_CACHE)


# --------------------------------------------------------------------------------------------
# Reading and validating
# --------------------------------------------------------------------------------------------


def _looks_like_safetensors(path: str) -> bool:
    """True when the file starts with a safetensors header (u64 length, then a JSON object)."""
    if path.endswith(".safetensors"):
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 0 < header_len < os.path.getsize(path)


def _load_object(path: str) -> Any:
    """Load the raw object stored at ``path`` without executing code."""
    if _looks_like_safetensors(path):
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(
                f"projection file {path!r} is not a readable safetensors file: {exc}"
            ) from exc
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"projection file {path!r} holds objects that cannot be loaded without running code "
            f"(weights_only=True refused it); re-save it with plain tensors, or a dict with "
            f"(int, int) tuple keys and float values: {str(exc).splitlines()[0]}"
        ) from exc
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch.load surfaces corrupt files as many exception types
        raise ValueError(
            f"projection file {path!r} is not a torch.save file or is corrupt: {exc}"
        ) from exc


def _check_ids(ids: torch.Tensor, what: str, path: str, allow_minus_one: bool) -> None:
    bad = ids < (-1 if allow_minus_one else 0)
    if bool(bad.any()):
        value = int(ids[bad][0])
        allowed = (
            "-1 (no entry) is the only negative id allowed" if allow_minus_one else "must be >= 0"
        )
        raise ValueError(f"projection file {path!r}: {what} id {value} is negative; {allowed}")


def _check_finite(values: torch.Tensor, path: str) -> None:
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        raise ValueError(
            f"projection file {path!r}: weight {float(values[bad][0])} is not finite "
            f"({int(bad.sum())} NaN/inf weights); rebuild the projection file"
        )


def _validate_dense(obj: dict, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the dense top-k layout.

    Returns:
        ``(indices_SK int64, likelihoods_SK float32)``, both on CPU.
    """
    indices_SK, likelihoods_SK = obj["indices"], obj["likelihoods"]
    for name, t in (("indices", indices_SK), ("likelihoods", likelihoods_SK)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"projection file {path!r}: {name!r} is a {type(t).__name__}, expected a tensor"
            )
        if t.dim() != 2:
            raise ValueError(
                f"projection file {path!r}: {name!r} has shape {tuple(t.shape)}, expected 2-D "
                f"[student_vocab, top_k]"
            )
    if indices_SK.shape != likelihoods_SK.shape:
        raise ValueError(
            f"projection file {path!r}: shape mismatch, indices {tuple(indices_SK.shape)} vs "
            f"likelihoods {tuple(likelihoods_SK.shape)}; both must be [student_vocab, top_k]"
        )
    if indices_SK.numel() == 0:
        raise ValueError(
            f"projection file {path!r}: empty dense projection of shape {tuple(indices_SK.shape)}"
        )
    if (
        indices_SK.dtype.is_floating_point
        or indices_SK.dtype.is_complex
        or indices_SK.dtype == torch.bool
    ):
        raise ValueError(
            f"projection file {path!r}: 'indices' has dtype {indices_SK.dtype}, expected integer "
            f"token ids (int64)"
        )
    if likelihoods_SK.dtype.is_complex or likelihoods_SK.dtype == torch.bool:
        raise ValueError(
            f"projection file {path!r}: 'likelihoods' has dtype {likelihoods_SK.dtype}, expected float"
        )
    indices_SK = indices_SK.to(torch.int64)
    likelihoods_SK = likelihoods_SK.to(torch.float32)
    _check_ids(indices_SK, "teacher", path, allow_minus_one=True)
    _check_finite(likelihoods_SK, path)
    return indices_SK.contiguous(), likelihoods_SK.contiguous()


def _is_int(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    return (
        isinstance(x, torch.Tensor)
        and x.dim() == 0
        and not x.dtype.is_floating_point
        and x.dtype != torch.bool
    )


def _validate_sparse(obj: dict, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the sparse ``{(s, t): weight}`` layout.

    Returns:
        ``(indices_2N int64, values_N float32)``: row 0 student ids, row 1 teacher ids.
    """
    keys = list(obj.keys())
    for k in keys:
        if not (isinstance(k, tuple) and len(k) == 2):
            raise ValueError(
                f"projection file {path!r}: unknown layout, key {k!r} is not a (student_id, "
                f"teacher_id) pair; expected {{'indices', 'likelihoods'}} or {{(s, t): weight}}"
            )
        if not (_is_int(k[0]) and _is_int(k[1])):
            raise ValueError(
                f"projection file {path!r}: key {k!r} has non-integer ids; ids must be ints"
            )
    indices_N2 = torch.tensor([(int(s), int(t)) for s, t in keys], dtype=torch.int64)
    raw = list(obj.values())
    for v in raw:
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype != torch.bool
        )
        if not ok:
            raise ValueError(
                f"projection file {path!r}: weight {v!r} is not a number; weights must be floats"
            )
    values_N = torch.tensor([float(v) for v in raw], dtype=torch.float32)
    indices_2N = indices_N2.t().contiguous()
    _check_ids(indices_2N[0], "student", path, allow_minus_one=False)
    _check_ids(indices_2N[1], "teacher", path, allow_minus_one=True)
    _check_finite(values_N, path)
    return indices_2N, values_N


def _read_layout(path: str | os.PathLike) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Load and validate a projection file.

    Returns:
        ``("dense", indices_SK, likelihoods_SK)`` or ``("sparse", indices_2N, values_N)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the layout is unknown or the contents are invalid.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"projection file not found: {path!r}")
    obj = _load_object(path)
    if not isinstance(obj, dict):
        raise ValueError(
            f"projection file {path!r}: unknown layout, holds a {type(obj).__name__}; expected a "
            f"dict {{'indices': Long[V_s, K], 'likelihoods': Float[V_s, K]}} or {{(s, t): weight}}"
        )
    if not obj:
        raise ValueError(f"projection file {path!r}: empty dict, it holds no projection entries")
    if all(k in obj for k in _DENSE_KEYS):
        return ("dense", *_validate_dense(obj, path))
    obj = {k: v for k, v in obj.items() if k != "meta"}  # the builder's tokenizer record
    if not obj:
        raise ValueError(f"projection file {path!r}: holds only 'meta', no projection entries")
    if any(isinstance(k, str) for k in obj):
        raise ValueError(
            f"projection file {path!r}: unknown layout with keys {sorted(map(str, obj))[:8]}; "
            f"the dense layout needs both 'indices' and 'likelihoods'"
        )
    return ("sparse", *_validate_sparse(obj, path))


def parse_projection_file(
    path: str | os.PathLike,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Parse a projection-matrix file (dense top-k or sparse) into COO components.

    No sizing or validity policy is applied: -1 teacher ids of the dense layout ("no entry") are
    kept in the returned indices, in row-major order (row s contributes its K slots in order).

    Args:
        path: a ``torch.save`` file (dense or sparse layout) or a ``.safetensors`` file (dense).

    Returns:
        ``(indices, values, v_student_inferred, v_teacher_inferred)``:
        indices: LongTensor[2, nnz], row 0 student ids, row 1 teacher ids (may hold -1).
        values: FloatTensor[nnz] (float32).
        v_student_inferred: dense: number of rows; sparse: max student id + 1.
        v_teacher_inferred: max non-negative teacher id + 1 (0 when there is none).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown layout, empty dict, indices/likelihoods shape mismatch, negative ids
            other than -1, NaN/inf weights, non-integer ids, or a file that needs code to load.
    """
    layout, ids, weights = _read_layout(path)
    if layout == "dense":
        indices_SK, likelihoods_SK = ids, weights
        num_rows, k = indices_SK.shape
        student_SK = torch.arange(num_rows, dtype=torch.int64).unsqueeze(1).expand(num_rows, k)
        indices_2N = torch.stack([student_SK.reshape(-1), indices_SK.reshape(-1)])
        values_N = likelihoods_SK.reshape(-1).clone()
        v_student = int(num_rows)
    else:
        indices_2N, values_N = ids, weights
        v_student = int(indices_2N[0].max()) + 1
    teacher_N = indices_2N[1]
    v_teacher = int(teacher_N.max()) + 1 if bool((teacher_N >= 0).any()) else 0
    return indices_2N, values_N, v_student, v_teacher


# --------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------


def _file_key(path: str | os.PathLike) -> tuple[str, int, int]:
    """(realpath, mtime_ns, size): the identity of one version of a file."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise FileNotFoundError(f"projection file not found: {os.fspath(path)!r}") from None
    return (real, st.st_mtime_ns, st.st_size)


def _cache_get(cache: dict, key: tuple) -> Any:
    with _CACHE_LOCK:
        return cache.get(key)


def _cache_put(cache: dict, key: tuple, value: Any) -> Any:
    """Store ``value``; evict entries for older versions of the same file. Returns the stored value."""
    real, stamp = key[0][0], key[0][1:]
    with _CACHE_LOCK:
        for old in [k for k in cache if k[0][0] == real and k[0][1:] != stamp]:
            del cache[old]
        return cache.setdefault(key, value)


def clear_projection_caches() -> None:
    """Empty every projection cache (sparse matrices, top-k arrays, exact-token maps)."""
    with _CACHE_LOCK:
        for cache in _ALL_CACHES:
            cache.clear()


def _normalize_device(device: torch.device | str) -> torch.device:
    """torch.device with the current CUDA index filled in ("cuda" and "cuda:0" share entries)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def get_sparse_projection_matrix(
    path: str | os.PathLike,
    device: torch.device | str,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> torch.Tensor:
    """Return the projection matrix as a coalesced float32 sparse COO tensor on ``device`` (cached).

    Entries with a -1 teacher id are dropped. Axes are sized
    ``V_s = max(student_vocab_size, max observed student id + 1)`` and likewise ``V_t``. Cached
    per ``(file version, device, student_vocab_size, teacher_vocab_size)``; see the module doc.

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
    device = _normalize_device(device)
    key = (_file_key(path), device, student_vocab_size, teacher_vocab_size)
    hit = _cache_get(_SPARSE_PROJECTION_CACHE, key)
    if hit is not None:
        return hit
    indices_2N, values_N, v_s, v_t = parse_projection_file(path)
    keep_N = indices_2N[1] >= 0
    indices_2N, values_N = indices_2N[:, keep_N], values_N[keep_N]
    shape = (max(student_vocab_size, v_s), max(teacher_vocab_size, v_t))
    # Ids were validated (>= 0) and the shape covers them, so the invariant check is redundant.
    matrix = torch.sparse_coo_tensor(
        indices_2N, values_N, shape, dtype=torch.float32, check_invariants=False
    )
    matrix = matrix.coalesce().to(device)
    logger.info(
        "[projection] loaded %s as sparse %s with %d non-zeros on %s",
        key[0][0],
        tuple(shape),
        matrix._nnz(),
        device,
    )
    return _cache_put(_SPARSE_PROJECTION_CACHE, key, matrix)


def get_topk_projection(
    path: str | os.PathLike, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the dense top-k ``(indices, likelihoods)`` arrays on ``device`` (cached).

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
    device = _normalize_device(device)
    key = (_file_key(path), device)
    hit = _cache_get(_TOPK_PROJECTION_CACHE, key)
    if hit is not None:
        return hit
    layout, indices_SK, likelihoods_SK = _read_layout(path)
    if layout != "dense":
        raise ValueError(
            f"projection file {os.fspath(path)!r} is in the sparse {{(s, t): weight}} layout; the "
            f"top-k arrays (and the exact-token map of the gold loss) need the dense layout "
            f"{{'indices', 'likelihoods'}}: rebuild it with `xtoken projection build`"
        )
    value = (indices_SK.to(device), likelihoods_SK.to(device))
    return _cache_put(_TOPK_PROJECTION_CACHE, key, value)


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
    """Build the common/uncommon vocab partition of the gold loss from a dense file (cached).

    Rules: see :func:`exact_token_map_from_topk`. Cached per
    ``(file version, device, xtoken_loss, teacher_vocab_size)``.

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
    if (
        isinstance(teacher_vocab_size, bool)
        or not isinstance(teacher_vocab_size, int)
        or teacher_vocab_size <= 0
    ):
        raise ValueError(f"teacher_vocab_size must be a positive int, got {teacher_vocab_size!r}")
    device = _normalize_device(device)
    key: tuple[Hashable, ...] = (_file_key(path), device, bool(xtoken_loss), teacher_vocab_size)
    hit = _cache_get(_EXACT_TOKEN_MAP_CACHE, key)
    if hit is not None:
        return hit
    indices_SK, likelihoods_SK = get_topk_projection(path, device)
    result = exact_token_map_from_topk(
        indices_SK,
        likelihoods_SK,
        xtoken_loss=bool(xtoken_loss),
        teacher_vocab_size=teacher_vocab_size,
    )
    logger.info(
        "[projection] exact map (%s) of %s: %d common of %d student / %d teacher tokens",
        "relaxed" if xtoken_loss else "strict",
        key[0][0],
        result["common_student"].numel(),
        indices_SK.shape[0],
        teacher_vocab_size,
    )
    return _cache_put(_EXACT_TOKEN_MAP_CACHE, key, result)


# --------------------------------------------------------------------------------------------
# Which tokenizers a file was built for
# --------------------------------------------------------------------------------------------

_META_KEYS = (
    "student",
    "teacher",
    "student_vocab_size",
    "teacher_vocab_size",
    "student_vocab_hash",
    "teacher_vocab_hash",
)


def read_projection_metadata(path: str | os.PathLike) -> dict[str, str] | None:
    """The tokenizer record of a projection file, or None for a file without one (older files).

    Args:
        path: projection file (either layout; torch.save ``"meta"`` dict or safetensors header).

    Returns:
        :func:`xtoken_core.data.projection_build.projection_metadata`'s keys, as strings.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file cannot be read.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"projection file not found: {path!r}")
    if _looks_like_safetensors(path):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    else:
        obj = _load_object(path)
        meta = obj.get("meta") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not all(k in meta for k in _META_KEYS):
        return None
    return {k: str(meta[k]) for k in _META_KEYS}


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
