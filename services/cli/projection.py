"""`xtoken projection`: build a projection matrix from two tokenizers, or print a file's stats."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build`` and ``info`` sub-subcommands.

    Args:
        parser: the ``projection`` subparser.
    """
    sub = parser.add_subparsers(dest="projection_command", metavar="ACTION")
    build = sub.add_parser("build", help="build a dense top-k projection from two tokenizers")
    build.add_argument("--student", required=True, help="student tokenizer (e.g. qwen3)")
    build.add_argument("--teacher", required=True, help="teacher tokenizer (e.g. mistral)")
    build.add_argument("--top-k", type=int, default=8, help="slots per row (default 8)")
    build.add_argument(
        "-o", "--output", required=True, help="output file (.pt: torch.save, .safetensors)"
    )
    build.add_argument(
        "--limit", type=int, default=None, help="build only the first N student ids (smoke runs)"
    )
    build.add_argument(
        "--decay", type=float, default=0.5, help="weight ratio of consecutive pieces (default 0.5)"
    )
    build.add_argument("--stats-json", default=None, help="also write the coverage stats as JSON")
    info = sub.add_parser("info", help="print the layout and statistics of a projection file")
    info.add_argument("file", help="projection file (.pt or .safetensors)")
    info.add_argument(
        "--teacher-vocab-size",
        type=int,
        default=0,
        help="teacher vocab for the exact-map counts (default: max teacher id + 1)",
    )


def _print_table(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def _build(args: argparse.Namespace) -> int:
    from xtoken_core.data.projection_build import (
        build_projection_with_stats,
        projection_metadata,
        save_projection,
    )
    from xtoken_core.tokenizers import load_tokenizer

    if args.limit is not None and args.limit < 1:
        print(f"--limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    student = load_tokenizer(args.student)
    teacher = load_tokenizer(args.teacher)
    student_ids = None
    if args.limit is not None:
        student_ids = range(min(args.limit, student.vocab_size))
    result, stats = build_projection_with_stats(
        student, teacher, args.top_k, student_ids=student_ids, decay=args.decay
    )
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    meta = projection_metadata(student, teacher)
    meta["student"], meta["teacher"] = args.student, args.teacher  # the names as given
    save_projection(result, args.output, meta)
    figures = stats.as_dict()
    mapped = max(stats.rows_built, 1)
    figures["exact_fraction"] = stats.exact_rows / mapped
    figures["unmapped_fraction"] = stats.unmapped_rows / mapped
    rows_with_entries = int((result["indices"] >= 0).any(dim=1).sum())
    figures["coverage"] = rows_with_entries / max(student.vocab_size, 1)  # rows with entries / V_s
    figures["output"] = args.output
    _print_table(figures)
    if args.stats_json:
        with open(args.stats_json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    logger.info("[projection] wrote %s", args.output)
    return 0


def _info(args: argparse.Namespace) -> int:
    from xtoken_core.data.projection import (
        exact_token_map_from_topk,
        get_topk_projection,
        parse_projection_file,
        read_projection_metadata,
    )
    from xtoken_core.data.projection_build import projection_stats

    indices_2N, values_N, v_s, v_t = parse_projection_file(args.file)
    figures: dict = {"file": args.file, "nnz": int(indices_2N.shape[1])}
    figures["v_student_inferred"], figures["v_teacher_inferred"] = v_s, v_t
    try:
        indices, likelihoods = get_topk_projection(args.file, "cpu")
    except ValueError:
        figures["layout"] = "sparse {(s, t): weight}"
        figures["minus_one_entries"] = int((indices_2N[1] < 0).sum())
        _print_table(figures)
        return 0
    figures["layout"] = "dense top-k"
    figures.update(projection_stats(indices, likelihoods))
    figures["coverage"] = 1 - figures["empty_rows"] / max(figures["student_rows"], 1)
    meta = read_projection_metadata(args.file)
    figures.update(meta or {"tokenizers": "not recorded (built before files recorded them)"})
    teacher_vocab = max(args.teacher_vocab_size, v_t, 1)
    for name, relaxed in (("strict", False), ("relaxed", True)):
        part = exact_token_map_from_topk(
            indices, likelihoods, xtoken_loss=relaxed, teacher_vocab_size=teacher_vocab
        )
        figures[f"common_tokens_{name}"] = int(part["common_student"].numel())
    _print_table(figures)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``xtoken projection build|info``.

    Args:
        args: parsed arguments (see ``add_arguments``).

    Returns:
        Process exit code: 0 on success, 2 on usage or input errors.
    """
    command = getattr(args, "projection_command", None)
    if command is None:
        print("usage: xtoken projection {build,info} ...", file=sys.stderr)
        return 2
    try:
        return _build(args) if command == "build" else _info(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"xtoken projection {command}: {exc}", file=sys.stderr)
        return 2
