"""The `xtoken` console script: the parser of every subcommand and the dispatch to it.

The commands that belong to no one service live beside it (:mod:`.run`, :mod:`.demo`,
:mod:`.projection`, :mod:`.collate_stats`); a service's own command stays with the service
(``services/<svc>/cli.py``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# name -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
# Imports are lazy so that `xtoken projection build` never imports zmq or fastapi.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("services.cli.demo", "run the main job: a distillation on the embedded CPU default"),
    "run": ("services.cli.run", "run a whole distillation (queue, collators, teachers, trainers)"),
    "teacher": ("services.teacher.cli", "serve teacher logits to trainers"),
    "trainer": ("services.trainer.cli", "train a student (one rank; torchrun-compatible)"),
    "rollout": ("services.rollout.cli", "sample on-policy continuations with a student copy"),
    "collate-stats": (
        "services.cli.collate_stats",
        "alignment statistics of two tokenizers on a corpus",
    ),
    "projection": ("services.cli.projection", "build or inspect projection matrices"),
    "cache": ("services.cli.cache", "build, inspect or verify a teacher cache"),
    "queue": ("services.queue.cli", "run or query a transfer-queue server"),
    "collator": ("services.collator.cli", "collate a text corpus into a queue"),
    "control": ("services.control.cli", "serve the control plane (REST API for runs)"),
}


# subcommand -> the extra of pyproject.toml that installs the packages it needs beyond xtoken's
# own dependencies (its module imports them; without them its parser is built without its flags)
EXTRAS: dict[str, str] = {"control": "control"}

DESCRIPTION = "The `xtoken` console script: one subcommand per module, imported only when used."

# Exit code after the reader of stdout went away (`xtoken queue stats | head`): 128 + SIGPIPE,
# what a shell reports for a program that SIGPIPE stopped.
EXIT_BROKEN_PIPE = 128 + 13


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xtoken")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def missing_message(command: str) -> str:
    """The one line of a subcommand whose packages are not installed: the extra and how to
    install it."""
    extra = EXTRAS.get(command)
    if extra is None:
        return f"xtoken {command}: not available in this build"
    return (
        f"xtoken {command}: the `{extra}` extra is not installed; install it with "
        f"`pip install -e '.[{extra}]'` in the xtoken clone (scripts/setup.sh installs it), "
        f"or `pip install 'xtoken[{extra}]'`"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``xtoken`` parser: global flags (accepted before or after the subcommand) and one
    subparser per :data:`SUBCOMMANDS` entry."""
    from services.common.flags import add_global_flags, subparsers

    parser = argparse.ArgumentParser(prog="xtoken", description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)",
    )
    parser.add_argument("--version", action="version", version=f"xtoken {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(_module=module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            sp.set_defaults(_missing=True)
            continue
        module.add_arguments(sp)
    add_global_flags(parser)
    for child in subparsers(parser):  # a flag has one spelling: no prefix of it stands for it
        child.allow_abbrev = False
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (None: the command line) and run its subcommand; returns the exit code."""
    from services.common.config import moved_flag

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "_missing", False):  # before its flags, which its parser does not know
        print(missing_message(args.command), file=sys.stderr)
        return 2
    if unknown:  # a flag of a moved key is named with its new flag; any other as argparse does
        moved = moved_flag(args, unknown)
        if moved is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(moved, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(message)s",
    )
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here rather than at interpreter exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader has what it wanted: no traceback, and no second error when Python
        # flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
