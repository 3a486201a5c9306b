"""Environment switches: one module reads them all, each when asked."""

import ast
import pathlib

from xtoken_core import envs

CORE = pathlib.Path(__file__).resolve().parents[2] / "xtoken_core"


def test_only_envs_reads_the_environment():
    readers = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name == "envs.py" and path.parent == CORE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{path.relative_to(CORE.parent)}:{node.lineno}")
    assert not readers, "read the environment through xtoken_core.envs:\n" + "\n".join(readers)


def test_switches_are_read_when_asked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not envs.triton_interpret()
    monkeypatch.setenv("XTOKEN_CACHE", "  ")
    assert envs.xtoken_cache() is None
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert envs.tokenizers_parallelism_off()
