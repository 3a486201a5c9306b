"""Confinement of every path in a submitted run config to the control plane's run and data roots.

The keys come from the config dataclasses: every field marked ``path`` is confined, every field
of a section that the run sets for its process (marked ``context``) is refused. A list of
sections (``extra_teachers``) is walked entry by entry, by the marks of its entries' class: a key
``extra_teachers[].model`` stands for ``extra_teachers[0].model``, ``extra_teachers[1].model``, ..."""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The mark of an entry of a list of sections in a key: ``extra_teachers[].model``.
ENTRY = "[]"


def section_lists(cls: type, prefix: str = "") -> dict[str, type]:
    """The fields of a config tree that hold a list of sections (``list[D]``, D a dataclass), with
    the class of their entries: ``{"extra_teachers": RunExtraTeacherConfig}`` for a run config.
    Nested sections (``D`` or ``D | None``) are walked as :func:`~services.common.config.marks`
    walks them."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp) or (None,)
            if isinstance(item, type) and dataclasses.is_dataclass(item):
                out[prefix + f.name] = item
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = members[0] if len(members) == 1 else None
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(section_lists(tp, f"{prefix}{f.name}."))
    return out


def _marked(name: str) -> dict[str, Any]:
    """Every field of the run config marked ``name``, the fields of each list of sections' entries
    included (keyed ``LIST[].FIELD``)."""
    from services.common.config import marks
    from services.supervise.config import RunConfig

    out = dict(marks(RunConfig, name))
    for key, item in section_lists(RunConfig).items():
        out.update({f"{key}{ENTRY}.{k}": v for k, v in marks(item, name).items()})
    return out


def run_owned_keys() -> tuple[str, ...]:
    """The keys of a run config's sections that the run sets for every process (its fields
    marked ``context``, an ``extra_teachers`` entry's included): a submitted value is refused
    rather than silently replaced."""
    return tuple(_marked("context"))


def data_keys() -> dict[str, str]:
    """The run config's path-bearing keys a submission may set (its fields marked ``path``, an
    ``extra_teachers`` entry's included as ``extra_teachers[].KEY``, but those the run sets:
    ``context``, ``derived`` and the fields below them), each with what stands there: ``"file"``
    (a file, a folder or a glob to read), ``"dir"`` (a folder a process writes), ``"model"`` or
    ``"tokenizer"`` (a name of one or a path)."""
    owned = (*_marked("context"), *_marked("derived"))
    return {
        key: kind
        for key, kind in _marked("path").items()
        if kind != "run" and not any(_below(key, o) for o in owned)
    }


def _below(key: str, owner: str) -> bool:
    """``key`` is ``owner`` or a field below it (of its section, or of its list's entries)."""
    return key == owner or key.startswith((f"{owner}.", f"{owner}{ENTRY}."))


def find(data: dict[str, Any], key: str) -> Iterator[tuple[dict[str, Any], str, str]]:
    """Where ``key`` (a key of :func:`data_keys` or :func:`run_owned_keys`) is in a submitted
    config mapping: ``(the mapping that holds it, its last part, the key as a message names it)``
    for each place it is given, one per entry of a list of sections (``extra_teachers[1].model``).
    A part that is not a mapping (or a list of them) gives nothing: the config's check names it.
    """
    head, sep, rest = key.partition(f"{ENTRY}.")
    if sep:
        entries = _node(data, head)
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    for node, leaf, where in find(entry, rest):
                        yield node, leaf, f"{head}[{i}].{where}"
        return
    *parents, leaf = key.split(".")
    node = _node(data, ".".join(parents)) if parents else data
    if isinstance(node, dict) and leaf in node:
        yield node, leaf, key


def _node(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


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


def _given(data: dict[str, Any]) -> Iterator[tuple[Any, Any, str, str]]:
    """``(container, index, key, kind)`` of each path ``data`` gives as a string: a
    path-bearing key's value, or each string entry of its list (``data.teacher_cache[1]``)."""
    for pattern, kind in data_keys().items():
        for node, leaf, key in find(data, pattern):
            value = node[leaf]
            if isinstance(value, str):
                yield node, leaf, key, kind
            elif isinstance(value, list):
                for i, entry in enumerate(value):
                    if isinstance(entry, str):
                        yield value, i, f"{key}[{i}]", kind


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
    for owned in run_owned_keys():
        for _, _, key in find(out, owned):
            raise PathNotAllowed(
                key,
                f"{key} is set by the control plane for every run, from the run's top-level "
                "settings; remove it from the config",
            )
    roots = [Path(r).resolve() for r in data_roots]
    for node, leaf, key, kind in _given(out):
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
