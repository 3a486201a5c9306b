"""`xtoken cache`: build a teacher cache from a run config, print what a cache holds, verify it.

Exit codes: 0 done; 1 a fault (a full disk: what was written stays, run the build again);
2 bad settings (a folder that holds something else, a cache of another teacher); 3 bad data (a
damaged shard, named with its path and byte offset).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build``, ``info`` and ``verify`` sub-subcommands.

    Args:
        parser: the ``cache`` subparser.
    """
    from services.common.flags import add_set_flag

    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    build = sub.add_parser(
        "build",
        help="run a run config's teacher once over its corpus and write the top-K targets",
    )
    build.add_argument("config", help="run config (YAML or JSON): its data and teacher sections")
    build.add_argument("--out", required=True, help="the cache folder (new, empty, or a cache)")
    add_set_flag(build, "override one setting of the config (repeatable), as xtoken run does")
    build.add_argument(
        "--shard",
        default="0/1",
        help="I/N: write only the texts whose key hashes to shard I of N, so that N builders "
        "(one per GPU or machine) share the corpus in one folder (default 0/1: all)",
    )
    build.add_argument(
        "--teacher",
        type=int,
        default=0,
        help="which teacher of the config: 0 the teacher section, J the J-th entry of "
        "extra_teachers (default 0)",
    )
    build.add_argument(
        "--top-k", type=int, default=None, help="ids kept per position (default: teacher.top_k)"
    )
    build.add_argument(
        "--ids",
        choices=("delta", "plain"),
        default="delta",
        help="how the ids are stored: sorted and delta-coded per position (default), or as sent",
    )
    build.add_argument(
        "--logprobs",
        choices=("u8", "u4", "bf16", "fp32"),
        default="u8",
        help="how the log-probs are stored: u8 steps below each position's top-1 (default), "
        "u4 (15 steps, two a byte; ~4x the u8 gradient error), bf16, or fp32 (exact)",
    )
    build.add_argument(
        "--scalars",
        choices=("fp32", "fp16"),
        default="fp32",
        help="how each position's top-1, step, rest mass and log-partition are stored: fp32 "
        "(default) or fp16 (7 fewer bytes a token, no measurable error)",
    )
    build.add_argument("--device", default=None, help="teacher device (default: teacher.device)")
    build.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="padded teacher tokens per forward (default: teacher.max_batch x ctx_teacher)",
    )
    build.add_argument(
        "--shard-mb",
        type=float,
        default=256.0,
        help="MiB of encoded targets per shard file before compression (default 256)",
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    info = sub.add_parser("info", help="print what a teacher cache holds")
    info.add_argument("dir", help="the cache folder")
    info.add_argument("--json", action="store_true", help="print the manifest's summary as JSON")
    verify = sub.add_parser(
        "verify",
        help="check every shard: readable, checksums and counts as the manifest says (exit 3 "
        "naming a damaged shard's path and byte offset)",
    )
    verify.add_argument("dir", help="the cache folder")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action; returns the exit code."""
    action = getattr(args, "cache_command", None)
    if action == "build":
        return _build(args)
    if action == "info":
        return _info(args)
    if action == "verify":
        return _verify(args)
    print("xtoken cache: give an action: build, info or verify", file=sys.stderr)
    return 2


def _build(args: argparse.Namespace) -> int:
    import signal

    from services.common.config import ConfigError
    from services.supervise.config import load_run_config
    from xtoken_core.cache.format import Codec
    from xtoken_core.cache.manifest import parse_shard
    from xtoken_core.errors import EXIT_DATA, EXIT_SETTINGS, DataError

    # a file-size limit (ulimit -f) is a full disk to the writer, not a signal that kills it
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        config = load_run_config(args.config, getattr(args, "overrides", ()))
        from services.cache.build import BuildOptions, build_cache, summary_line

        options = BuildOptions(
            out=args.out,
            shard=parse_shard(args.shard),
            teacher=args.teacher,
            k=args.top_k,
            codec=Codec(ids=args.ids, logprobs=args.logprobs, scalars=args.scalars),
            device=args.device,
            batch_tokens=args.batch_tokens,
            shard_mb=args.shard_mb,
            progress=not args.no_progress,
        )
        # a teacher with tensor_parallel: k builds as a group (torchrun): rank 0 reports
        summary = build_cache(config, options)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"xtoken cache build: {e}", file=sys.stderr)
        return EXIT_DATA if isinstance(e, DataError) else EXIT_SETTINGS
    except OSError as e:
        from xtoken_core.cache.writer import DiskFullError

        if not isinstance(e, DiskFullError):
            raise
        print(
            f"xtoken cache build: {e.strerror}; the shards written before are kept: free space "
            "and run the same command again to continue",
            file=sys.stderr,
        )
        return 1
    if summary is not None:
        print(summary_line(summary, args.out))
    return 0


def _info(args: argparse.Namespace) -> int:
    from xtoken_core.cache.manifest import read_manifest
    from xtoken_core.errors import DataError

    try:
        m = read_manifest(args.dir)
    except DataError as e:
        print(f"xtoken cache info: {e}", file=sys.stderr)
        return 3
    if m is None:
        print(f"xtoken cache info: {args.dir} holds no teacher cache", file=sys.stderr)
        return 2
    fp = m["fingerprint"]
    rows = {
        "teacher": fp["teacher"]["model"],
        "weights_hash": fp["teacher"]["weights_hash"],
        "tokenizer": f"{fp['tokenizer']['name']} ({fp['tokenizer']['vocab_size']} ids)",
        "ctx_teacher": fp["ctx_teacher"],
        "k": m["k"],
        "width": m["width"],
        "codec": f"ids {m['codec']['ids']}, log-probs {m['codec']['logprobs']}, "
        f"per-position floats {m['codec'].get('scalars', 'fp32')}",
        "format_version": m["format_version"],
        "corpus files": len(fp["corpus"]["files"]),
        "samples": m.get("samples", 0),
        "teacher_tokens": m.get("teacher_tokens", 0),
        "bytes": m.get("bytes", 0),
        "bytes_per_teacher_token": m.get("bytes_per_teacher_token"),
        "shards": len(m["shards"]),
        "builders": ", ".join(
            f"{b} {'done' if v.get('done') else 'not done'}"
            for b, v in sorted(m["builders"].items())
        ),
        "complete": m.get("complete", False),
    }
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from xtoken_core.cache.verify import verify_cache
    from xtoken_core.errors import DataError, SettingsError

    try:
        report = verify_cache(args.dir)
    except SettingsError as e:
        print(f"xtoken cache verify: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"xtoken cache verify: {e}", file=sys.stderr)
        return 3
    for name in report.unlisted:
        print(
            f"xtoken cache verify: shards/{name} is not in the manifest (a build stopped before "
            "recording it; the next build records it)",
            file=sys.stderr,
        )
    for problem in report.problems:
        print(f"xtoken cache verify: {problem.line()}", file=sys.stderr)
    if not report.ok:
        return 3
    print(
        f"{args.dir}: {report.shards} shard(s), {report.samples} samples, "
        f"{report.teacher_tokens} teacher tokens: all readable, checksums and counts match"
    )
    return 0
