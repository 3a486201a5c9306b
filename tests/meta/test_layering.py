"""Project rules written as tests: import direction, docstrings, CLI surface."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "xtoken_core"
FORBIDDEN_IN_CORE = ("zmq", "fastapi", "uvicorn", "ray", "services", "starlette")


def _python_files(package: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", _python_files(CORE), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_never_imports_services_or_network_stacks(path):
    bad = _imported_roots(path) & set(FORBIDDEN_IN_CORE)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: xtoken_core must stay pure"


@pytest.mark.parametrize(
    "path",
    _python_files(CORE) + _python_files(ROOT / "services"),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_module_has_a_docstring(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"


def _public_functions(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not node.name.startswith("_"):
                yield node


def test_every_public_function_and_class_in_core_has_a_docstring():
    missing = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in _python_files(CORE)
        for node in _public_functions(path)
        if not ast.get_docstring(node)
    ]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


# Files allowed to import the network and process-group stacks (STYLE.md: clients, servers,
# shells, launchers; the trainer's parallel module wraps DDP/FSDP2 and its checkpoint module
# saves with DCP, its precision module reduces bf16 gradients in fp32 under DDP; the losses'
# distributed module all-reduces the global counts; the teacher's tensor-parallel group and its
# model shards are DTensors over a process group).
NETWORK_ALLOWED = {
    "services/control/app.py",
    "services/control/cli.py",
    "services/control/deps.py",
    "services/control/docs.py",
    "services/control/routes/compare.py",
    "services/control/routes/runs.py",
    "services/control/routes/system.py",
    "services/launch/ray.py",
    "services/queue/cli.py",
    "services/queue/client.py",
    "services/queue/durable.py",
    "services/queue/gate.py",
    "services/queue/log_writer.py",
    "services/queue/server.py",
    "services/queue/transport.py",
    "services/teacher/shards.py",
    "services/teacher/tensor_parallel.py",
    "services/trainer/checkpoint.py",
    "services/trainer/main.py",
    "services/trainer/parallel.py",
    "services/trainer/precision.py",
    "xtoken_core/losses/distributed.py",
}
NETWORK_MODULES = ("zmq", "fastapi", "uvicorn", "ray", "torch.distributed", "torch.nn.parallel")


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_only_the_allowed_files_import_network_or_process_group_stacks():
    offenders = []
    for path in _python_files(CORE) + _python_files(ROOT / "services"):
        rel = str(path.relative_to(ROOT))
        hits = sorted(
            m
            for m in _imported_modules(path)
            if any(m == n or m.startswith(n + ".") for n in NETWORK_MODULES)
        )
        if hits and rel not in NETWORK_ALLOWED:
            offenders.append(f"{rel}: {hits}")
    assert not offenders, (
        "import network/process-group stacks outside the allow-list:\n" + "\n".join(offenders)
    )


# The run engine is a library: the control plane (HTTP, storage, dashboard) uses it, never the
# other way round (STYLE.md: nothing under the engine imports the HTTP package).
ENGINE = ROOT / "services" / "supervise"


@pytest.mark.parametrize("path", _python_files(ENGINE), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_run_engine_never_imports_the_control_plane(path):
    bad = sorted(
        m
        for m in _imported_modules(path)
        if m == "services.control" or m.startswith("services.control.")
    )
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {bad}: the engine must not use services/control"
    )


def _services_unit(module: str) -> str | None:
    """The package (or top-level module) of services/ that ``module`` belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else None


def _services_import_graph() -> dict[str, set[str]]:
    """services/ package -> the services/ packages its modules import (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in _python_files(ROOT / "services"):
        me = _services_unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if me is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "services":  # from services import control
                    names += [f"services.{alias.name}" for alias in node.names]
            for name in names:
                unit = _services_unit(name)
                if unit is not None and unit != me:
                    graph.setdefault(me, set()).add(unit)
    return graph


def test_the_services_packages_import_each_other_without_a_cycle():
    graph = _services_import_graph()
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            cycle = path[path.index(unit) :] + [unit]
            raise AssertionError("import cycle among services/ packages: " + " -> ".join(cycle))
        if unit in done:
            return
        for dep in sorted(graph.get(unit, ())):
            visit(dep, path + [unit])
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, [])


# Producers of samples build their puts with the codec (xtoken_core/data_plane/codec.py), never
# with each other's process code: a rollout worker runs without the collator's package.
ROLLOUT = ROOT / "services" / "rollout"


@pytest.mark.parametrize("path", _python_files(ROLLOUT), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_rollout_imports_nothing_from_the_collator(path):
    bad = sorted(
        m
        for m in _imported_modules(path)
        if m == "services.collator" or m.startswith("services.collator.")
    )
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad += [  # from services import collator
        f"services.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "services"
        for alias in node.names
        if alias.name == "collator"
    ]
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {bad}: build puts with "
        "xtoken_core.data_plane.codec (samples_to_columns), not the collator's code"
    )
