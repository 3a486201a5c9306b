"""Benchmark commands side by side, one GPU each, in one command: how the multi-GPU results of
this repository are measured (one arm per GPU of one host, the arms at the same time).

Each job (``--job "CMD"``: a shell command; chain steps with ``;`` or ``&&``) runs on the next
free lane, with

* ``CUDA_VISIBLE_DEVICES`` set to the lane's GPU (``--gpus``; ``--lanes N`` for CPU lanes that
  see what this process sees);
* ``OMP_NUM_THREADS`` = the host's cores / lanes, unless the environment sets it: several
  trainers on one host, each running OpenMP regions as wide as the host, left their GPUs idle
  (``benchmarks/results/teacher_cache.md``);
* ``LANE_OUT``: a folder of its own under ``--out`` for its result rows (``--results
  $LANE_OUT/rows.jsonl``), and its output in ``--out/jobN.log``.

A job past ``--timeout`` seconds is stopped (its process group: SIGTERM, then SIGKILL) and
reported with exit 124. At the end one line per job: its lane, exit code, wall seconds, the rows
its folder holds and its log's last line; with ``--pack FILE`` every log and row file in one
tar.gz (a remote machine may bring back only a few files). Exit 0 when every job exited 0, 1
otherwise, 2 for bad settings.

Usage (four GPUs; ``\\$LANE_OUT`` is expanded by each job's shell)::

    python benchmarks/lanes.py --gpus 0 1 2 3 --timeout 540 --out /tmp/lanes \\
        --pack $OUT/lanes.tgz \\
        --job "python benchmarks/e2e/bench_student_step.py ... --results \\$LANE_OUT/rows.jsonl" \\
        --job "python benchmarks/cache/bench_cache_train.py ... --out \\$LANE_OUT/rows.jsonl"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality.scale_lanes import Job, Lanes  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", action="append", default=[], help="a shell command (repeatable)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", nargs="+", help="one lane per GPU: indices, 0 1 2 3 or 0,1,2,3")
    where.add_argument("--lanes", type=int, help="CPU lanes (no GPU set)")
    p.add_argument("--timeout", type=float, default=540.0, help="most seconds per job")
    p.add_argument("--out", required=True, help="the jobs' logs and LANE_OUT folders")
    p.add_argument("--pack", default=None, help="a tar.gz of every log and row file")
    return p.parse_args(argv)


def lanes_of(args: argparse.Namespace) -> list[str | None]:
    """The lanes: one GPU index each, or ``None`` for a CPU lane.

    Raises:
        ValueError: no job, a GPU named twice or not a whole number, fewer than one lane, or a
            timeout that is not positive.
    """
    if not args.job:
        raise ValueError("no --job given: name at least one command")
    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout}: must be > 0 seconds")
    if args.gpus is None:
        if args.lanes < 1:
            raise ValueError(f"--lanes {args.lanes}: must be >= 1")
        return [None] * args.lanes
    gpus = [g for item in args.gpus for g in item.split(",") if g]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise ValueError(f"--gpus {' '.join(args.gpus)}: give GPU indices, e.g. --gpus 0 1 2 3")
    if len(set(gpus)) < len(gpus):
        raise ValueError(f"--gpus {' '.join(args.gpus)}: a GPU named twice")
    return gpus


def run(args: argparse.Namespace, lanes: list[str | None]) -> list[dict]:
    """Run every job on the lanes; returns one summary dict per job, in the jobs' order."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(lanes))))
    env["PYTHONUNBUFFERED"] = "1"
    pending = []
    for i, cmd in enumerate(args.job):
        lane_out = out / f"job{i}"
        lane_out.mkdir(exist_ok=True)
        shell = f"export LANE_OUT={lane_out}; {cmd}"
        pending.append(Job(i, [["bash", "-c", shell]], out / f"job{i}.log"))
    done: dict[int, dict] = {}

    def next_jobs(n: int) -> list[Job]:
        ready, pending[:] = pending[:n], pending[n:]
        return ready

    def on_done(job: Job, code: int, wall: float, lane: str | None) -> None:
        rows = sum(len(f.read_text().splitlines()) for f in (out / f"job{job.key}").glob("*.jsonl"))
        lines = (
            job.log.read_text(errors="replace").strip().splitlines() if job.log.is_file() else []
        )
        done[job.key] = {
            "job": job.key, "lane": "cpu" if lane is None else f"GPU {lane}", "exit": code,
            "wall_s": round(wall, 1), "rows": rows, "last": lines[-1][:120] if lines else "",
        }  # fmt: skip

    Lanes(lanes, args.timeout, ROOT, env, name="lanes").run(next_jobs, on_done, poll_s=0.2)
    summary = [done[i] for i in sorted(done)]
    if args.pack:
        with tarfile.open(args.pack, "w:gz") as tar:
            for f in sorted(out.rglob("*")):
                if f.is_file() and (f.suffix in (".log", ".jsonl", ".json", ".txt", ".md")):
                    tar.add(f, arcname=str(f.relative_to(out)))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        lanes = lanes_of(args)
    except ValueError as e:
        print(f"lanes: {e}", file=sys.stderr)
        return 2
    summary = run(args, lanes)
    for s in summary:
        print(
            f"job{s['job']:<3} {s['lane']:<6} exit {s['exit']:<4} {s['wall_s']:>7.1f} s "
            f"{s['rows']:>3} rows | {s['last']}"
        )
    return 0 if all(s["exit"] == 0 for s in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
