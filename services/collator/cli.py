"""`xtoken collator`: collate a text corpus into a transfer queue with N worker processes.

The flags are generated from ``CollatorConfig`` (services/collator/config.py), ``--config FILE``
reads the same settings from JSON/YAML (the corpus's under ``data``, the worker's under
``worker``). Exit codes: see ``EPILOG``
(also in ``--help`` and the README); a run that did not put the whole corpus never exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging

from services.common import config as cfg
from services.common.flags import INTERNAL

logger = logging.getLogger(__name__)

EXIT_DATA = 3
"""A data error: the corpus held no text (``--data`` empty or only blank lines), or a bad line
(without ``--skip-bad-lines``). Deterministic: a restart meets it again."""
EXIT_EMPTY = EXIT_DATA
EXIT_STOPPED = 4
"""Stopped by SIGTERM/SIGINT (or its parent's death) before the end of the data."""

EPILOG = f"""\
sample keys:
  <12 hex of the file's absolute path>/<file name>:<line>, e.g. 3f2a9c1b7d4e/data.jsonl:7:
  the same on every restart on the same file, so a rerun skips what the queue holds;
  with --key-root DIR: <path under DIR>:<line>, e.g. a/data.jsonl:7 (the same wherever
  the corpus is mounted).

exit codes:
  0  every text of the corpus is in the queue (put now or already queued) or was
     already consumed (retention dropped it: the put reply counts it as consumed)
  1  the run failed: queue unreachable, a worker error
  2  bad settings (the message names the flag)
  {EXIT_DATA}  a data error: the corpus holds no text, or a bad line (file:line named;
     --skip-bad-lines, data.skip_bad_lines in a run config, skips them)
  {EXIT_STOPPED}  stopped by SIGTERM/SIGINT after the in-flight puts; rerun to complete
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the collator options (one per ``CollatorConfig`` field) to ``parser``."""
    from services.collator.config import CollatorConfig

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    cfg.add_arguments(parser, CollatorConfig)
    # internal (hidden from --help): the run summary as JSON, and the ready handshake: once the
    # queue answered, {"pid", "name": "collator", "queue", "partition"} JSON in this file
    parser.add_argument("--summary-json", default=None, help=INTERNAL)
    parser.add_argument("--ready-file", default=None, help=INTERNAL)


def run(args: argparse.Namespace) -> int:
    """Run the collator under the process lifecycle; returns the exit code."""
    from services.common.lifecycle import Lifecycle, run_process

    def main(lifecycle: Lifecycle) -> int:
        from services.collator.config import CollatorConfig
        from services.collator.runner import CollatorRun, QueueUnreachableError
        from services.queue.errors import QueueError
        from xtoken_core.data.corpus import BadCorpusLine

        config = cfg.from_args(CollatorConfig, args)  # ConfigError: exit code 2
        job = CollatorRun(config, stop=lifecycle.stop)
        ready = {"queue": config.worker.queue, "partition": config.worker.partition}
        try:
            summary = job.run(on_ready=lambda: lifecycle.ready(**ready))
        except BadCorpusLine as e:
            # a data error, the same on every restart: the line and the key that skips it
            logger.error(
                "[collator] error: bad corpus line %s:%d: %s (in a run config: "
                "data.skip_bad_lines: true): exit code %d",
                e.path,
                e.line,
                e,
                EXIT_DATA,
            )
            return EXIT_DATA
        except (QueueUnreachableError, QueueError, ValueError, OSError, RuntimeError) as e:
            # the run failed (not its settings): exit code 1, the reason without a traceback
            logger.error("[collator] error: %s", e)
            return 1
        print(f"[collator] {summary.line()}", flush=True)
        if args.summary_json:
            _write_summary(args.summary_json, summary)
        if summary.stopped:
            logger.warning(
                "[collator] stopped before the end of %s: exit code %d (rerun to complete)",
                config.data.train,
                EXIT_STOPPED,
            )
            return EXIT_STOPPED
        if summary.read == 0:
            logger.error(
                "[collator] error: no text in --data %s (empty, or only blank lines): exit code %d",
                config.data.train,
                EXIT_EMPTY,
            )
            return EXIT_EMPTY
        return 0

    return run_process(
        "collator", main, ready_file=args.ready_file, log_level=getattr(args, "log_level", "INFO")
    )


def _write_summary(path: str, summary: object) -> None:
    keys = (
        "read",
        "skipped",
        "samples",
        "texts",
        "written",
        "consumed",
        "nbytes",
        "restarts",
        "replayed",
        "elapsed_s",
        "samples_per_s",
        "bytes_per_s",
        "stopped",
        "bad_lines",
        "worker_ready_s",
        "steady_samples_per_s",
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump({k: getattr(summary, k) for k in keys}, f)
