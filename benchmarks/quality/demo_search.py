"""The demo's configurations compared: held-out bits/byte of each KD run and of its CE-only twin,
seed by seed, and the mean difference KD minus CE.

A configuration is a name and ``xtoken demo`` options applied over the demo's own config
(``services/cli/demo.py``, ``DEMO_CONFIG``). Per seed ``s`` (``data.seed`` orders the texts,
``trainer.student.seed`` draws the initial student; both are set to ``s``) the KD run is ``xtoken
demo --no-baseline`` and its twin the same options with ``--mode ce``; twins whose CE-only run
config is the same (the KD runs differ only in their loss) run once. The runs go one after the
other, never side by side, so their CPU seconds (user + system, of the whole run) compare on a
machine other jobs share::

    python benchmarks/quality/demo_search.py --seeds 0 1 2 \\
        --config 'xtoken=' --config 'pkl=--mode pkl' --out /tmp/demo_search.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_config(text: str) -> tuple[str, list[str]]:
    """``NAME=OPTIONS`` -> ``(name, [option, ...])`` (the options split as a shell would)."""
    name, sep, options = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=OPTIONS, e.g. 'pkl=--mode pkl'")
    return name, shlex.split(options)


def ce_key(options: list[str]) -> str:
    """The CE-only run config these demo options make (its run directory left out): twins with
    the same key are the same run."""
    sys.path.insert(0, str(ROOT))
    from services.cli import build_parser
    from services.cli.demo import baseline_data

    data = baseline_data(build_parser().parse_args(["demo", *options]))
    data.pop("run_dir")
    return json.dumps(data, sort_keys=True)


def run_demo(run_dir: Path, options: list[str]) -> dict:
    """One ``xtoken demo --no-baseline`` run; its held-out figures, wall and CPU seconds.

    Raises:
        RuntimeError: the run failed (names its log).
    """
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "services.cli", "demo", "--no-progress", "--no-baseline"]
    cmd += ["--run-dir", str(run_dir), *options]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("wb") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; its log: {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "before": summary["student_before"]["bits_per_byte"],
        "after": summary["student_after"]["bits_per_byte"],
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        type=parse_config,
        action="append",
        required=True,
        help="NAME=OPTIONS: xtoken demo options over the demo's config (repeatable)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--run-root", default="/tmp/xtoken-demo-search", help="the runs' directories")
    p.add_argument("--out", default=None, help="append one JSON row per KD run to this file")
    args = p.parse_args()

    root = Path(args.run_root)
    ce_runs: dict[tuple[str, int], dict] = {}
    rows = []
    for name, options in args.config:
        for seed in args.seeds:
            seeded = [
                *options,
                "--set",
                f"data.seed={seed}",
                "--set",
                f"trainer.student.seed={seed}",
            ]
            key = (ce_key(seeded), seed)
            if key not in ce_runs:
                ce_runs[key] = run_demo(
                    root / f"ce-{len(ce_runs)}-s{seed}", [*seeded, "--mode", "ce"]
                )
            kd, ce = run_demo(root / f"{name}-s{seed}", seeded), ce_runs[key]
            row = {
                "config": name,
                "options": shlex.join(options),
                "seed": seed,
                "student_before": kd["before"],
                "kd": kd["after"],
                "ce": ce["after"],
                "kd_minus_ce": kd["after"] - ce["after"],
                "kd_cpu_s": kd["cpu_s"],
                "ce_cpu_s": ce["cpu_s"],
                "load_1min": round(os.getloadavg()[0], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row) + "\n")
    print(f"\n{'config':<16} {'seed':>4} {'KD':>7} {'CE only':>7} {'KD - CE':>8}")
    for row in rows:
        print(
            f"{row['config']:<16} {row['seed']:>4} {row['kd']:7.4f} {row['ce']:7.4f} "
            f"{row['kd_minus_ce']:+8.4f}"
        )
    for name, _ in args.config:
        diffs = [r["kd_minus_ce"] for r in rows if r["config"] == name]
        print(f"{name}: mean KD - CE {statistics.mean(diffs):+.4f} over {len(diffs)} seed(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
