"""Quality of training from a teacher cache against the same teacher online: each cache arm of
the scaled healing experiment (``benchmarks/quality/scale.py``, ``ARM:cache=K``) beside its
online twin (``ARM:topk=K``: the same top-K targets sent live by a teacher process), the same
student, settings and seeds, paired by seed.

Per split (validation, held-out, fresh): both arms' mean bits/byte, the online arm's seed
standard deviation (its run-to-run noise), the paired difference cache - online with its 95%
t-interval, and whether the difference is within the noise: ``|mean difference| <= 2 sd`` of
the online arm (the report's rule for a cache, ``scale_report.bars``), and whether the
interval spans 0. Prints a markdown table
and, with ``--results``, appends one row per pair to ``teacher_cache.jsonl``
(``quality_delta``: the mean paired difference per split).

Usage (the scale rows of one or more calls; students of several tokenizers may share a cache
through ``scale.py --caches``)::

    python benchmarks/cache/cache_quality.py ROWS.jsonl [ROWS.jsonl ...] \\
        [--results benchmarks/results/teacher_cache.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import append_rows  # noqa: E402
from benchmarks.quality import heal_stats, scale_arms, scale_report  # noqa: E402

SPLITS = ("validation", "heldout", "fresh")


def compare(rows: list[dict]) -> list[dict[str, Any]]:
    """Every cache arm beside its online top-K twin of the same K, per student.

    Args:
        rows: scale rows (final rows are read; others are left out).

    Returns:
        One dict per pair: ``student``, ``student_tokenizer``, ``teacher``, ``mode``, ``k``,
        ``cache_arm``, ``online_arm``, ``seeds``, ``device``, ``commit``, ``tokens``, and
        per split ``{split: {"cache", "online", "online_sd", "delta", "lo", "hi", "within"}}``
        under ``splits``.
    """
    out = []
    for student in sorted({r["student"] for r in rows}):
        summary = scale_report.summarize([r for r in rows if r["student"] == student])
        arms = summary["arms"]
        parsed = {name: scale_arms.parse_scale_arm(name) for name in arms}
        for name, arm in parsed.items():
            if not arm.cache:
                continue
            twin = next(
                (
                    o
                    for o, t in parsed.items()
                    if t.topk == arm.cache
                    and not t.cache
                    and arms[o]["row"]["family"] == arms[name]["row"]["family"]
                ),
                None,
            )
            if twin is None:
                continue
            c, o = arms[name], arms[twin]
            row = c["row"]
            pair: dict[str, Any] = {
                "student": student,
                "student_tokenizer": row["student_tokenizer"],
                "teacher": row["teachers"][0],
                "mode": name.partition("@")[0],
                "k": arm.cache,
                "cache_arm": name,
                "online_arm": twin,
                "seeds": sorted(set(c["seeds"]) & set(o["seeds"])),
                "device": row.get("device"),
                "commit": row.get("commit"),
                "tokens": row.get("tokens"),
                "splits": {},
            }
            for split in SPLITS:
                if split not in c or split not in o:
                    continue
                diffs = scale_report.paired(c[split], o[split])
                ti = heal_stats.t_interval(diffs)
                pair["splits"][split] = {
                    "cache": c[split]["mean"],
                    "online": o[split]["mean"],
                    "online_sd": o[split]["sd"],
                    "delta": ti["mean"],
                    "lo": ti.get("lo"),
                    "hi": ti.get("hi"),
                    "within": abs(ti["mean"]) <= 2 * o[split]["sd"],
                    "ci_spans_zero": ti.get("lo") is not None and ti["lo"] <= 0 <= ti["hi"],
                }
            out.append(pair)
    return out


def result_rows(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``teacher_cache.jsonl`` rows of the pairs (``quality_delta``: cache - online per split)."""
    return [
        {
            "bench": "teacher_cache_quality",
            "commit": p["commit"],
            "device": p["device"],
            "teacher": p["teacher"],
            "student": p["student"],
            "student_tokenizer": p["student_tokenizer"],
            "mode": p["mode"],
            "k": p["k"],
            "seeds": p["seeds"],
            "tokens": p["tokens"],
            "quality_delta": {s: round(v["delta"], 5) for s, v in p["splits"].items()},
            "online_seed_sd": {s: round(v["online_sd"], 5) for s, v in p["splits"].items()},
            "delta_ci95": {
                s: [round(v["lo"], 5), round(v["hi"], 5)]
                for s, v in p["splits"].items()
                if v["lo"] is not None
            },
            "within_2sd": all(v["within"] for v in p["splits"].values()),
            "ci95_spans_zero": all(v["ci_spans_zero"] for v in p["splits"].values()),
        }
        for p in pairs
    ]


def markdown(pairs: list[dict[str, Any]]) -> str:
    """The table: one line per pair and split."""
    lines = [
        "| student (tokenizer) | loss | split | cache | online (seed sd) | cache - online "
        "[95% CI] | within 2 sd | CI spans 0 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in pairs:
        for split, v in p["splits"].items():
            ci = f" [{v['lo']:+.4f}, {v['hi']:+.4f}]" if v["lo"] is not None else ""
            lines.append(
                f"| {p['student']} ({p['student_tokenizer']}) | {p['mode']} | {split} | "
                f"{v['cache']:.4f} | {v['online']:.4f} ({v['online_sd']:.4f}) | "
                f"{v['delta']:+.4f}{ci} | {'yes' if v['within'] else 'no'} | "
                f"{'yes' if v['ci_spans_zero'] else 'no'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", nargs="+", help="scale rows (quality_scale.jsonl of each call)")
    p.add_argument("--results", default=None, help="append the pairs' rows to this jsonl")
    args = p.parse_args(argv)
    rows = [json.loads(line) for f in args.rows for line in Path(f).read_text().splitlines()]
    pairs = compare(rows)
    if not pairs:
        print("no cache arm with an online top-K twin of the same K in these rows", file=sys.stderr)
        return 2
    print(markdown(pairs))
    if args.results:
        append_rows(Path(args.results), result_rows(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
