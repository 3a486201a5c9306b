"""`xtoken demo`: the embedded default: SmolLM2-135M teaches a tiny Qwen3-tokenizer student on CPU.

A real distillation run through queue, collator, teacher and trainer processes (``xtoken run`` with
the config below): the demo corpus (Python's own sources and docs), P-KL loss over an exact
byte alignment, the teacher's logits over a /dev/shm ring. It ends with the held-out bits/byte of
the teacher and of the student before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

DEMO_CONFIG = {
    "run_dir": "runs/demo",
    "student_tokenizer": "qwen3",
    "teacher_tokenizer": "smollm2",
    "ctx_student": 128,
    "ctx_teacher": 128,
    "data": {"limit": 240},
    "collator": {"workers": 1, "batch": 16},
    "teacher": {
        "model": "smollm2",
        "transport": "shm",
        "max_batch": 4,
        "max_length": 128,
        "slots": 2,
    },
    "trainer": {
        "student": "tiny",
        "micro_batch": 4,
        "grad_accum": 1,
        "max_steps": 40,
        "checkpoint_every": 20,
        "eval_every": 0,
        "eval_texts": 6,
        "eval_ctx": 256,
        "optim": {"lr": 3e-3, "warmup_steps": 4, "weight_decay": 0.0},
        "loss": {"mode": "pkl", "vocab_topk": 4096},
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the demo run."""
    from services.common.overrides import parse_override

    parser.add_argument("--run-dir", default=None, help="run directory (default runs/demo)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40)")
    parser.add_argument("--mode", default=None, help="loss mode: pkl, gold, xtoken, ce")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=parse_override,
        metavar="KEY=VALUE",
        help="override one setting of the demo's run config (repeatable; as xtoken run --set), "
        "e.g. --set trainer.optim.lr=1e-3",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (or progress lines)"
    )


def demo_config(args: argparse.Namespace | None = None):
    """The demo's RunConfig (with the options applied)."""
    import copy

    from services.common.overrides import apply_overrides
    from services.run import run_config_from_dict

    data = copy.deepcopy(DEMO_CONFIG)
    if args is not None:
        if args.run_dir:
            data["run_dir"] = args.run_dir
        if args.steps:
            data["trainer"]["max_steps"] = args.steps
        if args.mode:
            data["trainer"]["loss"]["mode"] = args.mode
        data = apply_overrides(data, getattr(args, "overrides", ()))
    return run_config_from_dict(data)


#: glibc malloc settings of the demo's processes (inherited): large blocks from the heap, which
#: is never trimmed, so that a freed [B, T, V] tensor's pages are reused by the next one
CPU_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"

# written into every run directory the demo makes: only such a directory is the demo's to clear
MARKER = ".xtoken-demo"


def fresh_run_dir(path: str | os.PathLike) -> Path:
    """Empty the demo's run directory for a fresh start, never deleting what the demo did not make.

    A missing or empty directory is made the demo's (the marker is written into it); a directory
    holding the marker is the demo's own, and its contents are cleared; any other non-empty
    directory, or a path that is a file, is refused.

    Args:
        path: the run directory.

    Returns:
        The directory, empty but for the marker.

    Raises:
        ValueError: the path holds files the demo did not make (names the fix).
    """
    run_dir = Path(path)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {str(path)!r} is a file; name a new or empty directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).is_file():
            raise ValueError(
                f"--run-dir {str(path)!r} is not empty and was not made by the demo, which clears "
                "its run directory at every start; name a new or empty directory"
            )
        for entry in run_dir.iterdir():
            if entry.name == MARKER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("made by `xtoken demo`: cleared at its next start\n")
    return run_dir


def run(args: argparse.Namespace) -> int:
    """Run the demo distillation and print the held-out table."""
    import sys

    from services.common.config import ConfigError
    from services.run_cli import execute

    # glibc returns every freed block above 32 MiB to the kernel, so each [B, T, V] tensor of a
    # CPU step costs fresh page faults: the demo's processes keep their freed memory instead
    os.environ.setdefault("GLIBC_TUNABLES", CPU_MALLOC)
    try:
        config = demo_config(args)
        fresh_run_dir(config.run_dir)  # the demo always starts fresh
    except (ConfigError, ValueError) as e:
        print(f"xtoken demo: {e}", file=sys.stderr)
        return 2
    return execute(config, progress=not args.no_progress)
