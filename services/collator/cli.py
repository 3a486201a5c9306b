"""`xtoken collator`: collate a text corpus into a transfer queue with N worker processes."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the collator options to ``parser``."""
    parser.add_argument("--queue", required=True, help="queue endpoint, e.g. tcp://host:5555")
    parser.add_argument("--data", required=True, help="corpus file: .jsonl, .txt or .parquet")
    parser.add_argument("--student", required=True, help="student tokenizer name or path")
    parser.add_argument("--teacher", required=True, help="teacher tokenizer name or path")
    parser.add_argument("--partition", default="train", help="queue partition (default train)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--ctx-student", type=int, default=2048, help="student tokens per text")
    parser.add_argument("--ctx-teacher", type=int, default=2048, help="teacher tokens per text")
    parser.add_argument("--batch", type=int, default=64, help="texts per put (default 64)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N texts")
    parser.add_argument(
        "--text-field", default="text", help="JSON field / parquet column holding the text"
    )
    parser.add_argument(
        "--txt-split",
        choices=("blank_line", "line"),
        default="blank_line",
        help=".txt files: documents separated by blank lines, or one per line",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a reply from the queue (default 10)",
    )
    parser.add_argument(
        "--put-timeout",
        type=float,
        default=300.0,
        help="seconds a put may wait for queue capacity (default 300)",
    )
    parser.add_argument(
        "--log-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument(
        "--no-skip-queued",
        action="store_true",
        help="do not ask the queue which keys it holds (re-put everything; still idempotent)",
    )
    parser.add_argument(
        "--summary-json", default=None, help="also write the run summary to this JSON file"
    )


def run(args: argparse.Namespace) -> int:
    """Run the collator; returns 0 on end of data or SIGTERM, 1 on an error."""
    from services.collator.runner import CollatorRun, QueueUnreachableError, RunConfig
    from services.collator.worker import WorkerConfig
    from services.queue.errors import QueueError

    try:
        config = RunConfig(
            data=args.data,
            worker=WorkerConfig(
                queue=args.queue,
                partition=args.partition,
                student=args.student,
                teacher=args.teacher,
                ctx_student=args.ctx_student,
                ctx_teacher=args.ctx_teacher,
                queue_timeout_s=args.queue_timeout,
                put_timeout_s=args.put_timeout,
            ),
            workers=args.workers,
            batch=args.batch,
            limit=args.limit,
            text_field=args.text_field,
            txt_split=args.txt_split,
            log_every_s=args.log_every,
            skip_queued=not args.no_skip_queued,
        )
    except ValueError as e:
        print(f"xtoken collator: {e}", file=sys.stderr)
        return 2
    job = CollatorRun(config)

    def _on_signal(signum: int, frame: object) -> None:
        logger.info("[collator] %s: finishing in-flight puts", signal.Signals(signum).name)
        job.request_stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        summary = job.run()
    except (QueueUnreachableError, QueueError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"xtoken collator: {e}", file=sys.stderr)
        return 1
    print(f"[collator] {summary.line()}", flush=True)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "read": summary.read,
                    "skipped": summary.skipped,
                    "samples": summary.samples,
                    "written": summary.written,
                    "nbytes": summary.nbytes,
                    "elapsed_s": summary.elapsed_s,
                    "samples_per_s": summary.samples_per_s,
                    "bytes_per_s": summary.bytes_per_s,
                    "stopped": summary.stopped,
                    "worker_ready_s": summary.worker_ready_s,
                    "steady_samples_per_s": summary.steady_samples_per_s,
                },
                f,
            )
    return 0
