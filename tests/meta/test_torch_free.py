"""No command imports torch or Triton to parse its flags or to validate a run config (STYLE.md:
configs import nothing heavy; the CLI answers --help at once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton")
CONFIG_MODULES = (
    "services.queue.config",
    "services.collator.config",
    "services.teacher.config",
    "services.trainer.config",
    "services.trainer.sections",
    "services.rollout.config",
    "services.supervise.config",
    "services.common.context",
    "xtoken_core.losses.config",
)

# Run in a fresh interpreter: a witness on the import system notes the import chain that first
# asks for each heavy package, so that a failure names the line to make lazy.
_WITNESS = """
import importlib, json, sys, traceback

chains = {}


class Witness:
    def find_spec(self, name, path=None, target=None):
        if name in %(heavy)r and name not in chains:
            chains[name] = [
                f"{f.filename.removeprefix(%(root)r)}:{f.lineno}: {f.line}"
                for f in traceback.extract_stack()[:-1]
                if "importlib" not in f.filename
            ]


sys.meta_path.insert(0, Witness())
"""

STEPS = {
    "the parser of every subcommand": (
        "from services import cli\n"
        "parser = cli.build_parser()\n"
        "missing = [n for n, (m, _) in cli.SUBCOMMANDS.items() if m not in sys.modules]\n"
        "assert not missing, f'subcommands not built: {missing}'\n"
    ),
    "every config module": "".join(f"importlib.import_module({m!r})\n" for m in CONFIG_MODULES),
    "the default run config and examples/tiny.yaml": (
        "from services.supervise.config import load_run_config, run_config_from_dict\n"
        "run_config_from_dict({})\n"
        f"load_run_config({str(ROOT / 'examples' / 'tiny.yaml')!r})\n"
    ),
}


def _imported_heavy(code: str) -> dict[str, list[str]]:
    """Run ``code`` in a fresh interpreter; the heavy packages it imported -> their chains."""
    script = (
        _WITNESS % {"heavy": HEAVY, "root": f"{ROOT}/"}
        + code
        + f"print(json.dumps({{m: chains.get(m, []) for m in {HEAVY!r} if m in sys.modules}}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("step", list(STEPS))
def test_imports_neither_torch_nor_triton(step):
    heavy = _imported_heavy(STEPS[step])
    assert not heavy, f"{step} imports {sorted(heavy)}; first asked for by:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(chain) for name, chain in heavy.items()
    )
