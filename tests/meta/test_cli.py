"""The `xtoken` console script: every subcommand is wired and documents itself."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from services import cli


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
