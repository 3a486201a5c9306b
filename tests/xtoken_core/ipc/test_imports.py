"""The ipc package never imports the wire package (the wire's shm codec imports ipc): both take
the jagged column and the dtype table from xtoken_core.jagged."""

import ast
import pathlib

IPC = pathlib.Path(__file__).resolve().parents[3] / "xtoken_core" / "ipc"


def test_ipc_does_not_import_the_wire():
    offenders = []
    for path in sorted(IPC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("xtoken_core.wire")]
    assert not offenders, offenders
