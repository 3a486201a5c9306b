"""Confinement of every path in a submitted run config to the control plane's run and data roots.

The keys come from the config dataclasses: every field marked ``path`` is confined, every field
of a section that the run sets for its process (marked ``context``) is refused."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any


def run_owned_keys() -> tuple[str, ...]:
    """The keys of a run config's sections that the run sets for every process (its fields
    marked ``context``): a submitted value is refused rather than silently replaced."""
    from services.common.config import marks
    from services.supervise.config import RunConfig

    return tuple(marks(RunConfig, "context"))


def data_keys() -> dict[str, str]:
    """The run config's path-bearing keys a submission may set (its fields marked ``path``, but
    those the run sets: ``context``, ``derived`` and the fields below them), each with what
    stands there: ``"file"`` (a file, a folder or a glob to read), ``"dir"`` (a folder a process
    writes), ``"model"`` or ``"tokenizer"`` (a name of one or a path)."""
    from services.common.config import marks
    from services.supervise.config import RunConfig

    owned = (*marks(RunConfig, "context"), *marks(RunConfig, "derived"))
    return {
        key: kind
        for key, kind in marks(RunConfig, "path").items()
        if kind != "run" and not any(key == o or key.startswith(f"{o}.") for o in owned)
    }


class PathNotAllowed(ValueError):
    """A path of a submitted config outside the allowed roots (HTTP 403).

    Attributes:
        key: the dotted config key.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _names(kind: str) -> set[str]:
    if kind == "model":
        from xtoken_core.models import model_spec_names

        return set(model_spec_names())
    if kind == "tokenizer":
        from xtoken_core.tokenizers import available_tokenizers

        return set(available_tokenizers())
    return set()


def _model_path(spec: str) -> tuple[str, str, str]:
    """``(name or path, "gguf:" or "", ":drop=..." or "")`` of a model spec."""
    from xtoken_core.models.gguf import GGUF_PREFIX
    from xtoken_core.models.layer_drop import DROP_SEP

    suffix = ""
    if DROP_SEP in spec:
        spec, sep, drop = spec.rpartition(DROP_SEP)
        suffix = sep + drop
    if spec.startswith(GGUF_PREFIX):
        return spec[len(GGUF_PREFIX) :], GGUF_PREFIX, suffix
    return spec, "", suffix


def _get(data: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = data
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def confine(
    raw: dict[str, Any],
    *,
    run_dir: str | os.PathLike,
    runs_root: str | os.PathLike,
    data_roots: list[str | os.PathLike],
) -> dict[str, Any]:
    """A copy of ``raw`` with every path made absolute and checked against its root.

    ``run_dir``: a relative value is taken under ``runs_root``; it must stay inside it.
    Data files and folders, model folders, tokenizer files and the projection: a relative value
    is taken under the first data root; each must resolve (symlinks followed) inside one of
    ``data_roots``. Names that are not paths (model presets, ``smollm2``, bundled tokenizers)
    pass unchanged.

    Args:
        raw: the submitted config mapping (not changed).
        run_dir: the run directory to use (the submitted ``run_dir`` or one the control plane
            chose).
        runs_root: the root of run directories.
        data_roots: roots of data, models, tokenizers and projections.

    Returns:
        The rewritten mapping (``run_dir`` absolute).

    Raises:
        PathNotAllowed: a path outside its root, or a key the run sets itself (names the key,
            the root and what to do).
    """
    out = copy.deepcopy(raw)
    root = Path(runs_root).resolve()
    rd = Path(run_dir)
    rd = (root / rd if not rd.is_absolute() else rd).resolve()
    if not _inside(rd, root) or rd == root:
        raise PathNotAllowed(
            "run_dir",
            f"run_dir={str(run_dir)!r} is outside the runs root {str(root)!r}; give a name "
            "relative to it (or leave run_dir out: the control plane picks one)",
        )
    out["run_dir"] = str(rd)
    for key in run_owned_keys():
        node, leaf = _get(out, key)
        if node is not None and leaf in node:
            raise PathNotAllowed(
                key,
                f"{key} is set by the control plane for every run, from the run's top-level "
                "settings; remove it from the config",
            )
    roots = [Path(r).resolve() for r in data_roots]
    for key, kind in data_keys().items():
        node, leaf = _get(out, key)
        if node is None or leaf not in node or not isinstance(node[leaf], str):
            continue
        value = node[leaf]
        prefix = suffix = ""
        if kind == "model":  # gguf:PATH and a :drop= suffix keep their form around the path
            value, prefix, suffix = _model_path(value)
        if kind in ("model", "tokenizer") and not prefix and value in _names(kind):
            continue
        path = Path(value)
        path = (roots[0] / path if not path.is_absolute() else path).resolve()
        if not any(_inside(path, r) for r in roots):
            allowed = ", ".join(repr(str(r)) for r in roots)
            names = f" or one of {', '.join(sorted(_names(kind)))}" if kind != "file" else ""
            raise PathNotAllowed(
                key,
                f"{key}={value!r} is outside the data roots ({allowed}); put the file under "
                f"a data root and give its path relative to it{names}",
            )
        node[leaf] = f"{prefix}{path}{suffix}"
    return out
