"""The `xtoken` console script: every subcommand is wired and documents itself."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from services.common.flags import subparsers


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_each_subcommand_module_exists_and_has_help(name):
    module_name = cli.SUBCOMMANDS[name][0]
    assert importlib.util.find_spec(module_name) is not None, f"{module_name} is missing"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", name, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2


def test_building_the_parser_does_not_import_network_stacks():
    code = (
        "import sys; from services import cli; cli.build_parser(); "
        "bad=[m for m in ('zmq','fastapi','uvicorn') if m in sys.modules]; print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"xtoken {version('xtoken')}"


def test_an_unknown_tokenizer_is_a_message_naming_the_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "collate-stats", "--student", "gpt2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--student" in proc.stderr and "gpt2" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- conventions

ROOT = Path(__file__).resolve().parents[2]
# a repository path in a help text: examples/tiny.yaml, docs/queue.md, scripts/demo.sh
_REPO_PATH = re.compile(r"\b(?:examples|docs|scripts|deploy|benchmarks|proto)/[\w./-]*\w")
INTERNAL_FLAGS = ("--ready-file", "--summary-json")
COLLATOR = ["collator", "--queue", "tcp://h:1", "--student", "a", "--teacher", "b"]


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = cli.build_parser()
    return [("xtoken", parser)] + [(p.prog, p) for p in subparsers(parser)]


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help()


def test_every_repository_path_named_in_a_help_text_exists():
    named = {}
    for prog, parser in _parsers():
        for path in _REPO_PATH.findall(_help(parser)):
            named.setdefault(path, prog)
    assert "examples/tiny.yaml" in named  # xtoken run's help points to an example config
    missing = {path: prog for path, prog in named.items() if not (ROOT / path).exists()}
    assert not missing, f"help texts name paths that do not exist: {missing}"


def test_internal_flags_are_hidden_from_help_but_accepted():
    parser = cli.build_parser()
    for prog, sub in _parsers():
        text = _help(sub)
        for flag in INTERNAL_FLAGS:
            assert flag not in text, f"{prog} --help shows the internal {flag}"
    cases = [
        ["collator", "--summary-json", "s.json", "--ready-file", "r"],
        ["teacher", "--ready-file", "r"],
        ["trainer", "--ready-file", "r"],
        ["queue", "serve", "--ready-file", "r"],
        ["control", "serve", "--ready-file", "r"],
    ]
    for argv in cases:
        assert parser.parse_args(argv).ready_file == "r", argv


def test_every_duration_flag_ends_in_s():
    seconds = re.compile(r"\bseconds?\b")
    duration_name = re.compile(r"timeout|lease|wait|interval|heartbeat|idle|backoff|after")
    checked, wrong = [], []
    for prog, parser in _parsers():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or not action.option_strings:
                continue
            flag = max(action.option_strings, key=len)
            if seconds.search(action.help or "") or duration_name.search(flag):
                checked.append(flag)
                if not flag.endswith("-s"):
                    wrong.append(f"{prog} {flag}")
    assert not wrong, f"duration flags without the -s suffix: {wrong}"
    durations = {"--lease-s", "--timeout-s", "--queue-timeout-s", "--feed.idle-timeout-s"}
    assert durations <= set(checked)


def test_a_generated_flag_has_one_spelling():
    """The flags generated from a config's fields are its keys, with no alias of an old name."""
    for prog, sub in _parsers():
        if not prog.endswith(("collator", "queue serve", "teacher", "trainer", "rollout")):
            continue
        hidden = [
            s
            for a in sub._actions
            if a.help == argparse.SUPPRESS and a.option_strings
            for s in a.option_strings
            if s not in INTERNAL_FLAGS
        ]
        assert not hidden, f"{prog} keeps hidden spellings {hidden}"


def test_global_flags_are_accepted_before_and_after_the_subcommand():
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "DEBUG", "demo"]).log_level == "DEBUG"
    assert parser.parse_args(["demo", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["queue", "serve", "--log-level", "ERROR"]).log_level == "ERROR"
    assert parser.parse_args(["control", "serve", "--log-level", "ERROR"]).log_level == "ERROR"


OPTIONS_FILE = Path(__file__).with_name("cli_options.json")


def test_every_command_line_option_stays_and_a_new_one_is_listed():
    """Frozen options: a flag users may have scripted is never dropped, unless its key moved (the
    old flag is then refused naming the new one, services.common.config.moved_flag); an added or
    renamed one goes into tests/meta/cli_options.json with its change."""
    now = {prog: {s for a in p._actions for s in a.option_strings} for prog, p in _parsers()}
    frozen = json.loads(OPTIONS_FILE.read_text())
    gone = {prog: sorted(set(opts) - now.get(prog, set())) for prog, opts in frozen.items()}
    assert not {prog: opts for prog, opts in gone.items() if opts}, "options removed"
    new = {prog: sorted(opts - set(frozen.get(prog, ()))) for prog, opts in now.items()}
    assert not {prog: opts for prog, opts in new.items() if opts}, f"list them in {OPTIONS_FILE}"


def test_the_flag_of_a_moved_key_is_refused_naming_its_new_flag(capsys):
    assert cli.main(["trainer", "--micro-batch", "4"]) == 2
    assert capsys.readouterr().err == "xtoken trainer: --micro-batch moved to --feed.micro-batch\n"
    with pytest.raises(SystemExit) as exc:  # any other unknown flag: argparse's own error
        cli.main(["trainer", "--micro-batchh", "4"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --micro-batchh 4" in capsys.readouterr().err


def test_control_without_its_extra_names_the_extra_and_its_install_line():
    """As on an install without FastAPI: the flags of `control serve` are not known then, and the
    line says what to install instead of calling them unrecognized."""
    blocked = ("fastapi", "uvicorn", "pydantic_settings", "starlette")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # import fails as when absent\n"
        "from services import cli\n"
        "sys.exit(cli.main(['control', 'serve', '--runs-root', 'runs', '--data-root', 'data']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "xtoken control: the `control` extra is not installed; install it with "
        "`pip install -e '.[control]'` in the xtoken clone (scripts/setup.sh installs it), or "
        "`pip install 'xtoken[control]'`\n"
    )
