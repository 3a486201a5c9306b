"""`xtoken control serve` settings: a flag per setting, read like its environment variable, over
the environment, over ``--config FILE``."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import cli
from services.common.config import ConfigError
from services.common.flags import subparsers
from services.control.cli import settings_from_args
from services.control.settings import Settings


def _args(*argv: str):
    return cli.build_parser().parse_args(["control", "serve", *argv])


def test_every_setting_has_a_flag_named_after_it():
    serve = next(p for p in subparsers(cli.build_parser()) if p.prog == "xtoken control serve")
    flags = {s for action in serve._actions for s in action.option_strings}
    assert {f"--{name.replace('_', '-')}" for name in Settings.model_fields} <= flags


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
