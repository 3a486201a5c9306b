"""Flag conventions: internal flags, global flags after a subcommand, one spelling per flag."""

from __future__ import annotations

import argparse

import pytest

from services.common.flags import INTERNAL, add_global_flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--lease-s", type=float, default=60.0, help="lease seconds")
    parser.add_argument("--ready-file", default=None, help=INTERNAL)
    return parser


def test_a_flag_prints_nothing_and_the_default_stands(capsys):
    assert _parser().parse_args(["--lease-s", "7"]).lease_s == 7.0
    assert _parser().parse_args([]).lease_s == 60.0
    assert capsys.readouterr().err == ""


def test_internal_flags_are_left_out_of_help():
    text = _parser().format_help()
    assert "--lease-s" in text
    assert "--ready-file" not in text


def test_an_internal_flag_is_still_accepted():
    assert _parser().parse_args(["--ready-file", "r.json"]).ready_file == "r.json"


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


@pytest.mark.parametrize(
    "argv",
    [
        ["queue", "serve", "--lease", "5"],
        ["queue", "stats", "--queue", "tcp://127.0.0.1:1", "--timeout", "3"],
        ["trainer", "--micro", "2"],
    ],
)
def test_an_old_or_shortened_spelling_of_a_flag_is_refused(argv, capsys):
    from services.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
