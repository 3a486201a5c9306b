"""Command-line conventions shared by every ``xtoken`` command: deprecated flag spellings (hidden,
one warning line), internal flags (hidden from ``--help``), global flags accepted at every level.

Durations are in seconds and their flags end in ``-s`` (``--queue-timeout-s``, ``--lease-s``); an
old spelling stays accepted as a hidden alias that prints one line naming the new one::

    parser.add_argument("--lease-s", type=float, default=60.0, help="...")
    add_deprecated_alias(parser, "--lease", "--lease-s")
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "INTERNAL",
    "add_deprecated_alias",
    "add_global_flags",
    "add_set_flag",
    "subparsers",
]

INTERNAL = argparse.SUPPRESS
"""``help=INTERNAL``: a flag the run engine passes to its children (``--ready-file``,
``--summary-json``): accepted, left out of ``--help``."""


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: warns once on stderr, then does what the new flag does."""

    def __init__(self, option_strings: list[str], dest: str, *, target: argparse.Action, **kw):
        super().__init__(option_strings, dest, **kw)
        self.target = target

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.target.option_strings[0]
        print(
            f"{parser.prog}: {option_string} is deprecated and will be removed; use {new}",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, new)


def add_deprecated_alias(parser: Any, old: str, new: str) -> None:
    """Accept ``old`` as a hidden, deprecated spelling of the flag ``new`` of ``parser``.

    Args:
        parser: the parser (or argument group) that holds ``new``.
        old: the old option string (``--lease``).
        new: the option string of the flag it stands for (``--lease-s``).

    Raises:
        ValueError: ``parser`` has no flag ``new``.
    """
    target = parser._option_string_actions.get(new)
    if target is None:
        raise ValueError(f"cannot alias {old}: the parser has no flag {new}")
    parser.add_argument(
        old,
        dest=target.dest,
        nargs=target.nargs,
        const=target.const,
        type=target.type,
        choices=target.choices,
        metavar=target.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        action=_DeprecatedAlias,
        target=target,
    )


def subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser under ``parser`` (subcommands, their subcommands, ...), each once."""
    seen: set[int] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    if id(child) not in seen:
                        seen.add(id(child))
                        stack.append(child)
                        yield child


def add_set_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE`` (repeatable; into ``args.overrides``): a dotted key of a run config and
    a YAML value, applied to the config's settings before they are checked.

    Args:
        parser: the command's parser.
        help_text: its ``--help`` line.
    """
    from services.common.overrides import parse_override

    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=parse_override,
        metavar="KEY=VALUE",
        help=help_text,
    )


def add_global_flags(parser: argparse.ArgumentParser) -> None:
    """Accept the global flags of ``parser`` (those without a subparser: ``--log-level``) after
    any subcommand as well (``xtoken run CONFIG --log-level DEBUG``).

    Each subcommand's copy has no default of its own, so a flag given before the subcommand
    stands unless it is given again after it.
    """
    globals_ = [
        a
        for a in parser._actions
        if a.option_strings
        and a.dest not in ("help", "version")
        and not isinstance(a, argparse._SubParsersAction)
    ]
    for child in subparsers(parser):
        group = child.add_argument_group("global options (also before the subcommand)")
        for action in globals_:
            if any(s in child._option_string_actions for s in action.option_strings):
                continue
            group.add_argument(
                *action.option_strings,
                dest=action.dest,
                type=action.type,
                choices=action.choices,
                metavar=action.metavar,
                default=argparse.SUPPRESS,
                help=action.help,
            )
