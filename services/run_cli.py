"""`xtoken run CONFIG.yaml`: a whole distillation run as local subprocesses (services/run.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG`` and overrides."""
    parser.add_argument("config", help="run config (YAML or JSON); see examples/demo.yaml")
    parser.add_argument("--run-dir", default=None, help="override run_dir of the config")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def execute(config, *, progress: bool = True) -> int:
    """Run ``config`` (a RunConfig), print the held-out table; returns the exit code."""
    from services.run import Run, install_stop, report

    run = Run(config, progress=progress)
    install_stop(run)
    try:
        code = run.run()
    except ValueError as e:
        print(f"xtoken run: {e}", file=sys.stderr)
        return 2
    if code != 0:
        print(f"xtoken run: {run.failure or 'failed'}", file=sys.stderr)
        return code
    table = report(run.run_dir)
    print(format_report(table, run.run_dir))
    return 0


def format_report(table: dict, run_dir) -> str:
    """The held-out bits/byte table of a run."""
    rows = [
        ("teacher", table.get("teacher")),
        ("student before", table.get("student_before")),
        ("student after", table.get("student_after")),
    ]
    lines = [f"held-out bits/byte (run {run_dir}, {table.get('steps')} steps)"]
    for name, value in rows:
        lines.append(f"  {name:<16} {'-' if value is None else f'{value:.4f}'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the config and execute the run."""
    from services.common.config import ConfigError
    from services.run import load_run_config

    try:
        config = load_run_config(args.config)
        if args.run_dir:
            config.run_dir = args.run_dir
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"xtoken run: {e}", file=sys.stderr)
        return 2
    logger.info("[run] %s", json.dumps({"run_dir": config.run_dir}))
    return execute(config, progress=not args.no_progress)
