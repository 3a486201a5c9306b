"""Random-fault campaign: N small real runs, each SIGKILLs one random process of the run at a
random moment; every run must still train each text of its corpus exactly once.

A run is ``xtoken run examples/tiny.yaml`` on 64 texts of the demo corpus (two gloo trainer
ranks, one shm teacher, tiny models, a checkpoint every 2 of its 8 steps, the run's own queue),
or ``examples/on_policy.yaml`` on 32 texts when the victim is the rollout worker, or the tiny run
submitted to ``xtoken control serve`` when the victim is the control plane. The run's seed draws:

* the victim: ``trainer0``, ``trainer1``, ``teacher0``, ``collator``, ``queue``, ``rollout0``
  (a process of the run, found by its heartbeat file ``RUN_DIR/heartbeat/<name>``, whose pid
  is checked against the environment the supervisor gave it) or ``control`` (the control plane:
  killed, then started again on the same runs root, which re-attaches the run);
* the moment: after rank 0 logged ``k`` steps (``RUN_DIR/keys``; ``k = 0``: as soon as the
  victim runs), or for the collator after the queue holds ``k`` samples, plus a random delay
  below a second.

The victim gets a real SIGKILL (the process alone: its own workers are left to their dead-parent
sentinel). Then the run must exit 0 (the control plane's run: SUCCEEDED) with no traceback in
what the user sees (``xtoken run``'s output, the control plane's log), leave no process behind,
and its final student's history (:mod:`benchmarks.faults.lineage`: the keys logs of every launch
less the steps a restart rolled back) must hold every corpus text once: 0 missing, 0 twice.

    python benchmarks/faults/campaign.py --runs 30 --seed 0 --jobs 2
    python benchmarks/faults/campaign.py --runs 30 --seed 0 --jobs 2 --resume  # after a stop
    python benchmarks/faults/campaign.py --seeds 1234,5678      # replay runs by their seeds
    python benchmarks/faults/campaign.py --runs 30 --seed 0 --plan  # what would run, no run
    python benchmarks/faults/campaign.py --runs 30 --seed 0 --jobs 2 --report  # from the rows

Prints one table (run, seed, victim, moment, outcome, missing, twice, wall s), appends a JSON row
per run to ``--out`` as each run ends (``--resume`` skips the runs of this seed and commit found
there) and writes ``--md`` from the campaign's rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.faults import lineage  # noqa: E402
from benchmarks.faults.report import write_report  # noqa: E402
from benchmarks.faults.victims import (  # noqa: E402
    STOP,
    Watch,
    end_process,
    free_port,
    reap,
    role_pid,
    strike,
)

RESULTS = ROOT / "benchmarks" / "results"
VICTIMS = ("trainer0", "trainer1", "teacher0", "collator", "queue", "rollout0", "control")
TEXTS = 64  # the tiny run's corpus
ON_POLICY_TEXTS = 32  # the on-policy run's (two off-policy samples a step: 16 steps)
# the tiny run: 64 texts / (2 ranks x 4 samples) = 8 steps, a checkpoint every 2
TINY = ROOT / "examples" / "tiny.yaml"
TINY_SETS: dict[str, Any] = {
    "data.limit": None,
    "trainer.feed.grad_accum": 1,
    "trainer.schedule.export": False,
    "collator.batch": 4,  # small puts: a kill of the collator lands mid-corpus
}
TINY_STEPS = 8
ON_POLICY = ROOT / "examples" / "on_policy.yaml"
ON_POLICY_SETS: dict[str, Any] = {"data.limit": ON_POLICY_TEXTS, "trainer.schedule.export": False}
ON_POLICY_STEPS = 16
# Two cores run every process of a run: one intra-op thread each keeps them from fighting.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run of the campaign, all drawn from its seed.

    Attributes:
        index: the run's number in the campaign.
        seed: the run's seed (``random.Random(seed)`` draws the rest).
        victim: the process to kill (:data:`VICTIMS`).
        unit: what ``at`` counts: ``step`` (steps rank 0 logged) or ``sample`` (samples queued).
        at: the kill waits until this many were reached...
        delay_s: ...and this long after.
    """

    index: int
    seed: int
    victim: str
    unit: str
    at: int
    delay_s: float

    @property
    def moment(self) -> str:
        """The moment in words (``step 3 +0.42s``, ``16 samples +0.10s``)."""
        what = f"step {self.at}" if self.unit == "step" else f"{self.at} samples"
        return f"{what} +{self.delay_s:.2f}s"


def plan_run(index: int, seed: int, victims: tuple[str, ...] = VICTIMS) -> Plan:
    """The victim and the moment of run ``index`` from its ``seed``."""
    rng = random.Random(seed)
    victim = rng.choice(victims)
    if victim == "collator":
        # up to 48 of the 64 texts put (puts of 4): the collator still runs when the kill comes
        return Plan(index, seed, victim, "sample", rng.randrange(0, TEXTS - 12, 4),
                    round(rng.uniform(0, 0.25), 2))  # fmt: skip
    steps = ON_POLICY_STEPS if victim.startswith("rollout") else TINY_STEPS
    return Plan(index, seed, victim, "step", rng.randrange(steps), round(rng.uniform(0, 1), 2))


def run_seeds(master: int, n: int) -> list[int]:
    """The seeds of runs 0..n-1 of the campaign ``master``."""
    rng = random.Random(master)
    return [rng.randrange(2**31) for _ in range(n)]


# ----------------------------------------------------------------------------- the corpus


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The texts every run reads: ``data/corpus.jsonl`` (64 texts of the demo corpus) and
    ``data/heldout.jsonl`` (the demo's held-out texts) under the campaign folder."""

    data_root: Path
    train: Path
    heldout: Path
    keys: tuple[str, ...]

    @classmethod
    def build(cls, root: Path) -> Corpus:
        """Write the corpus files (once) and read the keys the collator will make of them."""
        from xtoken_core.data.corpus import build_demo_corpus, iter_texts

        demo = build_demo_corpus()
        data = (root / "data").resolve()
        data.mkdir(parents=True, exist_ok=True)
        train, heldout = data / "corpus.jsonl", data / "heldout.jsonl"
        if not train.is_file():
            texts = [t for _, (_, t) in zip(range(TEXTS), iter_texts(demo.train_path))]
            tmp = train.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            tmp.replace(train)
        if not heldout.is_file():
            shutil.copy(demo.heldout_path, heldout)
        keys = tuple(k for k, _ in iter_texts(train))
        return cls(data, train, heldout, keys)


# ----------------------------------------------------------------------------- one run


def _sets(sets: dict[str, Any]) -> list[str]:
    out = []
    for key, value in sets.items():
        out += ["--set", f"{key}={json.dumps(value)}"]
    return out


def run_xtoken(plan: Plan, corpus: Corpus, work: Path, timeout_s: float) -> dict[str, Any]:
    """``xtoken run`` of the plan's config with its kill; the row's outcome fields."""
    on_policy = plan.victim.startswith("rollout")
    example, sets = (ON_POLICY, ON_POLICY_SETS) if on_policy else (TINY, TINY_SETS)
    sets = {**sets, "data.train": str(corpus.train), "data.heldout": str(corpus.heldout)}
    run_dir = work / "run"
    argv = [sys.executable, "-m", "services.cli", "run", str(example), "--run-dir", str(run_dir),
            "--no-progress", *_sets(sets)]  # fmt: skip
    env = {**os.environ, **ENV}
    env.pop("XTOKEN_PARENT_PID", None)
    output = work / "output.log"
    deadline = time.monotonic() + timeout_s
    watch = Watch(run_dir)
    with open(output, "wb") as log:
        popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        try:
            kill = strike(plan, watch, lambda: role_pid(run_dir, plan.victim),
                          lambda: popen.poll() is not None, deadline)  # fmt: skip
            while popen.poll() is None and time.monotonic() < deadline and not STOP.is_set():
                watch.note_pids()
                time.sleep(0.2)
            timed_out = popen.poll() is None
            code = end_process(popen, 60) if timed_out else popen.returncode
        finally:
            if popen.poll() is None:
                end_process(popen, 10)
            watch.close()
            left = reap(run_dir, watch.pids_seen)  # also after a harness error
    text = output.read_text(errors="replace")
    lin = lineage.check_lineage(run_dir, corpus.keys[: ON_POLICY_TEXTS if on_policy else TEXTS],
                                on_policy=on_policy)  # fmt: skip
    return _outcome(kill, lin, exit=code, ok_exit=code == 0 and not timed_out,
                    timed_out=timed_out, traceback="Traceback" in text, left=left,
                    run_dir=run_dir)  # fmt: skip


class Control:
    """``xtoken control serve`` on a runs root of its own, started (again) on one port."""

    def __init__(self, root: Path, data_root: Path) -> None:
        self.root = root
        self.runs_root = root / "runs"
        self.data_root = data_root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "control.log"
        self.popen: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> None:
        """Start it (its runs' processes, if any, are re-attached) and wait until it serves.

        Raises:
            RuntimeError: it exited or did not get ready.
        """
        ready = self.root / "control.ready"
        ready.unlink(missing_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **ENV}
        env.pop("XTOKEN_PARENT_PID", None)
        argv = [sys.executable, "-m", "services.cli", "control", "serve", "--port", str(self.port),
                "--runs-root", str(self.runs_root), "--data-root", str(self.data_root),
                "--ready-file", str(ready)]  # fmt: skip
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not ready.is_file():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"control serve did not start (see {self.log})")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (its runs' processes go on: they are reaped by the caller)."""
        if self.popen is not None:
            end_process(self.popen, 20)


def control_config(corpus: Corpus) -> dict[str, Any]:
    """The tiny run as the control plane takes it: paths under the data root, no run_dir."""
    import yaml

    config = yaml.safe_load(TINY.read_text())
    config.pop("run_dir", None)
    sets = {**TINY_SETS, "data.train": corpus.train.name, "data.heldout": corpus.heldout.name}
    for key, value in sets.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config


def run_control(plan: Plan, corpus: Corpus, work: Path, timeout_s: float) -> dict[str, Any]:
    """The tiny run submitted to the control plane, the control plane SIGKILLed at the moment
    and started again; the row's outcome fields."""
    import httpx

    control = Control(work / "control", corpus.data_root)
    deadline = time.monotonic() + timeout_s
    run_dir: Path | None = None
    watch: Watch | None = None
    state, kill, left = "unknown", {"landed": False, "pid": None}, 0
    try:
        control.start()
        with httpx.Client(base_url=control.url, timeout=30) as c:
            r = c.post("/v1/runs", json=control_config(corpus))
            r.raise_for_status()
            rid = r.json()["id"]
            run_dir = Path(c.get(f"/v1/runs/{rid}").json()["run_dir"])
            watch = Watch(run_dir)
            last = {"state": "PENDING"}

            def ended() -> bool:
                last.update(c.get(f"/v1/runs/{rid}").json())
                return last["state"] in ("SUCCEEDED", "FAILED", "STOPPED", "INTERRUPTED")

            def pids() -> dict[str, int]:
                table = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
                return {p["name"]: p["pid"] for p in table if p["state"] == "running"}

            before: dict[str, int] = {}
            kill = strike(plan, watch, lambda: control.popen.pid, ended, deadline,
                          before_kill=lambda: before.update(pids()))  # fmt: skip
        if kill["landed"]:
            control.popen.wait(10)
            control.start()  # on the same runs root: the run is re-attached
        with httpx.Client(base_url=control.url, timeout=30) as c:
            if kill["landed"]:  # the processes that ran on are its again, not started anew
                table = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
                after = {p["name"]: p["pid"] for p in table}
                kill["reattached"] = all(after.get(n) == pid for n, pid in before.items())
            while time.monotonic() < deadline and not STOP.is_set():
                watch.note_pids()
                state = c.get(f"/v1/runs/{rid}").json()["state"]
                if state in ("SUCCEEDED", "FAILED", "STOPPED", "INTERRUPTED"):
                    break
                time.sleep(0.5)
            else:
                state = "timeout"
    finally:
        control.stop()
        if watch is not None:
            watch.close()
            left = reap(watch.run_dir, watch.pids_seen)  # also after a harness error
    text = control.log.read_text(errors="replace") if control.log.is_file() else ""
    lin = lineage.check_lineage(run_dir, corpus.keys) if run_dir is not None else None
    return _outcome(kill, lin, exit=state, ok_exit=state == "SUCCEEDED",
                    timed_out=state == "timeout", traceback="Traceback" in text, left=left,
                    run_dir=run_dir)  # fmt: skip


def _outcome(kill: dict[str, Any], lin: lineage.Lineage | None, *, exit: Any, ok_exit: bool,
             timed_out: bool, traceback: bool, left: int, run_dir: Path | None) -> dict[str, Any]:  # fmt: skip
    """The row's outcome: ``ok`` or the problems found, and the figures behind them."""
    problems = []
    if not kill["landed"]:
        problems.append("missed")
    if kill.get("reattached") is False:
        problems.append("not re-attached")
    if timed_out:
        problems.append("timeout")
    elif not ok_exit:
        problems.append(f"exit {exit}")
    if traceback:
        problems.append("traceback")
    if left:
        problems.append(f"{left} left")
    row: dict[str, Any] = {**kill, "exit": exit, "traceback": traceback, "left": left,
                           "run_dir": str(run_dir) if run_dir else None}  # fmt: skip
    if lin is None:
        problems.append("no lineage")
    else:
        t = lin.tally
        for what, keys in (("missing", t.missing), ("twice", t.twice), ("extra", t.extra)):
            row[what] = len(keys)
            row[f"{what}_keys"] = keys[:16]
            if keys:
                problems.append(f"{len(keys)} {what}")
        if lin.gaps:
            problems.append(f"{len(lin.gaps)} step gaps")
        row.update(steps=lin.steps, rolled_back=lin.rolled_back, on_policy=t.on_policy,
                   gaps=lin.gaps[:16])  # fmt: skip
    row["outcome"] = "; ".join(problems) or "ok"
    return row


def run_one(plan: Plan, corpus: Corpus, root: Path, timeout_s: float) -> dict[str, Any]:
    """One run of the campaign: its row."""
    work = root / f"run{plan.index:03d}-{plan.seed}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.monotonic()
    try:
        if plan.victim == "control":
            fields = run_control(plan, corpus, work, timeout_s)
        else:
            fields = run_xtoken(plan, corpus, work, timeout_s)
    except Exception as e:  # noqa: BLE001 (a harness error is a row too, never the campaign's end)
        fields = {"outcome": f"harness error: {type(e).__name__}: {e}", "landed": False}
    return {
        "run": plan.index,
        "seed": plan.seed,
        "victim": plan.victim,
        "moment": plan.moment,
        **fields,
        "wall_s": round(time.monotonic() - started, 1),
    }


# ----------------------------------------------------------------------------- the campaign


COLUMNS = ["run", "seed", "victim", "moment", "outcome", "missing", "twice", "wall_s"]


def print_table(rows: list[dict[str, Any]]) -> None:
    """The campaign's table (benchmarks are CLIs: print is their output)."""
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path`` (none when it does not exist)."""
    return lineage.read_jsonl(path)


def main(argv: list[str] | None = None) -> int:
    """The campaign's CLI; exit code 0 when every run's outcome is ``ok``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--runs", type=int, default=30, help="runs in the campaign")
    p.add_argument("--seed", type=int, default=0, help="the campaign's seed (draws each run's)")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated run seeds to run instead (replay of given runs)",
    )
    p.add_argument(
        "--victims",
        default=",".join(VICTIMS),
        help=f"the processes a run may kill (default: {','.join(VICTIMS)})",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--timeout-s", type=float, default=480.0, help="seconds a run may take")
    p.add_argument(
        "--root", default=None, help="folder of the runs (default: a temp folder per campaign seed)"
    )
    p.add_argument(
        "--out",
        default=str(RESULTS / "fault_campaign.jsonl"),
        help="JSONL file the rows are appended to",
    )
    p.add_argument(
        "--md",
        default=str(RESULTS / "fault_campaign.md"),
        help="report written from the campaign's rows ('-': none)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs of this seed and commit already in --out",
    )
    p.add_argument("--keep", action="store_true", help="keep the folders of runs that were ok")
    p.add_argument("--plan", action="store_true", help="print the plan only")
    p.add_argument("--report", action="store_true",
                   help="run nothing: print the table and write --md from the rows in --out")  # fmt: skip
    args = p.parse_args(argv)  # fmt: skip

    victims = tuple(v for v in args.victims.split(",") if v)
    unknown = sorted(set(victims) - set(VICTIMS))
    if unknown:
        p.error(f"--victims: unknown {unknown}; choose from {','.join(VICTIMS)}")
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = run_seeds(args.seed, args.runs)
    plans = [plan_run(i, s, victims) for i, s in enumerate(seeds)]
    if args.plan:
        for plan in plans:
            print(f"{plan.index:3d}  {plan.seed:10d}  {plan.victim:9s}  {plan.moment}")
        return 0

    from benchmarks._common import commit, cpu_name

    # the probe of the collator's progress may find a loaded queue slow: not the run's problem
    logging.getLogger("services.queue.client").setLevel(logging.ERROR)

    out = Path(args.out)
    if args.report:  # the report of recorded rows: the newest commit that ran this campaign
        recorded = [r for r in read_rows(out) if _of_campaign(r, args, seeds)]
        if not recorded:
            p.error(f"--report: no rows of this campaign in {out}")
        return _report(args, out, seeds, recorded[-1]["commit"])
    info = {
        "campaign": args.seed if not args.seeds else None,
        "commit": commit(),
        "tree": tree_state(),
        "machine": cpu_name(),
        "jobs": args.jobs,
        "date": datetime.date.today().isoformat(),
        "command": "python " + shlex.join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
    }
    if args.resume:
        done = {r["run"] for r in read_rows(out)
                if _of_campaign(r, args, seeds) and r.get("commit") == info["commit"]}  # fmt: skip
        plans = [plan for plan in plans if plan.index not in done]
    root = Path(args.root or Path(tempfile.gettempdir()) / f"xtoken-faults-{args.seed}")
    root.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.build(root)
    lock = threading.Lock()
    rows: list[dict[str, Any]] = []

    def one(plan: Plan) -> None:
        if STOP.is_set():
            return
        row = {**run_one(plan, corpus, root, args.timeout_s), **info}
        if STOP.is_set():  # cut short by Ctrl-C: no outcome to record
            return
        with lock:
            rows.append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"[{len(rows)}/{len(plans)}] run {row['run']} seed {row['seed']} "
                  f"{row['victim']} at {row['moment']}: {row['outcome']} ({row['wall_s']} s)",
                  flush=True)  # fmt: skip
        if row["outcome"] == "ok" and not args.keep:
            shutil.rmtree(root / f"run{plan.index:03d}-{plan.seed}", ignore_errors=True)

    print(f"{len(plans)} runs, {args.jobs} at a time, in {root}", flush=True)
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        for future in [pool.submit(one, plan) for plan in plans]:
            while not future.done():
                time.sleep(0.5)
            future.result()
    except KeyboardInterrupt:
        STOP.set()
        print("stopping: the runs in flight end now", flush=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    print()
    return _report(args, out, seeds, info["commit"])


def _of_campaign(row: dict[str, Any], args: argparse.Namespace, seeds: list[int]) -> bool:
    return row.get("campaign") == (None if args.seeds else args.seed) and row.get("seed") in seeds


def _report(args: argparse.Namespace, out: Path, seeds: list[int], commit: str) -> int:
    """Print the table of the campaign's rows of ``commit`` (the latest row of each run) and
    write ``--md``; 0 when every run is ok."""
    latest = {r["run"]: r for r in read_rows(out)
              if _of_campaign(r, args, seeds) and r.get("commit") == commit}  # fmt: skip
    table = [latest[i] for i in sorted(latest)]
    print_table(table)
    if args.md != "-" and table:
        write_report(Path(args.md), table)
    return 0 if table and all(r["outcome"] == "ok" for r in table) else 1


def tree_state() -> str:
    """``clean``, or ``uncommitted changes`` when tracked files differ from the commit (what
    ran is then not the commit alone)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return "uncommitted changes" if out.strip() else "clean"


if __name__ == "__main__":
    sys.exit(main())
