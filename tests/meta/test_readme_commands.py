"""Every command the README shows works after its install (``./scripts/demo.sh``): the ``--help``
of every ``xtoken`` command it names, each command line parsed by the console script's parser,
``xtoken run EXAMPLE --check`` of every example in a fresh directory, the run configs it prints,
the control example's run directory, the library's imports, and the tokenizers it uses shipped
by that install; and its lines wrap at 100 characters. A README command that breaks fails here,
not for a newcomer."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from services import cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_SPAN = re.compile(r"`(xtoken [^`]+)`")
_TOKENIZER_FLAGS = ("--student", "--teacher", "--tokenizer")


def _blocks(lang: str) -> list[str]:
    """The README's code blocks fenced as ``lang``."""
    return [body for fence, body in _FENCE.findall(README.read_text()) if fence == lang]


def _shell_words(block: str) -> list[list[str]]:
    """The command lines of a shell block as words (continuations joined, comments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # RANK=0 WORLD_SIZE=1 xtoken ...
            words = words[1:]
        if words:
            out.append(words)
    return out


@cache
def _xtoken_commands() -> tuple[tuple[str, ...], ...]:
    """The ``xtoken`` argument lists of the README: its shell blocks' and its prose's."""
    found: list[tuple[str, ...]] = []
    for block in _blocks("bash"):
        found += [tuple(w[1:]) for w in _shell_words(block) if w[0] == "xtoken"]
    prose = _FENCE.sub("", README.read_text())
    found += [tuple(shlex.split(span)[1:]) for span in _SPAN.findall(prose)]
    return tuple(dict.fromkeys(found))


def _subcommand_path(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The subcommands that open ``argv`` (``("queue", "serve")``), walked down the parser."""
    parser, path = cli.build_parser(), []
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return tuple(path)


def _xtoken() -> list[str]:
    """The console script the install put beside this interpreter (else the module form)."""
    script = Path(sys.executable).with_name("xtoken")
    return [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]


@pytest.fixture
def clone(tmp_path) -> Path:
    """A directory holding the repository's examples, as a fresh clone's root would."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return tmp_path


def test_the_readme_shows_xtoken_commands_and_its_complete_cpu_example():
    commands = _xtoken_commands()
    assert ("run", "examples/tiny.yaml") in commands
    assert len({_subcommand_path(c) for c in commands}) >= 10


@pytest.mark.parametrize(
    "path",
    sorted({_subcommand_path(c) for c in _xtoken_commands()}),
    ids=lambda p: " ".join(p),
)
def test_the_help_of_every_readme_command_works(path, clone):
    proc = subprocess.run(
        [*_xtoken(), *path, "--help"], cwd=clone, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: xtoken " + " ".join(path)), proc.stdout[:200]


@pytest.mark.parametrize(
    "argv",
    [c for c in _xtoken_commands() if "--help" not in c and len(c) > len(_subcommand_path(c))],
    ids=" ".join,
)
def test_every_readme_command_line_parses(argv, capsys):
    try:
        args, unknown = cli.build_parser().parse_known_args(list(argv))
    except SystemExit as exc:
        pytest.fail(f"xtoken {' '.join(argv)}: exit {exc.code}: {capsys.readouterr().err}")
    assert not unknown, f"xtoken {' '.join(argv)}: unknown arguments {unknown}"
    assert not getattr(args, "_missing", False), cli.missing_message(argv[0])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_its_check_in_a_fresh_directory(example, clone):
    proc = subprocess.run(
        [*_xtoken(), "run", f"examples/{example.name}", "--check"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        proc.stdout == f"xtoken run: examples/{example.name}: the config and its corpora are good\n"
    )


def test_the_readme_run_configs_and_their_overrides_are_valid(tmp_path):
    from services.common.overrides import parse_override
    from services.supervise.config import load_run_config, run_config_from_dict

    configs = [yaml.safe_load(block) for block in _blocks("yaml")]
    assert configs, "the README shows no run config"
    for config in configs:
        run_config_from_dict(config)
    (tmp_path / "my_run.yaml").write_text(_blocks("yaml")[0])
    runs = [c for c in _xtoken_commands() if c[:2] == ("run", "my_run.yaml")]
    assert runs, "the README runs no my_run.yaml"
    for argv in runs:
        sets = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
        load_run_config(tmp_path / "my_run.yaml", [parse_override(s) for s in sets])


def test_the_control_example_lands_in_the_run_directory_it_names(clone):
    from services.control.paths import confine

    (block,) = [b for b in _blocks("bash") if "control serve" in b]
    serve = next(w for w in _shell_words(block) if w[:3] == ["xtoken", "control", "serve"])
    runs_root = clone / serve[serve.index("--runs-root") + 1]
    line = next(line for line in block.splitlines() if "sed " in line)
    said = re.search(r"# lands in (\S+)", line).group(1)
    submitted = subprocess.run(
        ["bash", "-c", re.search(r"\$\((sed '[^']*' \S+)", line).group(1)],
        cwd=clone,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    raw = yaml.safe_load(submitted)
    config = confine(raw, run_dir=raw["run_dir"], runs_root=runs_root, data_roots=[clone])
    assert Path(config["run_dir"]) == (clone / said).resolve()


def test_the_readme_library_example_imports():
    (block,) = _blocks("python")
    imports = "\n".join(
        line for line in block.splitlines() if line.startswith(("from ", "import "))
    )
    assert imports
    exec(compile(imports, "README.md", "exec"), {})  # noqa: S102 (the README's own lines)


def test_the_readme_scripts_exist_and_parse():
    scripts = {w[0] for b in _blocks("bash") for w in _shell_words(b) if w[0].startswith("./")}
    assert scripts >= {"./scripts/demo.sh", "./scripts/test.sh"}
    for script in scripts:
        path = ROOT / script
        assert path.is_file() and path.stat().st_mode & 0o111, f"{script} is not executable"
        subprocess.run(["bash", "-n", str(path)], check=True)


@cache
def _demo_install_tokenizers() -> frozenset[str]:
    """The built-in tokenizers whose package the demo's install brings: xtoken's dependencies
    and what ``scripts/setup.sh`` installs for every profile (its lines not behind
    ``[ "$profile" = test ]``)."""
    from xtoken_core.tokenizers.registry import BUNDLED

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    packages = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines():
        if not line.lstrip().startswith("#") and '"$profile" = test' not in line:
            packages.update(re.findall(r'"([A-Za-z0-9][\w.-]*)==', line))
    return frozenset(name for name, b in BUNDLED.items() if b.pip_name in packages)


def test_the_readme_names_the_tokenizers_its_install_ships():
    said = re.search(r"The demo's install ships (.*?) \(", README.read_text(), re.DOTALL)
    assert said, "the README does not say which tokenizers its install ships"
    assert set(re.findall(r"`(\w+)`", said.group(1))) == _demo_install_tokenizers()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_uses_tokenizers_the_install_ships(example):
    from services.supervise.config import load_run_config

    config = load_run_config(example)
    names = {config.student_tokenizer, config.teacher_tokenizer}
    names |= {t.tokenizer for t in config.extra_teachers}
    missing = names - _demo_install_tokenizers()
    assert not missing, f"{example.name} needs {sorted(missing)}, which the demo's install lacks"


def test_readme_commands_and_collate_stats_defaults_use_tokenizers_the_install_ships():
    used = {
        argv[i + 1]
        for argv in _xtoken_commands()
        for i, word in enumerate(argv[:-1])
        if word in _TOKENIZER_FLAGS and not argv[i + 1].isupper()
    }
    parser = next(p for p in _subparsers() if p.prog == "xtoken collate-stats")
    used |= {parser.get_default("student"), parser.get_default("teacher")}
    assert used and used <= _demo_install_tokenizers(), sorted(used)


def _subparsers() -> list[argparse.ArgumentParser]:
    from services.common.flags import subparsers

    return list(subparsers(cli.build_parser()))


def test_the_readme_wraps_at_100_characters():
    """Tables aside (a Markdown row is one line)."""
    long = [
        f"README.md:{i}: {len(line)} characters"
        for i, line in enumerate(README.read_text().splitlines(), 1)
        if len(line) > 100 and not line.startswith("|")
    ]
    assert not long, "\n".join(long)
