"""Flag conventions: deprecated spellings (hidden, one warning line), internal flags, global flags
after a subcommand."""

from __future__ import annotations

import argparse

import pytest

from services.common.flags import INTERNAL, add_deprecated_alias, add_global_flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--lease-s", type=float, default=60.0, help="lease seconds")
    add_deprecated_alias(parser, "--lease", "--lease-s")
    parser.add_argument("--ready-file", default=None, help=INTERNAL)
    return parser


def test_a_deprecated_spelling_sets_the_new_flag_and_prints_one_line(capsys):
    args = _parser().parse_args(["--lease", "5"])
    assert args.lease_s == 5.0
    err = capsys.readouterr().err
    assert err == "tool: --lease is deprecated and will be removed; use --lease-s\n"


def test_the_new_spelling_prints_nothing_and_the_default_stands(capsys):
    assert _parser().parse_args(["--lease-s", "7"]).lease_s == 7.0
    assert _parser().parse_args([]).lease_s == 60.0
    assert capsys.readouterr().err == ""


def test_deprecated_and_internal_flags_are_left_out_of_help():
    text = _parser().format_help()
    assert "--lease-s" in text
    assert "--lease " not in text and "--ready-file" not in text


def test_an_internal_flag_is_still_accepted():
    assert _parser().parse_args(["--ready-file", "r.json"]).ready_file == "r.json"


def test_aliasing_a_flag_the_parser_lacks_is_refused():
    with pytest.raises(ValueError, match="has no flag --lease-ms"):
        add_deprecated_alias(argparse.ArgumentParser(), "--lease", "--lease-ms")


def test_global_flags_are_accepted_after_nested_subcommands():
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command")
    queue = sub.add_parser("queue")
    queue.add_subparsers(dest="action").add_parser("serve")
    add_global_flags(parser)
    assert parser.parse_args(["queue", "serve"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "DEBUG", "queue", "serve"]).log_level == "DEBUG"
    assert parser.parse_args(["queue", "serve", "--log-level", "ERROR"]).log_level == "ERROR"
    assert parser.parse_args(["queue", "--log-level", "WARNING", "serve"]).log_level == "WARNING"
