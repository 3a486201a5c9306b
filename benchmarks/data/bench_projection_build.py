"""Benchmark: full-vocab projection builds for real tokenizer pairs (time and coverage).

Prints one table and appends its rows to benchmarks/results/projection_build.md.

    python benchmarks/data/bench_projection_build.py                 # the default pairs
    python benchmarks/data/bench_projection_build.py --pairs qwen3:mistral --no-append
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.data.projection import exact_token_map_from_topk  # noqa: E402
from xtoken_core.data.projection_build import build_projection_with_stats  # noqa: E402
from xtoken_core.tokenizers import load_tokenizer  # noqa: E402

RESULTS = _common.RESULTS_DIR / "projection_build.md"
DEFAULT_PAIRS = (
    "qwen3:mistral",
    "mistral:qwen3",
    "qwen3:deepseek",
    "deepseek:qwen3",
    "deepseek:mistral",
    "mistral:deepseek",
)
COLUMNS = (
    "date",
    "commit",
    "device",
    "student",
    "teacher",
    "V_s",
    "V_t",
    "K",
    "load s",
    "build s",
    "save s",
    "file MiB",
    "exact",
    "special",
    "re-tokenized",
    "byte fallback",
    "unmapped",
    "truncated",
    "pieces/row",
    "common strict",
    "common relaxed",
)


def _bench_pair(student_name: str, teacher_name: str, top_k: int) -> dict:
    t0 = time.perf_counter()
    student, teacher = load_tokenizer(student_name), load_tokenizer(teacher_name)
    load_s = time.perf_counter() - t0
    result, stats = build_projection_with_stats(student, teacher, top_k)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "proj.pt"
        t0 = time.perf_counter()
        torch.save(result, path)
        save_s = time.perf_counter() - t0
        size_mib = path.stat().st_size / 2**20
    common = {
        mode: exact_token_map_from_topk(
            result["indices"],
            result["likelihoods"],
            xtoken_loss=relaxed,
            teacher_vocab_size=teacher.vocab_size,
        )["common_student"].numel()
        for mode, relaxed in (("strict", False), ("relaxed", True))
    }
    return {
        "student": student_name,
        "teacher": teacher_name,
        "V_s": stats.student_vocab_size,
        "V_t": stats.teacher_vocab_size,
        "K": top_k,
        "load s": f"{load_s:.2f}",
        "build s": f"{stats.seconds:.2f}",
        "save s": f"{save_s:.2f}",
        "file MiB": f"{size_mib:.1f}",
        "exact": stats.exact_rows,
        "special": stats.special_rows,
        "re-tokenized": stats.retokenized_rows,
        "byte fallback": stats.byte_fallback_rows,
        "unmapped": stats.unmapped_rows,
        "truncated": stats.truncated_rows,
        "pieces/row": f"{stats.mean_pieces_per_mapped_row:.2f}",
        "common strict": common["strict"],
        "common relaxed": common["relaxed"],
    }


def _last_header(path: Path) -> str | None:
    """The last table header line of a results file (None if it has none)."""
    headers = [
        line.rstrip("\n")
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("| date")
    ]
    return headers[-1] if headers else None


def main() -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), help="student:teacher")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--no-append", action="store_true", help="do not write the results file")
    args = parser.parse_args()

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    common = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "commit": _common.commit(),
        "device": _common.cpu_name(),
    }
    rows = []
    for pair in args.pairs:
        student_name, teacher_name = pair.split(":")
        rows.append({**common, **_bench_pair(student_name, teacher_name, args.top_k)})

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    print("\n".join(lines))
    if not args.no_append:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        new = not RESULTS.exists()
        with RESULTS.open("a", encoding="utf-8") as f:
            if new:
                f.write(
                    "# Projection builds (full vocabularies)\n\n"
                    "Written by `benchmarks/data/bench_projection_build.py`. `load s`: loading both "
                    "tokenizers (cached after a pair's first use); `build s`: "
                    "`build_projection_with_stats`; rows are student tokens; `common`: rows in the "
                    "exact-token map (strict / relaxed) of the gold loss.\n\n"
                )
                f.write(lines[0] + "\n" + lines[1] + "\n")
            elif _last_header(RESULTS) != lines[0]:  # the columns changed: start a new table
                f.write("\n" + lines[0] + "\n" + lines[1] + "\n")
            f.write("\n".join(lines[2:]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
