"""`xtoken run CONFIG.yaml`: a whole distillation run as local subprocesses or Ray actors
(the run engine services/supervise, the launchers services/launch)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


EPILOG = """\
examples:
  xtoken run examples/tiny.yaml
  xtoken run examples/tiny.yaml --check
  xtoken run examples/tiny.yaml --set trainer.schedule.max_steps=20 --set trainer.optim.lr=1e-3
  xtoken run examples/tiny.yaml --set data.train=corpus.jsonl --set data.limit=null --fresh
  xtoken run examples/tiny.yaml --launcher ray --ray-address auto

--set KEY=VALUE takes a dotted key of the run config and a YAML value (a number, a word,
null, a list [1, 2]); it is applied to the file's settings before they are checked, so a bad
key or value is refused as it would be in the file (exit code 2). A later --set wins.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG`` and overrides."""
    from services.common.flags import add_set_flag

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "config", help="run config (YAML or JSON); a complete CPU example: examples/tiny.yaml"
    )
    add_set_flag(
        parser,
        "override one setting of the config (repeatable), e.g. --set trainer.optim.lr=1e-4",
    )
    parser.add_argument("--run-dir", default=None, help="override run_dir of the config")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config and its corpora, then exit without starting anything (0: the "
        "run would start; 2: bad settings; 3: bad data)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (or progress lines)"
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="train on from the run directory's checkpoint even though it was made by another "
        "config (by default only the same config resumes)",
    )
    start.add_argument(
        "--fresh",
        action="store_true",
        help="start over: the run directory, if it holds a checkpoint, is moved aside first",
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default=None,
        help="how the processes start: local subprocesses (default), or ray: Ray actors in "
        "placement groups on a running cluster (--ray-address)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster HOST:PORT (its head's `ray start --head --port PORT`), or auto for the "
        "cluster on this machine; default: env RAY_ADDRESS; implies --launcher ray",
    )


def execute(config, *, progress: bool = True, launcher=None, show_report: bool = True) -> int:
    """Run ``config`` (a RunConfig) with ``launcher`` (None: local subprocesses), print the
    held-out table (unless ``show_report`` is False); returns the exit code."""
    from services.supervise.driver import Driver
    from xtoken_core.errors import EXIT_DATA, EXIT_SETTINGS, DataError

    run = Driver(config, launcher=launcher, progress=progress)
    install_stop(run)
    try:
        code = run.run()
    except ValueError as e:
        print(f"xtoken run: {e}", file=sys.stderr)
        return EXIT_DATA if isinstance(e, DataError) else EXIT_SETTINGS
    finally:
        if hasattr(launcher, "close"):
            launcher.close()  # Ray: actors and placement groups back to the cluster
    if code != 0:
        print(f"xtoken run: {run.failure or 'failed'}", file=sys.stderr)
        return code
    if show_report:
        teachers = len(config.teacher_list())
        print(format_report(report(run.run_dir), run.run_dir, teachers=teachers))
    return 0


def format_report(table: dict, run_dir, teachers: int = 1) -> str:
    """The held-out bits/byte table of a run (``teachers``: the run's teachers; only teacher 0
    evaluates the held-out text, so a run of several names its row ``teacher 0``)."""
    rows = [
        ("teacher 0" if teachers > 1 else "teacher", table.get("teacher")),
        ("student before", table.get("student_before")),
        ("student after", table.get("student_after")),
    ]
    lines = [f"held-out bits/byte (run {run_dir}, {table.get('steps')} steps)"]
    for name, value in rows:
        lines.append(f"  {name:<16} {'-' if value is None else f'{value:.4f}'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the config and execute the run. A run refused (exit code 2: settings, 3: data) leaves
    no directory it created; its config and corpora are checked before anything heavy is imported or started."""
    from services.common.config import ConfigError
    from services.supervise.config import load_run_config
    from services.supervise.preflight import check_corpora
    from xtoken_core.errors import EXIT_DATA, EXIT_SETTINGS, DataError

    try:
        config = load_run_config(args.config, getattr(args, "overrides", ()))
        if args.run_dir:
            config.run_dir = args.run_dir
        check_corpora(config)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"xtoken run: {e}", file=sys.stderr)
        return EXIT_DATA if isinstance(e, DataError) else EXIT_SETTINGS
    if getattr(args, "check", False):
        print(f"xtoken run: {args.config}: the config and its corpora are good")
        return 0
    from services.supervise.resume import plan_start

    run_dir = Path(config.run_dir)
    existed = run_dir.exists()
    try:  # refuses before it writes anything
        start = plan_start(
            config, resume=getattr(args, "resume", False), fresh=getattr(args, "fresh", False)
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"xtoken run: {e}", file=sys.stderr)
        return 2
    code = _launch(args, config, start)
    if code in (2, 3) and (start.moved_to is not None or not existed):
        shutil.rmtree(run_dir, ignore_errors=True)  # refused: nothing it made stays behind
    return code


def _launch(args: argparse.Namespace, config: Any, start: Any) -> int:
    """Start the run as ``start`` (a :class:`~services.supervise.resume.StartPlan`) says: at
    once when it is complete, else with the chosen launcher; returns the exit code."""
    if start.message:
        print(f"xtoken run: {start.message}", file=sys.stderr)
    if start.action == "complete":
        return 0
    address = getattr(args, "ray_address", None) or os.environ.get("RAY_ADDRESS") or None
    kind = getattr(args, "launcher", None) or (
        "ray" if getattr(args, "ray_address", None) else "local"
    )
    launcher = None
    if kind == "ray":
        from services.launch import make_launcher

        try:
            launcher = make_launcher("ray", address)
        except ValueError as e:
            print(f"xtoken run: {e}", file=sys.stderr)
            return 2
    elif getattr(args, "ray_address", None):
        print(
            "xtoken run: --ray-address is only for --launcher ray; drop one of them",
            file=sys.stderr,
        )
        return 2
    logger.info("[run] %s", json.dumps({"run_dir": config.run_dir, "launcher": kind}))
    return execute(config, progress=not args.no_progress, launcher=launcher)


def report(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's held-out bits/byte: teacher (teacher 0, the one that evaluates the held-out
    text), student before and after (from its metrics)."""
    from services.common.metrics import read_jsonl

    run_dir = Path(run_dir)
    out: dict[str, Any] = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        summary = {}
    for tag in ("before", "after"):
        if f"student_{tag}" in summary:
            out[f"student_{tag}"] = summary[f"student_{tag}"]["bits_per_byte"]
    for path in sorted((run_dir / "metrics").glob("teacher.group*.jsonl")):
        for r in read_jsonl(path):
            if r.get("event") == "eval":
                out["teacher"] = r["bits_per_byte"]
    out["steps"] = summary.get("step")
    return out


def install_stop(run: Any) -> None:
    """SIGTERM / SIGINT on ``xtoken run``: checkpoint and stop cleanly (a second one: kill)."""

    def _stop(signum: int, frame: Any) -> None:
        if run.stop_requested.is_set():
            raise KeyboardInterrupt
        logger.info(
            "[run] %s: stopping the run (Ctrl-C again to kill)", signal.Signals(signum).name
        )
        run.stop_requested.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
