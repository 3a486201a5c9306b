"""The scaled healing runs' time, one way (A) against another (B): the same settings trained twice,
paired by setting (``scale_grid.row_key``: phase, arm, seed, learning rate, KL weight,
temperature), with B / A of each
run's wall seconds, training command, start-up step (compile, CUDA graph recording), steps and
peak GPU memory, and B - A of its validation bits/byte (deterministic runs of one code path give
0; padding or another compile path moves it by rounding alone).

The two row files come from two ``scale.py`` calls that differ in the lever alone, best side by
side on one GPU in one call (each in its own work folder and rows folder, half the runs per GPU
each), so that both see the same sharing. For instance, the students' start-up levers::

    python benchmarks/quality/scale.py --gpus 0 --runs-per-gpu 3 --work runs/ab_a --out runs/ab_a \\
        --phase grid --arms ce pkl@smollm2 --lrs 5e-4 1e-3 --max-extend 0 --kl-weights 0.5 ... &
    python benchmarks/quality/scale.py --gpus 0 --runs-per-gpu 3 --work runs/ab_b --out runs/ab_b \\
        --phase grid --arms ce pkl@smollm2 --lrs 5e-4 1e-3 --max-extend 0 --kl-weights 0.5 \\
        --length-multiple 64 --warm-shortest 512 ...
    python benchmarks/quality/scale_ab.py --a runs/ab_a/quality_scale.jsonl \\
        --b runs/ab_b/quality_scale.jsonl --label-a "ladder to 64" \\
        --label-b "lengths of 64, one rung" --out benchmarks/results/scale_startup.md

The report opens with its current figures (the medians) and the command, then a row per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal  # noqa: E402
from benchmarks.quality.scale_grid import row_key  # noqa: E402
from benchmarks.quality.scale_report import first_rows  # noqa: E402

#: the figures compared, as ``(name, how a row gives it)``; None where a row lacks it
FIGURES: tuple[tuple[str, Any], ...] = (
    ("run s", lambda r: r.get("wall_s")),
    ("training command s", lambda r: sum(r["command_s"][:-1]) if len(r.get("command_s") or []) > 1 else None),
    ("start-up step s", lambda r: r.get("compile_s")),
    ("steps s", lambda r: r.get("train_s")),
    ("trainer peak MiB", lambda r: (r.get("peak_memory_mib") or {}).get("trainer")),
)  # fmt: skip


def pairs(rows_a: list[dict], rows_b: list[dict]) -> list[tuple[dict, dict]]:
    """The settings scored in both (each side's first scored row), in A's order."""

    def scored(rows: list[dict]) -> dict[tuple, dict]:
        firsts = first_rows(rows)  # a setting's first scored row, else its first
        return {
            row_key(r): r
            for r in firsts
            if r.get("exit") == 0 and r.get("validation_bpb") is not None
        }

    a, b = scored(rows_a), scored(rows_b)
    return [(row, b[k]) for k, row in a.items() if k in b]


def compare(rows_a: list[dict], rows_b: list[dict]) -> dict[str, Any]:
    """Per pair and as medians: B / A of every figure both rows have, B - A of validation.

    Returns:
        ``{"pairs": [{"setting", "ratios": {figure: B / A}, "validation_diff"}], "medians":
        {figure: median ratio}, "max_validation_diff": the largest |B - A|}`` (``medians`` and
        the maximum are empty / None without pairs).
    """
    out: list[dict[str, Any]] = []
    for a, b in pairs(rows_a, rows_b):
        ratios = {}
        for name, get in FIGURES:
            va, vb = get(a), get(b)
            if va and vb is not None:
                ratios[name] = vb / va
        out.append(
            {
                "setting": list(row_key(a)),
                "ratios": ratios,
                "validation_diff": b["validation_bpb"] - a["validation_bpb"],
            }
        )
    medians = {}
    for name, _ in FIGURES:
        vals = [p["ratios"][name] for p in out if name in p["ratios"]]
        if vals:
            medians[name] = statistics.median(vals)
    diffs = [abs(p["validation_diff"]) for p in out]
    return {"pairs": out, "medians": medians, "max_validation_diff": max(diffs, default=None)}


def provenance(rows_a: list[dict], rows_b: list[dict]) -> str:
    """Where the rows came from: their devices and commits, and the command that made each side's
    rows (its first row's), so that the report names the machine and can be made again."""
    rows = rows_a + rows_b
    devices = sorted({r["device"] for r in rows if r.get("device")})
    commits = sorted({r["commit"] for r in rows if r.get("commit")})
    parts = [
        f"Devices: {', '.join(devices) or 'not recorded'}",
        f"commits {', '.join(commits) or 'not recorded'}",
    ]
    for side, side_rows in (("A", rows_a), ("B", rows_b)):
        command = next((r["command"] for r in side_rows if r.get("command")), None)
        if command:
            parts.append(f"{side}'s rows by `{command}`")
    return "; ".join(parts) + "."


def markdown(
    result: dict[str, Any], label_a: str, label_b: str, command: str, origin: str = ""
) -> str:
    """The report: the current figures (medians of B / A), the command, where the rows came from
    (``origin``, see `provenance`), a row per pair."""
    med = result["medians"]
    if not result["pairs"]:
        head = "**Current figures: none (no setting is scored in both row files).**"
    else:
        figs = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in med.items())
        head = (
            f"**Current figures ({label_b} / {label_a}, medians of {len(result['pairs'])} "
            f"paired runs): {figs}; validation bits/byte differ by at most "
            f"{result['max_validation_diff']:.4f}.**"
        )
    names = [name for name, _ in FIGURES]
    md = [
        f"# The scaled healing runs' time: {label_b} against {label_a}",
        "",
        head,
        "",
        f"Command: `{command}`. B / A below 1: B is faster (or smaller).",
        "",
        *([origin, ""] if origin else []),
        "| setting | " + " | ".join(f"{n} B / A" for n in names) + " | validation B - A |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for p in result["pairs"]:
        phase, arm, seed, lr, kl, t = p["setting"]
        cells = [f"{p['ratios'][n]:.2f}" if n in p["ratios"] else "-" for n in names]
        md.append(
            f"| {phase} {arm} s{seed} lr {lr:g} kl {kl if kl is not None else '-'} "
            f"| {' | '.join(cells)} | {p['validation_diff']:+.4f} |"
        )
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI: write the report; a rows file missing, not JSON lines or not of scale rows: one
    line, exit 2."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="rows of the baseline (quality_scale.jsonl)")
    p.add_argument("--b", required=True, help="rows of the other way")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--out", required=True, help="the report (.md; a .json beside it)")
    args = p.parse_args(argv)
    for path in (args.a, args.b):
        if not Path(path).is_file():
            print(
                f"scale_ab.py: no rows file {path}; give two quality_scale.jsonl", file=sys.stderr
            )
            return 2
    rows = []
    for path in (args.a, args.b):
        try:
            rows.append(heal.read_rows([Path(path)]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            print(f"scale_ab.py: {path} is not JSON lines ({e}); give quality_scale.jsonl files",
                  file=sys.stderr)  # fmt: skip
            return 2
        if any(not isinstance(r, dict) or "phase" not in r for r in rows[-1]):
            print(f"scale_ab.py: {path} holds lines that are not scale rows; give "
                  "quality_scale.jsonl files", file=sys.stderr)  # fmt: skip
            return 2
    result = compare(*rows)
    command = shlex.join(
        ["python", "benchmarks/quality/scale_ab.py", *(sys.argv[1:] if argv is None else argv)]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    links = ", ".join(
        f"[{Path(p).name}]({Path(os.path.relpath(Path(p).resolve(), out.parent.resolve())).as_posix()})"
        for p in (args.a, args.b, out.with_suffix(".json"))
    )
    origin = f"{provenance(*rows)} Rows and figures: {links}."
    out.write_text(markdown(result, args.label_a, args.label_b, command, origin))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(out.read_text().splitlines()[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
