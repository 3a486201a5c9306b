"""Projection-matrix files: safe loading (no code runs), validation of both layouts, and the
tokenizer record a file carries.

Two on-disk layouts are read:

* dense top-k: ``{"indices": Long[V_s, K], "likelihoods": Float[V_s, K]}`` where an index of -1
  means "no entry" (its likelihood should be 0). Saved with ``torch.save`` (loaded with
  ``weights_only=True``) or as ``.safetensors``. Other keys (e.g. ``"meta"``) are ignored.
* sparse: ``{(student_id, teacher_id): weight}`` saved with ``torch.save``. Tuple keys of plain
  Python ints load under ``weights_only=True``; numpy scalars do not (re-save with ``int(...)``).

Shape legend: S student vocab (rows of the file), K top-k slots per row, N non-zeros.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

import torch

__all__ = ["parse_projection_file", "read_layout", "read_projection_metadata"]

_DENSE_KEYS = ("indices", "likelihoods")


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


def read_layout(path: str | os.PathLike) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Load and validate a projection file.

    Args:
        path: the file.

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
    layout, ids, weights = read_layout(path)
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
