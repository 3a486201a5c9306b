"""`xtoken collator`: collate a text corpus into a transfer queue with N worker processes.

The flags are generated from ``RunConfig`` (services/collator/config.py), ``--config FILE`` reads
the same settings from JSON/YAML (the worker's under ``worker``). Exit codes (the process
lifecycle, services/common/lifecycle.py): 0 at the end of the data or after SIGTERM/SIGINT once
the in-flight puts are done; 2 for bad settings; 1 when the run fails (queue unreachable, a bad
corpus line, a worker error), with the reason as ``[collator] error: ...``.
"""

from __future__ import annotations

import argparse
import json
import logging

from services.common import config as cfg

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the collator options (one per ``RunConfig`` field) to ``parser``."""
    from services.collator.config import RunConfig

    cfg.add_arguments(parser, RunConfig)
    parser.add_argument(
        "--summary-json", default=None, help="also write the run summary to this JSON file"
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help='once the queue answered, write {"pid", "name": "collator", "queue", "partition"} '
        "JSON to this file",
    )


def run(args: argparse.Namespace) -> int:
    """Run the collator under the process lifecycle; returns the exit code."""
    from services.common.lifecycle import Lifecycle, run_process

    def main(lifecycle: Lifecycle) -> int:
        from services.collator.config import RunConfig
        from services.collator.runner import CollatorRun, QueueUnreachableError
        from services.queue.errors import QueueError

        config = cfg.from_args(RunConfig, args)  # ConfigError: exit code 2
        job = CollatorRun(config, stop=lifecycle.stop)
        ready = {"queue": config.worker.queue, "partition": config.worker.partition}
        try:
            summary = job.run(on_ready=lambda: lifecycle.ready(**ready))
        except (QueueUnreachableError, QueueError, ValueError, OSError, RuntimeError) as e:
            # the run failed (not its settings): exit code 1, the reason without a traceback
            logger.error("[collator] error: %s", e)
            return 1
        print(f"[collator] {summary.line()}", flush=True)
        if args.summary_json:
            _write_summary(args.summary_json, summary)
        return 0

    return run_process(
        "collator", main, ready_file=args.ready_file, log_level=getattr(args, "log_level", "INFO")
    )


def _write_summary(path: str, summary: object) -> None:
    keys = (
        "read",
        "skipped",
        "samples",
        "written",
        "nbytes",
        "elapsed_s",
        "samples_per_s",
        "bytes_per_s",
        "stopped",
        "worker_ready_s",
        "steady_samples_per_s",
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump({k: getattr(summary, k) for k in keys}, f)
