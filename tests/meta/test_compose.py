"""docker-compose.yml: every service runs a command that the `xtoken` CLI accepts."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from services import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def _interpolate(value: str) -> str:
    """Apply compose's `${NAME:-default}` rule with an empty environment."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


def _services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_file_names_the_image_and_dockerfile():
    services = _services()
    assert "queue" in services and "collator" in services
    build = services["queue"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()


@pytest.mark.parametrize("name", sorted(_services()))
def test_each_service_command_parses_with_the_cli(name):
    command = [_interpolate(str(part)) for part in _services()[name]["command"]]
    args = cli.build_parser().parse_args(command)
    assert args.command == command[0]
    assert not getattr(args, "_missing", False)


def test_example_env_sets_only_variables_the_compose_file_uses():
    used = set(_VAR.findall((ROOT / "docker-compose.yml").read_text()))
    used_names = {name for name, _ in used}
    for line in (ROOT / "deploy" / "example.env").read_text().splitlines():
        if line and not line.startswith("#"):
            assert line.split("=", 1)[0] in used_names, line
