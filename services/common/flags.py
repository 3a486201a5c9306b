"""Command-line conventions shared by every ``xtoken`` command: internal flags (hidden from
``--help``), global flags accepted at every level, the run configs' ``--set``.

Durations are in seconds and their flags end in ``-s`` (``--queue-timeout-s``, ``--lease-s``); a
flag has one spelling, and no abbreviation of it is accepted (parsers are built with
``allow_abbrev=False``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

__all__ = [
    "INTERNAL",
    "add_global_flags",
    "add_set_flag",
    "subparsers",
]

INTERNAL = argparse.SUPPRESS
"""``help=INTERNAL``: a flag the run engine passes to its children (``--ready-file``,
``--summary-json``): accepted, left out of ``--help``."""


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
