"""`xtoken control serve` settings: a flag per setting, read like its environment variable, over
the environment, over ``--config FILE``; the token from the environment or a file, never from
the command line (every local user can read a process's arguments)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# a machine without the control extra (a GPU image) skips these, naming the install line
pytest.importorskip("fastapi", reason="the control plane's extra: pip install -e '.[control]'")

from services import cli
from services.common.config import ConfigError
from services.common.flags import subparsers
from services.control.cli import settings_from_args
from services.control.settings import Settings


def _args(*argv: str):
    return cli.build_parser().parse_args(["control", "serve", *argv])


def _serve_parser():
    return next(p for p in subparsers(cli.build_parser()) if p.prog == "xtoken control serve")


def test_every_setting_but_the_token_has_a_flag_named_after_it():
    flags = {s for action in _serve_parser()._actions for s in action.option_strings}
    names = set(Settings.model_fields) - {"token"}
    assert {f"--{name.replace('_', '-')}" for name in names} <= flags
    assert "--token-file" in flags


def test_help_offers_no_token_flag():
    help_text = _serve_parser().format_help()
    assert "--token-file" in help_text
    assert re.search(r"--token(?!-file)", help_text) is None, help_text


@pytest.mark.parametrize("flag", [["--token", "s3cret-value"], ["--token=s3cret-value"]])
def test_a_token_on_the_command_line_is_refused_with_one_line_naming_the_variable_and_the_file(
    tmp_path, flag
):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "control", "serve", "--runs-root",
         str(tmp_path / "runs"), "--port", "0", *flag],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "XTOKEN_CONTROL_TOKEN" in lines[0] and "--token-file" in lines[0]
    assert "s3cret-value" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_the_token_is_read_from_a_token_file_by_flag_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("XTOKEN_CONTROL_TOKEN", raising=False)
    file = tmp_path / "token"
    file.write_text("  from-the-file\n")
    assert settings_from_args(_args("--token-file", str(file))).token == "from-the-file"
    monkeypatch.setenv("XTOKEN_CONTROL_TOKEN_FILE", str(file))
    assert settings_from_args(_args()).token == "from-the-file"


def test_the_token_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("XTOKEN_CONTROL_TOKEN_FILE", raising=False)
    monkeypatch.setenv("XTOKEN_CONTROL_TOKEN", "from-the-env")
    assert settings_from_args(_args()).token == "from-the-env"


@pytest.mark.parametrize(
    ("content", "pattern"),
    [(None, ": cannot read it"), ("\n  \n", " is empty")],
    ids=["missing", "empty"],
)
def test_a_token_file_that_gives_no_token_is_refused_naming_it(tmp_path, monkeypatch, content,
                                                               pattern):
    monkeypatch.delenv("XTOKEN_CONTROL_TOKEN", raising=False)
    file = tmp_path / "token"
    if content is not None:
        file.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"token_file={str(file)!r}{pattern}")):
        settings_from_args(_args("--token-file", str(file)))


def test_a_token_and_a_token_file_together_are_refused(tmp_path, monkeypatch):
    file = tmp_path / "token"
    file.write_text("one")
    monkeypatch.setenv("XTOKEN_CONTROL_TOKEN", "two")
    with pytest.raises(ValueError, match="XTOKEN_CONTROL_TOKEN and XTOKEN_CONTROL_TOKEN_FILE"):
        settings_from_args(_args("--token-file", str(file)))


def test_a_bad_token_file_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "control", "serve", "--runs-root",
         str(tmp_path / "runs"), "--port", "0", "--token-file", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("XTOKEN_CONTROL_")},
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--token-file" in proc.stderr and "nope" in proc.stderr


def test_the_config_file_is_under_the_environment_and_the_flags(tmp_path, monkeypatch):
    file = tmp_path / "control.yaml"
    file.write_text("port: 9000\ntick_s: 0.5\nruns_root: /from/file\ndata_root: a,b\n")
    monkeypatch.setenv("XTOKEN_CONTROL_TICK_S", "0.3")
    monkeypatch.setenv("XTOKEN_CONTROL_PORT", "9001")
    settings = settings_from_args(_args("--config", str(file), "--port", "9002"))
    assert (settings.port, settings.tick_s) == (9002, 0.3)
    assert settings.runs_root == Path("/from/file")
    assert settings.data_root == [Path("a"), Path("b")]


def test_an_unknown_key_of_the_config_file_is_named_with_a_close_match(tmp_path):
    file = tmp_path / "control.json"
    file.write_text('{"runs_rot": "/r"}')
    with pytest.raises(ConfigError, match=r"unknown key 'runs_rot'.*did you mean 'runs_root'\?"):
        settings_from_args(_args("--config", str(file)))
