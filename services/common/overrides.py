"""``--set KEY=VALUE`` overrides of a config file: a dotted key and a YAML value, applied to the
file's mapping before it is validated (so an override is checked exactly like the file)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.config import ConfigError, yaml_loader

__all__ = ["Override", "apply_overrides", "parse_override"]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)*")
EXAMPLE = "--set trainer.optim.lr=1e-4"


@dataclasses.dataclass(frozen=True)
class Override:
    """One parsed ``--set``.

    Attributes:
        key: the dotted key (``trainer.optim.lr``).
        value: the value, parsed as YAML (``1e-4`` -> 0.0001, ``[1, 2]`` -> a list, ``null``).
        text: the argument as given (for messages).
    """

    key: str
    value: Any
    text: str


def parse_override(text: str) -> Override:
    """Parse one ``KEY=VALUE`` (an argparse ``type``).

    Args:
        text: ``trainer.optim.lr=1e-4``; the value is a YAML scalar, list or mapping
            (``trainer.schedule.max_steps=100``, ``data.heldout=null``,
            ``data.train=corpus.jsonl``).

    Returns:
        The :class:`Override`.

    Raises:
        argparse.ArgumentTypeError: no ``=``, a key that is not dotted names, or a value that is
            not YAML (names the argument and shows the form).
    """
    import yaml

    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not _KEY.fullmatch(key):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write KEY=VALUE with a dotted config key, e.g. {EXAMPLE}"
        )
    try:
        value = yaml.load(raw, Loader=yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise argparse.ArgumentTypeError(
            f"{text!r}: the value is not YAML ({problem}); quote it for the shell, e.g. "
            "--set 'data.train=my corpus.jsonl'"
        ) from None
    return Override(key, value, text)


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[Override]) -> dict[str, Any]:
    """A copy of a config mapping with each override set, in order (a later one wins).

    A key whose sections are missing gets them (``trainer.optim.lr`` in a file without
    ``trainer``); whether the key exists is left to the config's validation, which names the
    closest valid keys.

    Args:
        data: the config file's mapping (not modified).
        overrides: parsed ``--set`` arguments.

    Returns:
        The new mapping.

    Raises:
        ConfigError: a key goes through a value that is not a mapping (names the key, the
            value there and the fix).
    """
    out = _copy(data)
    for override in overrides:
        parts = override.key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(
                    f"--set {override.text}: {where} is {child!r}, not a section; set {where} "
                    "itself, or a key of a section"
                )
            node = child
        node[parts[-1]] = override.value
    return out


def _copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _copy(v) for k, v in data.items()}
    return data
