"""Typed dataclass configs: command-line flags generated from the fields, strict dict loading.

A service's settings are a (nested) dataclass whose fields carry their help text::

    @dataclass
    class Optim:
        lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})

    @dataclass
    class Config:
        steps: int = field(default=100, metadata={"help": "optimizer steps"})
        optim: Optim = field(default_factory=Optim)

    add_arguments(parser, Config)        # --steps, --optim.lr, --config FILE
    config = from_args(Config, parser.parse_args())

Each default is written once, in the dataclass. Precedence: dataclass default < ``--config FILE``
(a JSON or YAML mapping of this config) < flags given on the command line. ``from_dict`` is
strict: an unknown key, a missing required key or a value of the wrong type raises
:class:`ConfigError` naming the full dotted path (``optim.lr``); an error of a dataclass's
``__post_init__`` is re-raised with its path prefixed.

Field metadata understood here (all optional):

* ``help``: the flag's help text.
* ``flag``: the flag's name instead of the field name (``"capacity"`` -> ``--capacity``; nested
  flags keep their prefix). On a nested dataclass field, ``""`` gives its fields flags without
  a section prefix (``--queue`` instead of ``--worker.queue``).
* ``parse``: ``str -> value`` used for a string given to a non-string field, on the command line
  and in a file (e.g. a byte size ``"8GiB"``); a ``ValueError`` it raises names the problem.
* ``metavar``: the flag's metavar.
* ``cli``: False leaves the field out of the flags (it is still read from ``--config``).
* ``default_text``: the default as ``--help`` shows it (``"8GiB"``) instead of the value.
* ``required``: the process needs a value although the field defaults to None (the run sets it
  in a run config's section); :func:`from_parsed` refuses it missing, naming its flag.
* ``context``: the key of the run-wide :class:`~services.common.context.Context` this field takes
  its value from when ``--context FILE`` is given and neither the config file nor a flag sets it.
  In a run config such a field is no key of its own: the run's top-level key of that name is.
* ``derived``: the run computes this field for each process from another setting and writes it
  into the process's section: the dotted key of the run config it comes from (a copy) or, in
  words, what it is made of. In a run config such a field is no key of its own either.
* ``path``: the field names a path: ``"file"`` (a file, a folder or a glob of them, read),
  ``"dir"`` (a folder the process writes or keys by; it need not exist), ``"model"`` (a model
  spec that may be a folder or ``gguf:FILE``), ``"tokenizer"`` (a tokenizer name or a path),
  ``"run"`` (a run directory). Read by :func:`marks` (the control plane confines these paths).
* ``trained``: True when the field changes what is trained (the samples, their order and
  batches, the models, the loss, the optimizer, the seeds), False when it does not (steps,
  cadence, timeouts, devices, compute settings, paths of caches). A run's fingerprint is the
  values of the True ones (:func:`services.supervise.resume.fingerprint`); every field of a run
  config carries the mark either way (a test walks :func:`leaf_paths`).

Class attributes understood here: ``MOVED_KEYS`` (``{old dotted key: new dotted key}``, both
relative to the class): a mapping that still holds an old key is refused with one line, ``OLD
moved to NEW`` (an old key that names a section now, ``student`` moved to ``student.model``, is
the old key only with a value that is no mapping); ``REMOVED_KEYS`` (``{old key: why}``):
refused with the reason.

Supported field types: ``bool`` (``--x/--no-x``), ``int``, ``float``, ``str``, ``pathlib.Path``,
``X | None`` (``none`` on the command line), ``Literal[...]`` (choices), enums, ``list[X]``,
``tuple[X, ...]`` and fixed tuples (several values after the flag), ``dict[str, X]`` and ``Any``
(a JSON value on the command line), nested dataclasses (flags ``--section.field``). A union
flag reads the members that have a command-line form (``str | tuple[Tensor, Tensor]``: a str);
the others are for the config file and for code.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import enum
import functools
import json
import os
import pathlib
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

from xtoken_core.errors import SettingsError

__all__ = [
    "ConfigError",
    "add_arguments",
    "args_to_dict",
    "from_args",
    "from_dict",
    "from_parsed",
    "has_key",
    "leaf_paths",
    "load_context",
    "load_file",
    "marks",
    "moved_flag",
    "moved_keys",
    "section",
    "without_marked",
    "to_dict",
    "with_context",
    "yaml_loader",
]

T = TypeVar("T")

# argparse dests of the generated flags: prefixed so that they never meet the caller's own.
_DEST = "xtoken_cfg:"
_CONFIG_DEST = "xtoken_cfg_file"
_CONTEXT_DEST = "xtoken_cfg_context"
_MOVED_DEST = "xtoken_cfg_moved"
_NONE_WORDS = ("none", "null")
_MISSING = dataclasses.MISSING


class ConfigError(SettingsError):
    """A config that cannot be built: the message names the dotted path and what to change (a
    ``ValueError``; a process that raises it exits 2)."""


# ----------------------------------------------------------------------------- type helpers


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _non_none(tp: Any) -> list[Any]:
    return [a for a in typing.get_args(tp) if a is not type(None)]


def _optional_dataclass(tp: Any) -> type | None:
    """The dataclass of ``D`` or ``D | None``, else None."""
    if _is_union(tp):
        members = _non_none(tp)
        tp = members[0] if len(members) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any value"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} settings"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """Resolved field types of a dataclass (string annotations included), cached."""
    hints = _HINTS.get(cls)
    if hints is not None:
        return hints
    # Classes nested in classes (``Trainer.Config``) may name their siblings unqualified.
    localns: dict[str, Any] = {}
    owner: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
        if owner is None or part == "<locals>":
            break
        localns.update(vars(owner))
    try:
        hints = typing.get_type_hints(cls, localns=localns or None)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the field types of {cls.__qualname__} ({e}); define the dataclasses "
            "of a config at module level"
        ) from None
    _HINTS[cls] = hints
    return hints


def _check_dataclass(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")


# ----------------------------------------------------------------------------- from_dict


class _Mismatch(ConfigError):
    """A value of the wrong type right at ``path`` (unions try their next member on it)."""


def _mismatch(tp: Any, value: Any, path: str) -> _Mismatch:
    return _Mismatch(f"{path}: expected {_type_name(tp)}, got {_show(value)}")


def _accepts_str(tp: Any) -> bool:
    if tp is str or tp is Any:
        return True
    if _is_union(tp):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return any(isinstance(a, str) for a in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, enum.Enum | pathlib.PurePath)


def _convert(tp: Any, value: Any, path: str, flags: str | None = None) -> Any:
    """Check (and where lossless, convert) one value against a field type.

    ``flags`` is the flag prefix of a nested dataclass value (for messages), None to derive it.
    """
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        for member in _non_none(tp):
            try:
                return _convert(member, value, path, flags)
            except _Mismatch:
                continue
        raise _mismatch(tp, value, path)
    if origin is Literal:
        for choice in args:
            if type(value) is type(choice) and value == choice:
                return choice
        raise _mismatch(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _mismatch(tp, value, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _mismatch(tp, value, path)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _mismatch(tp, value, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _mismatch(tp, value, path)
    if tp is type(None):
        if value is None:
            return None
        raise _mismatch(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for member in tp:
            if type(value) is type(member.value) and value == member.value:
                return member
        raise _mismatch(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, pathlib.PurePath):
        if isinstance(value, str | pathlib.PurePath):
            return tp(value)
        raise _mismatch(tp, value, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _build(tp, value, path, flags)
        raise _mismatch(tp, value, path)
    if origin in (list, Sequence) or tp in (list, Sequence):
        if isinstance(value, list | tuple):
            elem = args[0] if args else Any
            return [_convert(elem, v, f"{path}[{i}]") for i, v in enumerate(value)]
        raise _mismatch(tp, value, path)
    if origin is tuple or tp is tuple:
        if not isinstance(value, list | tuple):
            raise _mismatch(tp, value, path)
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            elem = args[0] if args else Any
            return tuple(_convert(elem, v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _Mismatch(
                f"{path}: expected {len(args)} values ({_type_name(tp)}), got {_show(value)}"
            )
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, f"{path} key {k!r}"): _convert(val_tp, v, _join(path, k))
            for k, v in value.items()
        }
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _mismatch(tp, value, path)
    raise TypeError(f"{path}: config fields of type {tp!r} are not supported")


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build a config dataclass from a mapping, strictly.

    Args:
        cls: the dataclass type.
        data: ``{field name: value}``; nested dataclass fields take nested mappings (or
            instances); missing keys keep the dataclass default.
        path: dotted path of ``data`` inside a larger config (error messages start with it).

    Returns:
        The config instance.

    Raises:
        ConfigError: an unknown key (names the closest keys and the file defining them), a missing
            required key, a value of the wrong type (names the expected type and the value),
            or a ``ValueError`` of the dataclass's ``__post_init__`` (with the path prefixed).
        TypeError: ``cls`` is not a dataclass, or a field has an unsupported type.
    """
    _check_dataclass(cls)
    return _build(cls, data, path, None)


def _build(cls: type[T], data: Any, path: str, flags: str | None) -> T:
    if flags is None:
        flags = f"{_flag_name(path)}." if path else ""
    if not isinstance(data, Mapping):
        where = path or cls.__name__
        raise ConfigError(
            f"{where}: expected a mapping of {cls.__name__} settings, got {_show(data)}"
        )
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for old, new in getattr(cls, "MOVED_KEYS", {}).items():
        if _holds_moved_key(cls, data, old):
            raise ConfigError(f"{_join(path, old)} moved to {_join(path, new)}")
    removed = getattr(cls, "REMOVED_KEYS", {})
    for key in data:
        if key not in fields and key in removed:
            raise ConfigError(f"key {_join(path, key)!r} was removed: {removed[key]}")
        if key not in fields:
            raise ConfigError(_unknown_key(cls, path, str(key), list(fields)))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key_path = _join(path, name)
        segment = _flag_name(f.metadata.get("flag", name))
        child_flags = f"{flags}{segment}." if segment else flags
        if name not in data:
            if f.default is not _MISSING or f.default_factory is not _MISSING:
                continue
            section = hints[name]
            if isinstance(section, type) and dataclasses.is_dataclass(section):
                # an absent required section is an empty one: the error names its missing key
                kwargs[name] = _build(section, {}, key_path, child_flags)
                continue
            raise ConfigError(
                f"missing required key {key_path!r} ({_type_name(section)}): set it in the "
                f"config file or with --{flags}{segment}"
            )
        value, parse = data[name], f.metadata.get("parse")
        if parse is not None and isinstance(value, str) and not _accepts_str(hints[name]):
            try:
                value = parse(value)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ConfigError(f"{key_path}: {e}") from None
        kwargs[name] = _convert(hints[name], value, key_path, child_flags)
    try:
        return cls(**kwargs)
    except ValueError as e:  # __post_init__ validation (ConfigError included)
        raise ConfigError(f"{path}: {e}" if path else str(e)) from e


def _holds_moved_key(cls: type, data: Mapping[str, Any], old: str) -> bool:
    """``data`` holds the moved key ``old``. Where ``old`` names a section of ``cls`` now (a
    trainer's ``student`` string moved to ``student.model``), only a value that is no mapping
    (nor an instance) of that section is the old key."""
    if not has_key(data, old):
        return False
    node: Any = data
    owner: Any = cls
    for part in old.split("."):
        node = node[part]
        hint = _hints(owner).get(part) if owner is not None else None
        owner = None if hint is None else _optional_dataclass(hint)
    return owner is None or not isinstance(node, Mapping | owner)


def _unknown_key(cls: type, path: str, key: str, names: list[str]) -> str:
    """One short line: the unknown key, the closest valid names, the file that defines them (a
    close moved key is named by its new key: ``max_step`` -> ``schedule.max_steps``)."""
    moved = {old: new for old, new in getattr(cls, "MOVED_KEYS", {}).items() if "." not in old}
    names = names + [old for old in moved if old not in names]
    close = difflib.get_close_matches(key, names, n=3)
    # past the closest, only the names nearly as close, or that hold the key (or it them)
    close = close[:1] + [
        n for n in close[1:] if difflib.SequenceMatcher(None, key, n).ratio() > 0.8
    ]
    close += [n for n in names if n not in close and (key in n or n in key)][: 3 - len(close)]
    shown = list(dict.fromkeys(repr(_join(path, moved.get(n, n))) for n in close))
    hint = f": did you mean {' or '.join(shown)}?" if shown else ""
    # the files that declare the fields, most first (a run's section adds a few to its process's)
    declared: dict[str, int] = {}
    for klass in cls.__mro__:
        own = [n for n in vars(klass).get("__annotations__", {}) if n in fields_of(cls)]
        if dataclasses.is_dataclass(klass) and own:
            module = klass.__module__.replace(".", "/") + ".py"
            declared[module] = declared.get(module, 0) + len(own)
    where = f"{path}'s keys" if path else f"the keys of {cls.__name__}"
    files = ", ".join(sorted(declared, key=lambda m: -declared[m]))
    return f"unknown key {_join(path, key)!r}{hint} ({where}: {files})"


def fields_of(cls: type) -> set[str]:
    """The field names of a dataclass."""
    return {f.name for f in dataclasses.fields(cls)}


def has_key(data: Mapping[str, Any], dotted: str) -> bool:
    """A mapping holds the dotted key (through nested mappings)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _flag_name(path: str) -> str:
    return path.replace("_", "-")


# ----------------------------------------------------------------------------- field marks


def marks(cls: type, name: str) -> dict[str, Any]:
    """Every field of a config tree that carries the metadata key ``name``, with its value.

    Args:
        cls: the config dataclass (nested dataclass fields, ``D | None`` included, are walked).
        name: the metadata key, e.g. ``"path"`` or ``"context"``.

    Returns:
        Dotted field path (``trainer.loss.projection``) -> the metadata value, in field order.
    """
    _check_dataclass(cls)
    out: dict[str, Any] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if name in f.metadata:
            out[f.name] = f.metadata[name]
        nested = _optional_dataclass(hints[f.name])
        if nested is not None:
            out.update({f"{f.name}.{k}": v for k, v in marks(nested, name).items()})
    return out


def moved_keys(cls: type) -> dict[str, str]:
    """The ``MOVED_KEYS`` of a config tree by their full dotted keys (``trainer.micro_batch`` ->
    ``trainer.feed.micro_batch``): what a record of an earlier version calls each setting."""
    _check_dataclass(cls)
    out = dict(getattr(cls, "MOVED_KEYS", {}))
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        nested = _optional_dataclass(hints[f.name]) if f.init else None
        if nested is not None:
            out.update({f"{f.name}.{o}": f"{f.name}.{n}" for o, n in moved_keys(nested).items()})
    return out


def leaf_paths(cls: type) -> list[str]:
    """Every setting of a config tree: the dotted path of each field that is not a section.

    Args:
        cls: the config dataclass (nested dataclass fields, ``D | None`` included, are walked;
            fields that are not ``__init__`` arguments are left out).

    Returns:
        Dotted field paths (``trainer.optim.lr``), in field order.
    """
    _check_dataclass(cls)
    out: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        nested = _optional_dataclass(hints[f.name])
        if nested is None:
            out.append(f.name)
        else:
            out.extend(f"{f.name}.{k}" for k in leaf_paths(nested))
    return out


def with_context(cls: type, data: Mapping[str, Any], context: Any) -> dict[str, Any]:
    """A process's config mapping with the run-wide values filled in.

    Args:
        cls: the process's config dataclass (its fields marked ``context``).
        data: its own section (not modified); a value set there wins over the context.
        context: the :class:`~services.common.context.Context` (or its mapping).

    Returns:
        A copy of ``data`` where every context-marked field it does not set holds the
        context's value.
    """
    values = context if isinstance(context, Mapping) else to_dict(context)
    return _fill_context(cls, copy.deepcopy(dict(data)), values)


def _fill_context(cls: type, data: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f.metadata.get("context")
        if f.init and key is not None and f.name not in data and key in values:
            data[f.name] = values[key]
        nested = _optional_dataclass(hints[f.name])
        if nested is None or not f.init:
            continue
        sub = data.get(f.name)
        if isinstance(sub, Mapping):
            data[f.name] = _fill_context(nested, dict(sub), values)
        elif f.name not in data and nested is hints[f.name]:  # an absent section (never None)
            filled = _fill_context(nested, {}, values)
            if filled:
                data[f.name] = filled
    return data


def section(config: Any, without: tuple[str, ...] = ("context",)) -> dict[str, Any]:
    """A process's own section: the JSON form of its config without the context-marked fields
    (those come from the run's shared context; :func:`with_context` puts them back).

    Args:
        config: a config dataclass instance.
        without: the marks whose fields are left out (a run config's own record leaves out
            ``derived`` ones too: the run sets those).

    Returns:
        :func:`to_dict` of ``config`` less every field carrying one of the marks.
    """
    return without_marked(type(config), to_dict(config), without)


def without_marked(
    cls: type, data: Mapping[str, Any], marks_: tuple[str, ...] = ("context",)
) -> dict[str, Any]:
    """A copy of a config mapping of ``cls`` less every key whose field carries one of the
    marks (nested sections included)."""
    out = copy.deepcopy(dict(data))
    for mark in marks_:
        for path in marks(cls, mark):
            *parents, leaf = path.split(".")
            node: Any = out
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
    return out


def load_context(path: str | os.PathLike[str]) -> Any:
    """Read and check a run's shared context file (``--context FILE``).

    Returns:
        The :class:`~services.common.context.Context`.

    Raises:
        ConfigError: as :func:`load_file`, or a context key missing, unknown or of a wrong type
            (names the file).
    """
    from services.common.context import Context

    data = load_file(path, kind="context")
    try:
        return from_dict(Context, data)
    except ConfigError as e:
        raise ConfigError(f"context file {str(path)!r}: {e}") from None


# ----------------------------------------------------------------------------- to_dict


def _plain(value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name), _join(path, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, _join(path, k)) for k, v in value.items()}
    raise TypeError(f"{path}: {_show(value)} has no JSON form; use a str/int/float field")


def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON-able form of a config (nested dicts, lists for tuples, values of enums).

    Args:
        obj: a dataclass instance.

    Returns:
        A dict that ``from_dict(type(obj), ...)`` turns back into an equal config.

    Raises:
        TypeError: ``obj`` is not a dataclass instance, or holds a value with no JSON form.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict takes a dataclass instance, got {_show(obj)}")
    return _plain(obj, "")


# ----------------------------------------------------------------------------- files


@functools.cache
def yaml_loader() -> Any:
    """The YAML loader of config files: ``yaml.SafeLoader`` that also reads ``1e-4`` as a float.

    Returns:
        A ``yaml.SafeLoader`` subclass (for ``yaml.load(text, Loader=...)``).
    """
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that reads ``1e-4`` as a float (YAML 1.1 needs ``1.0e-4``)."""

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return Loader


def load_file(
    path: str | os.PathLike[str], *, section: str | None = None, kind: str = "config"
) -> dict[str, Any]:
    """Read a config mapping from a JSON or YAML file.

    Args:
        path: ``.json``, ``.yaml`` or ``.yml`` (another suffix: JSON, then YAML).
        section: dotted key of the sub-mapping to return (e.g. ``"trainer"`` of a run
            config); None returns the whole file.
        kind: what the file is, for messages (``"context"`` file).

    Returns:
        The mapping (an empty YAML file gives ``{}``).

    Raises:
        ConfigError: the file is missing or unreadable, does not parse (names the line), is not
            a mapping, or lacks ``section`` (names the sections it has).
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{kind} file {str(path)!r} cannot be read: {e.strerror or e}") from None
    suffix = path.suffix.lower()
    data: Any
    if suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, path, kind)
    elif suffix == ".json":
        data = _parse_json(text, path, kind)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = _parse_yaml(text, path, kind)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{kind} file {str(path)!r} holds {_show(data)}, not a mapping")
    if section:
        for i, key in enumerate(section.split(".")):
            if not isinstance(data, Mapping) or key not in data:
                have = ", ".join(map(str, data)) if isinstance(data, Mapping) else "no sections"
                where = ".".join(section.split(".")[:i]) or "the top level"
                raise ConfigError(
                    f"{kind} file {str(path)!r} has no section {section!r} (at {where}: {have})"
                )
            data = data[key]
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"section {section!r} of {str(path)!r} is {_show(data)}, not a mapping"
            )
    return dict(data)


def _parse_json(text: str, path: pathlib.Path, kind: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{kind} file {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} "
            f"column {e.colno}"
        ) from None


def _parse_yaml(text: str, path: pathlib.Path, kind: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError(f"{kind} file {str(path)!r} is not valid YAML: {e}") from None


# ----------------------------------------------------------------------------- flags


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str  # dotted field path, the key in from_dict
    flag: str  # "--optim.lr"
    tp: Any
    field: dataclasses.Field
    owner: type  # the dataclass holding the field


def _leaves(cls: type, path: str = "", flag_prefix: str = "") -> Iterator[_Leaf]:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli", True) is False:
            continue
        tp = hints[f.name]
        segment = _flag_name(f.metadata.get("flag", f.name))
        nested = _optional_dataclass(tp)
        if nested is not None:  # flag "": the section's flags get no prefix of their own
            prefix = f"{flag_prefix}{segment}." if segment else flag_prefix
            yield from _leaves(nested, _join(path, f.name), prefix)
        else:
            yield _Leaf(_join(path, f.name), f"--{flag_prefix}{segment}", tp, f, cls)


def _none_or(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() in _NONE_WORDS else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _bool_word(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; write true or false")


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON; write e.g. '{{\"key\": 1}}' (quoted for the shell)"
        ) from None


def _scalar_conv(tp: Any, where: str) -> Callable[[str], Any]:
    """``str -> value`` of one command-line word for a non-container type."""
    if tp is int or tp is float or tp is str:
        return tp
    if tp is bool:
        return _bool_word
    if isinstance(tp, type) and issubclass(tp, pathlib.PurePath):
        return tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        by_text = {str(m.value): m.value for m in tp}

        def enum_value(text: str) -> Any:
            if text not in by_text:
                raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(by_text)}")
            return by_text[text]

        return enum_value
    if typing.get_origin(tp) is Literal:
        by_text = {str(c): c for c in typing.get_args(tp)}

        def literal(text: str) -> Any:
            if text not in by_text:
                raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(by_text)}")
            return by_text[text]

        return literal
    if _is_union(tp):
        # a member without a command-line form (an in-memory tensor pair, a list) is left to
        # the config file and to code; the flag reads the members that have one
        convs = []
        for member in _non_none(tp):
            try:
                convs.append(_scalar_conv(member, where))
            except TypeError:
                continue
        if not convs:
            raise TypeError(
                f"{where}: a field of type {_type_name(tp)} has no command-line form; give it "
                'metadata={"cli": False} (it is still read from --config) or another type'
            )

        def union(text: str) -> Any:
            for conv in convs:
                try:
                    return conv(text)
                except (ValueError, argparse.ArgumentTypeError):
                    continue
            raise argparse.ArgumentTypeError(f"{text!r} is not {_type_name(tp)}")

        conv = union if len(convs) > 1 else convs[0]
        return _none_or(conv) if type(None) in typing.get_args(tp) else conv
    if tp is Any or typing.get_origin(tp) in (dict, Mapping) or tp in (dict, Mapping):
        return _json_value
    raise TypeError(
        f"{where}: a field of type {_type_name(tp)} has no command-line form; give it "
        'metadata={"cli": False} (it is still read from --config) or another type'
    )


def _flag_kwargs(leaf: _Leaf) -> dict[str, Any]:
    """argparse keyword arguments of one leaf's flag."""
    tp, meta = leaf.tp, leaf.field.metadata
    where = f"{leaf.owner.__qualname__}.{leaf.field.name}"
    optional = _is_union(tp) and type(None) in typing.get_args(tp)
    members = _non_none(tp) if _is_union(tp) else [tp]
    core = members[0] if len(members) == 1 else tp
    parse = meta.get("parse")
    if parse is not None and not _accepts_str(tp):

        def parse_flag(text: str) -> Any:
            try:
                return parse(text)
            except ValueError as e:  # argparse would print only "invalid value"
                raise argparse.ArgumentTypeError(str(e)) from None

        return {"type": _none_or(parse_flag) if optional else parse_flag}
    if core is bool:
        return {"action": argparse.BooleanOptionalAction}
    origin, args = typing.get_origin(core), typing.get_args(core)
    if origin in (list, Sequence) or core in (list, Sequence):
        return {"nargs": "*", "type": _scalar_conv(args[0] if args else str, where)}
    if origin is tuple or core is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return {"nargs": "*", "type": _scalar_conv(args[0] if args else str, where)}
        if len(set(args)) != 1:
            raise TypeError(f"{where}: a tuple of mixed types has no command-line form")
        return {"nargs": len(args), "type": _scalar_conv(args[0], where)}
    kwargs: dict[str, Any] = {"type": _scalar_conv(tp, where)}
    if typing.get_origin(core) is Literal and not optional:
        kwargs["choices"] = list(typing.get_args(core))
    elif isinstance(core, type) and issubclass(core, enum.Enum) and not optional:
        kwargs["choices"] = [m.value for m in core]
    return kwargs


def _value_at(instance: Any, path: str) -> Any:
    for part in path.split("."):
        if instance is None:
            return _MISSING
        instance = getattr(instance, part)
    return instance


def _default_text(leaf: _Leaf, root_default: Any) -> str:
    value = _value_at(root_default, leaf.path) if root_default is not None else _MISSING
    if "default_text" in leaf.field.metadata:
        return f"default: {leaf.field.metadata['default_text']}"
    if value is _MISSING:
        f = leaf.field
        if f.default is not _MISSING:
            value = f.default
        elif f.default_factory is not _MISSING:
            value = f.default_factory()
        else:
            return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list | tuple):
        return "default: " + (" ".join(map(str, value)) or "empty")
    return f"default: {value}"


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per leaf field of a config dataclass, plus ``--config FILE``.

    Flags are ``--name`` (underscores become dashes), nested ``--section.name``; ``bool``
    fields get ``--name/--no-name``. The defaults stay in the dataclass: a flag not given on the
    command line leaves the value of ``--config`` or the default (the help shows it). A key of
    ``MOVED_KEYS`` has no flag (a flag has one spelling); given anyway, :func:`moved_flag` names
    its new one.

    Args:
        parser: the parser (or subcommand parser) to extend.
        cls: the config dataclass.

    Raises:
        TypeError: ``cls`` is not a dataclass, or a field type has no command-line form (give
            that field ``metadata={"cli": False}``).
    """
    _check_dataclass(cls)
    try:
        root_default = cls()
    except Exception:  # required fields (or a check that needs them): per-field defaults
        root_default = None
    if "--config" not in parser._option_string_actions:
        parser.add_argument(
            "--config",
            dest=_CONFIG_DEST,
            metavar="FILE",
            default=None,
            help="JSON or YAML file with these settings; flags given here override it",
        )
    moved = _moved_flags(cls)
    if moved:  # no flag of their own (one spelling): named by moved_flag when given
        parser.set_defaults(**{_MOVED_DEST: (parser.prog, moved)})
    if marks(cls, "context") and "--context" not in parser._option_string_actions:
        parser.add_argument(
            "--context",
            dest=_CONTEXT_DEST,
            metavar="FILE",
            default=None,
            help="the run-wide settings a run's processes share (queue, partition, tokenizers, "
            "context lengths, packing, run directory), as xtoken run writes them "
            "(RUN_DIR/config/context.json); --config and flags override them",
        )
    groups: dict[str, Any] = {}
    for leaf in _leaves(cls):
        section = leaf.path.rpartition(".")[0]
        target: Any = parser
        if section:
            if section not in groups:
                doc = (leaf.owner.__doc__ or "").strip().splitlines()
                groups[section] = parser.add_argument_group(
                    section, doc[0] if doc and not doc[0].startswith(leaf.owner.__name__) else None
                )
            target = groups[section]
        kwargs = _flag_kwargs(leaf)
        if "action" not in kwargs and "choices" not in kwargs:
            name = leaf.flag.rpartition(".")[2].lstrip("-")
            kwargs["metavar"] = leaf.field.metadata.get("metavar", name.upper().replace("-", "_"))
        help_text = leaf.field.metadata.get("help", "")
        help_text = f"{help_text} ({_default_text(leaf, root_default)})".strip()
        target.add_argument(
            leaf.flag,
            dest=_DEST + leaf.path,
            default=argparse.SUPPRESS,
            help=help_text.replace("%", "%%"),
            **kwargs,
        )


def _moved_flags(cls: type) -> dict[str, str]:
    """``{old flag: new flag}`` of the ``MOVED_KEYS`` of a config tree (``--micro-batch`` ->
    ``--feed.micro-batch``), less any old flag that is a flag again."""
    leaves = {leaf.path: leaf for leaf in _leaves(cls)}
    out: dict[str, str] = {}

    def walk(owner: type, path: str, prefix: str) -> None:
        for old, new in getattr(owner, "MOVED_KEYS", {}).items():
            leaf = leaves.get(_join(path, new))
            old_flag = f"--{prefix}{_flag_name(old)}"
            out[old_flag] = leaf.flag if leaf else f"--{prefix}{_flag_name(new)}"
            if leaf and _flag_kwargs(leaf).get("action") is argparse.BooleanOptionalAction:
                out[f"--no-{old_flag[2:]}"] = f"--no-{leaf.flag[2:]}"
        hints = _hints(owner)
        for f in dataclasses.fields(owner):
            nested = _optional_dataclass(hints[f.name]) if f.init else None
            if nested is not None and f.metadata.get("cli", True) is not False:
                segment = _flag_name(f.metadata.get("flag", f.name))
                walk(nested, _join(path, f.name), f"{prefix}{segment}." if segment else prefix)

    walk(cls, "", "")
    current = {leaf.flag for leaf in leaves.values()}
    return {old: new for old, new in out.items() if old not in current}


def moved_flag(args: argparse.Namespace, unknown: Sequence[str]) -> str | None:
    """The one line that refuses a flag of a moved key among the arguments a parser did not
    know (``xtoken trainer: --micro-batch moved to --feed.micro-batch``), or None.

    Args:
        args: the namespace of ``parse_known_args`` (of a parser given :func:`add_arguments`).
        unknown: the arguments it did not know.
    """
    prog, moved = getattr(args, _MOVED_DEST, ("", {}))
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag in moved:
            return f"{prog}: {flag} moved to {moved[flag]}"
    return None


def _check_required(cls: type, config: Any) -> None:
    """Every field marked ``required`` holds a value (one a run would set in its section).

    Raises:
        ConfigError: the first missing one, named as a missing key with its flag.
    """
    leaves = {leaf.path: leaf for leaf in _leaves(cls)}
    for path in marks(cls, "required"):
        if _value_at(config, path) is not None:
            continue
        leaf = leaves.get(path)
        kind = _type_name(_non_none(leaf.tp)[0]) if leaf and _is_union(leaf.tp) else "a value"
        where = f"the config file or with {leaf.flag}" if leaf else "the config file"
        raise ConfigError(f"missing required key {path!r} ({kind}): set it in {where}")


def _set_path(data: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, Mapping):
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"{where}: the config file gives {_show(child)} but --{_flag_name(path)} sets "
                "a field inside it; make it a mapping"
            )
        elif not isinstance(child, dict):
            child = node[part] = dict(child)
        node = child
    node[parts[-1]] = value


def args_to_dict(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The config mapping of parsed arguments, not yet checked: the context's values (``--context
    FILE``), then ``--config FILE`` over them, then every flag given on the command line.

    Args:
        cls: the config dataclass (of a parser given ``add_arguments(parser, cls)``).
        args: the parsed namespace.

    Returns:
        The mapping :func:`from_dict` builds the config from.

    Raises:
        ConfigError: a context or config file that cannot be read (as :func:`load_file`,
            :func:`load_context`).
    """
    _check_dataclass(cls)
    file = getattr(args, _CONFIG_DEST, None)
    data = load_file(file) if file else {}
    context = getattr(args, _CONTEXT_DEST, None)
    if context:
        data = with_context(cls, data, load_context(context))
    given = vars(args)
    for leaf in _leaves(cls):
        key = _DEST + leaf.path
        if key in given:
            _set_path(data, leaf.path, given[key])
    return data


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build a config from parsed arguments (of a parser given ``add_arguments(parser, cls)``).

    Args:
        cls: the config dataclass.
        args: the parsed namespace: the values of ``--context FILE`` come first, ``--config
            FILE`` overrides them, and every flag given on the command line overrides its key.

    Returns:
        The config instance.

    Raises:
        ConfigError: as :func:`args_to_dict` and :func:`from_dict`.
    """
    return from_parsed(cls, args_to_dict(cls, args), args)


def from_parsed(cls: type[T], data: Mapping[str, Any], args: argparse.Namespace) -> T:
    """:func:`from_dict` of a mapping from :func:`args_to_dict`; an error names the files used.

    Raises:
        ConfigError: as :func:`from_dict`, with the config and context files named.
    """
    try:
        config = from_dict(cls, data)
        _check_required(cls, config)
        return config
    except ConfigError as e:
        files = [
            f"{what} file {name!r}"
            for what, name in (
                ("config", getattr(args, _CONFIG_DEST, None)),
                ("context", getattr(args, _CONTEXT_DEST, None)),
            )
            if name
        ]
        if files:
            raise ConfigError(f"{e} ({', '.join(files)} and flags)") from e.__cause__
        raise
