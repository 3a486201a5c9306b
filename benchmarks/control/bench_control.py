"""Control plane: API latency while a run trains, SSE latency, dead-process detection, restart time
from a checkpoint, and the control plane's overhead on the trainer's step time.

Starts ``xtoken control serve`` (default tick 0.2 s) and real tiny runs (queue, collator, shm
teacher, trainer rank on the CPU), as a user does:

* ``GET /metrics`` and ``GET /v1/runs/{id}`` latency (p50 / p99 over ``--reps`` calls each) while a
  run trains;
* SSE: time from the trainer writing a step record to a subscriber receiving it;
* detection: SIGKILL of the teacher -> the supervisor's ``exited`` event;
* restart: SIGKILL of the trainer rank -> the new rank ready (checkpoint loaded) and its first step;
* overhead: the same run under ``xtoken run`` and under the control plane with a client polling
  ``/metrics`` + ``/v1/runs/{id}`` at ``--poll-hz`` and an SSE subscriber: median trainer step
  time of each (steps 4+), plus the control plane's own CPU time;
* ``--interleaved-texts N``: one run of N texts under the control plane, its clients switched on
  and off in alternating ``--window-s`` windows: the clients' share of the overhead without the
  run-to-run spread of the A/B pairs.
* ``--gpu``: the overhead runs (pairs and interleaved) train the qwen3-0.6b preset on CUDA (CE
  only, micro-batch 4 x 2048 tokens, no checkpoint but the last) on a corpus of equal long texts (16 kB slices of the stdlib's
  sources, truncated to the context by the collator), so every step does the same work and its
  time moves by a fraction of a percent: the spread that hid 0.5% in the tiny CPU runs is gone.
  Each figure comes with a 95% confidence interval (pairs: over the pair ratios; interleaved:
  over the differences of adjacent on/off windows).

    python benchmarks/control/bench_control.py [--texts 160] [--reps 500] [--pairs 2]
    python benchmarks/control/bench_control.py --gpu --skip-faults --pairs 3 --texts 400 \
        --interleaved-texts 400 --interleaved-epochs 3 --tokenizers qwen3 deepseek
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

ROOT = _common.ROOT
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ENV.pop("XTOKEN_PARENT_PID", None)


#: the run's tokenizer pair (``--tokenizers``); qwen3/deepseek need no teacher package installed
TOKENIZERS = ["mistral", "smollm2"]


def run_config(texts: int, run_dir: str | None = None) -> dict:
    """The tiny CPU run of the benchmark (1 trainer rank, 1 shm teacher, tiny models)."""
    config = {
        "student_tokenizer": TOKENIZERS[0],
        "teacher_tokenizer": TOKENIZERS[1],
        "ctx_student": 64,
        "ctx_teacher": 64,
        "trainers": 1,
        "teachers": 1,
        "restart_backoff_s": 0.0,
        "data": {"limit": texts},
        "collator": {"batch": 16},
        "teacher": {"model": "tiny", "transport": "shm", "max_batch": 4, "max_length": 64},
        "trainer": {
            "student": {"model": "tiny"},
            "feed": {"micro_batch": 4, "grad_accum": 1},
            "schedule": {"epochs": 1, "checkpoint_every": 5, "eval_every": 0, "export": False},
            "eval": {"texts": 2, "ctx": 64},
            "optim": {"lr": 0.003, "warmup_steps": 1},
        },
    }
    if GPU["on"]:  # a GPU-bound step: the 0.6B student preset on CUDA, CE only (no teacher)
        # 4 x 2048 tokens (8 x 2048 runs out of the H100's 80 GB): enough GPU work per step that the host's launch jitter is hidden
        config.update(ctx_student=2048, ctx_teacher=2048)  # CE: no teacher is started
        config["data"]["train"] = GPU["corpus"]
        trainer = config["trainer"]
        trainer.update(student={"model": "qwen3-0.6b"}, compute={"device": "cuda"})
        trainer["feed"]["micro_batch"] = 4
        trainer["loss"] = {"mode": "ce"}
        # a 0.6B checkpoint takes ~15 s: only the final one
        trainer["schedule"]["checkpoint_every"] = 1_000_000
    if run_dir:
        config["run_dir"] = run_dir
    return config


#: ``--gpu``: the GPU run config and its corpus of equal long texts (written by main)
GPU: dict = {"on": False, "corpus": None, "data_root": None}


def write_long_corpus(path: pathlib.Path, texts: int, size: int = 16384) -> None:
    """``texts`` JSONL texts of ``size`` bytes each, slices of the stdlib's Python sources: every
    one is longer than a 1024-token context in any tokenizer, so every step sees the same tokens."""
    import sysconfig

    source = "".join(
        f.read_text(errors="replace")
        for f in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    )
    with path.open("w") as out:
        for i in range(texts):
            start = (i * size) % max(1, len(source) - size)
            out.write(json.dumps({"text": source[start : start + size]}) + "\n")


def median_ratio_ci95(base: list[float], other: list[float], rounds: int = 4000) -> tuple:
    """``100 (median(other) / median(base) - 1)`` and its 95% bootstrap interval (both lists
    resampled with replacement ``rounds`` times; fixed seed)."""
    import random

    rng = random.Random(0)
    pct = [
        100 * (statistics.median(rng.choices(other, k=len(other)))
               / statistics.median(rng.choices(base, k=len(base))) - 1)
        for _ in range(rounds)
    ]  # fmt: skip
    pct.sort()
    point = 100 * (statistics.median(other) / statistics.median(base) - 1)
    return point, pct[int(0.025 * rounds)], pct[int(0.975 * rounds)]


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student t; 0 for one value)."""
    from statistics import mean, stdev

    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    n = len(values)
    if n < 2:
        return (values[0] if values else float("nan")), 0.0
    return mean(values), t95.get(n - 1, 2.0 if n < 60 else 1.96) * stdev(values) / n**0.5


class Server:
    """``xtoken control serve`` on a free port under ``root``."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        ready = root / "ready"
        ready.unlink(missing_ok=True)
        self.log = open(root / "control.log", "ab")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "control",
                "serve",
                "--port",
                "0",
                "--runs-root",
                str(root / "runs"),
                "--data-root",
                str(GPU["data_root"] or root / "data"),
                "--ready-file",
                str(ready),
            ],
            cwd=ROOT,
            env=ENV,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not ready.is_file():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "control.log").read_text()[-3000:])
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["endpoint"]

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far."""
        fields = pathlib.Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGTERM)
        self.popen.wait(30)
        self.log.close()


class SSE(threading.Thread):
    """Collects a run's events as (receive time, event)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[tuple[float, dict]] = []
        self.done = threading.Event()
        self.quit = threading.Event()  # leave at the next event (a subscriber that goes away)

    def run(self) -> None:
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=None)) as c,
            c.stream("GET", self.url) as r,
        ):
            for line in r.iter_lines():
                if self.quit.is_set():
                    break
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    self.events.append((time.time(), ev))
                    if ev["kind"] == "state" and ev["data"]["state"] in (
                        "SUCCEEDED",
                        "FAILED",
                        "STOPPED",
                    ):
                        break
        self.done.set()

    def steps(self) -> list[tuple[float, dict]]:
        return [
            (t, e["data"])
            for t, e in self.events
            if e["kind"] == "metrics" and e["data"]["kind"] == "step"
        ]


def wait(predicate, timeout_s: float, what: str, poll_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise RuntimeError(f"timed out waiting for {what}")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def measure_api_and_faults(root: pathlib.Path, texts: int, reps: int) -> dict:
    """Latency, SSE, detection and restart on one run of the control plane."""
    server = Server(root)
    out: dict = {}
    try:
        c = httpx.Client(base_url=server.url, timeout=30)
        rid = c.post("/v1/runs", json=run_config(texts)).json()["id"]
        sse = SSE(f"{server.url}/v1/runs/{rid}/events")
        sse.start()
        run = wait(
            lambda: (r := c.get(f"/v1/runs/{rid}").json()).get("step") and r, 300, "the first step"
        )
        run_dir = pathlib.Path(run["run_dir"])
        lat: dict[str, list[float]] = {"metrics": [], "run": []}
        app: dict[str, list[float]] = {"metrics": [], "run": []}
        for _ in range(reps):
            for name, path in (("metrics", "/metrics"), ("run", f"/v1/runs/{rid}")):
                t = time.perf_counter()
                r = c.get(path)
                lat[name].append((time.perf_counter() - t) * 1e3)
                assert r.status_code == 200
                app[name].append(float(r.headers["server-timing"].split("dur=")[1]))
        step_at_end = c.get(f"/v1/runs/{rid}").json()["step"]
        out.update(
            get_metrics_p50_ms=statistics.median(lat["metrics"]),
            get_metrics_p99_ms=pct(lat["metrics"], 0.99),
            get_run_p50_ms=statistics.median(lat["run"]),
            get_run_p99_ms=pct(lat["run"], 0.99),
            app_metrics_p50_ms=statistics.median(app["metrics"]),
            app_metrics_p99_ms=pct(app["metrics"], 0.99),
            app_run_p50_ms=statistics.median(app["run"]),
            app_run_p99_ms=pct(app["run"], 0.99),
            api_calls=2 * reps,
            api_during_steps=f"{run['step']}-{step_at_end}",
        )

        # detection: SIGKILL the teacher
        procs = {p["name"]: p for p in c.get(f"/v1/runs/{rid}/processes").json()["processes"]}
        t0 = time.time()
        os.kill(procs["teacher0"]["pid"], signal.SIGKILL)
        ev = wait(
            lambda: next(
                (
                    e
                    for _, e in sse.events
                    if e["kind"] == "exited" and e["data"]["process"] == "teacher0"
                ),
                None,
            ),
            30,
            "exited",
        )
        out["detect_dead_s"] = ev["time"] - t0

        # restart from the checkpoint: SIGKILL the trainer once a checkpoint exists
        wait(lambda: (run_dir / "checkpoints" / "latest").is_file(), 120, "a checkpoint")
        old = c.get(f"/v1/runs/{rid}/processes").json()["processes"]
        old_pid = {p["name"]: p["pid"] for p in old}["trainer0"]
        ready = run_dir / "ready" / "trainer0"
        t0 = time.time()
        os.kill(old_pid, signal.SIGKILL)

        def new_ready():
            try:
                info = json.loads(ready.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return None
            return info if info.get("pid") != old_pid else None

        info = wait(new_ready, 120, "the restarted trainer")
        t_ready = time.time()
        first = wait(
            lambda: next((t for t, s in sse.steps() if s["time"] > t_ready - 0.5 and t > t0), None),
            120,
            "a step after the restart",
        )
        ev = next(
            e for _, e in sse.events if e["kind"] == "exited" and e["data"]["process"] == "trainer0"
        )
        out.update(
            trainer_detect_s=ev["time"] - t0,
            restart_ready_s=t_ready - t0,
            restart_first_step_s=first - t0,
            resumed_from_step=info.get("step"),
        )
        wait(
            lambda: c.get(f"/v1/runs/{rid}").json()["state"] in ("SUCCEEDED", "FAILED"),
            600,
            "the end of the run",
        )
        assert c.get(f"/v1/runs/{rid}").json()["state"] == "SUCCEEDED"
        sse.done.wait(10)
        lags = [t - s["time"] for t, s in sse.steps()]
        out.update(sse_p50_s=statistics.median(lags), sse_max_s=max(lags), sse_steps=len(lags))
    finally:
        server.stop()
        _kill_runs(root / "runs" / "control.db")
    return out


def _kill_runs(db: pathlib.Path) -> None:
    import sqlite3

    if not db.is_file():
        return
    with sqlite3.connect(db) as conn:
        for (pid,) in conn.execute("SELECT pid FROM processes WHERE state = 'running'"):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, TypeError):
                pass


def step_times(run_dir: pathlib.Path) -> list[float]:
    out = []
    for line in (run_dir / "metrics" / "trainer.rank0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "step" and r["step"] > 3:
            out.append(r["step_s"])
    return out


def run_plain(root: pathlib.Path, texts: int, tag: str) -> list[float]:
    """The run under ``xtoken run`` (no control plane)."""
    run_dir = root / f"plain-{tag}"
    cfg = root / f"plain-{tag}.json"
    cfg.write_text(json.dumps(run_config(texts, str(run_dir))))
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(cfg), "--no-progress"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"xtoken run exited {done.returncode}: {done.stderr[-3000:]}")
    return step_times(run_dir)


def run_controlled(root: pathlib.Path, texts: int, tag: str, poll_hz: float) -> tuple:
    """The run under the control plane, polled at ``poll_hz`` and watched over SSE."""
    server = Server(root / f"cp-{tag}")
    try:
        c = httpx.Client(base_url=server.url, timeout=30)
        cpu0 = server.cpu_s()
        t0 = time.monotonic()
        rid = c.post("/v1/runs", json=run_config(texts)).json()["id"]
        sse = SSE(f"{server.url}/v1/runs/{rid}/events")
        sse.start()
        steady = None  # (cpu, time) at the first step: after prepare (tokenizers) and launch
        while True:
            if steady is None and sse.steps():
                steady = (server.cpu_s(), time.monotonic())
            c.get("/metrics")
            run = c.get(f"/v1/runs/{rid}").json()
            if run["state"] in ("SUCCEEDED", "FAILED"):
                break
            time.sleep(1 / poll_hz)
        assert run["state"] == "SUCCEEDED", run
        end = (server.cpu_s(), time.monotonic())
        steady_pct = 100 * (end[0] - steady[0]) / (end[1] - steady[1])
        wall = end[1] - t0
        return (step_times(pathlib.Path(run["run_dir"])), end[0] - cpu0, wall, steady_pct)
    finally:
        server.stop()
        _kill_runs(root / f"cp-{tag}" / "runs" / "control.db")


def measure_interleaved(
    root: pathlib.Path,
    texts: int,
    window_s: float,
    poll_hz: float,
    epochs: int = 1,
) -> dict:
    """The clients' share of the overhead inside one run: the same run under the control plane
    with its clients (``/metrics`` + ``/v1/runs/{id}`` at ``poll_hz`` and an SSE subscriber)
    switched on and off in alternating windows of ``window_s``; each step is put in the window
    that holds all of it. One run, one warm process set: no run-to-run spread in the A/B. The
    supervision itself (ticks, heartbeats) runs in both windows: its cost is the CPU figure."""
    server = Server(root)
    try:
        c = httpx.Client(base_url=server.url, timeout=30)
        config = run_config(texts)
        config["trainer"]["schedule"]["epochs"] = epochs  # a long steady run from a small corpus
        rid = c.post("/v1/runs", json=config).json()["id"]
        windows: list[tuple[float, float, bool]] = []
        on, state = True, "PENDING"
        while state not in ("SUCCEEDED", "FAILED"):
            t0 = time.time()
            sse = SSE(f"{server.url}/v1/runs/{rid}/events") if on else None
            if sse is not None:
                sse.start()
            while time.time() - t0 < window_s:
                if on:
                    c.get("/metrics")
                    state = c.get(f"/v1/runs/{rid}").json()["state"]
                    if state in ("SUCCEEDED", "FAILED"):
                        break
                time.sleep(1 / poll_hz)
            if sse is not None:  # the subscriber goes away with its window
                sse.quit.set()
                sse.join(5)
            windows.append((t0, time.time(), on))
            state = c.get(f"/v1/runs/{rid}").json()["state"] if not on else state
            on = not on
        run = c.get(f"/v1/runs/{rid}").json()
        assert run["state"] == "SUCCEEDED", run
        steps = [
            r for r in map(json.loads, (pathlib.Path(run["run_dir"]) / "metrics" /
                                        "trainer.rank0.jsonl").read_text().splitlines())
            if r.get("event") == "step" and r["step"] > 3
        ]  # fmt: skip
    finally:
        server.stop()
        _kill_runs(root / "runs" / "control.db")
    # seconds per token: the texts differ in length, so a step's time follows its tokens
    by_state: dict[bool, list[float]] = {True: [], False: []}
    by_window: list[list[float]] = [[] for _ in windows]
    for r in steps:
        # the step's own interval (its record is written once the next step is queued)
        start = r.get("started", r["time"] - r["step_s"])
        for i, (a, b, flag) in enumerate(windows):
            if a <= start and start + r["step_s"] <= b and r.get("tokens"):
                by_state[flag].append(r["step_s"] / r["tokens"])
                by_window[i].append(r["step_s"] / r["tokens"])
                break
    med_on, med_off = statistics.median(by_state[True]), statistics.median(by_state[False])
    # each "on" window against the mean of its "off" neighbours: a drift over the run cancels
    diffs = []
    for i, (_, _, flag) in enumerate(windows):
        near = [by_window[j] for j in (i - 1, i + 1) if 0 <= j < len(windows) and by_window[j]]
        if flag and by_window[i] and near:
            off = statistics.mean(statistics.median(w) for w in near)
            diffs.append(100 * (statistics.median(by_window[i]) / off - 1))
    mean_pct, ci_pct = mean_ci95(diffs)
    return {
        "interleaved_window_pcts": diffs,
        "interleaved_window_mean_pct": mean_pct,
        "interleaved_window_ci95_pct": ci_pct,
        "interleaved_windows": len(windows),
        "interleaved_window_s": window_s,
        "interleaved_steps_on_off": [len(by_state[True]), len(by_state[False])],
        "interleaved_us_per_token_on_off": [1e6 * med_on, 1e6 * med_off],
        "interleaved_client_overhead_pct": 100 * (med_on / med_off - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=160, help="texts per run (4 per step)")
    parser.add_argument("--reps", type=int, default=500, help="calls per endpoint")
    parser.add_argument("--pairs", type=int, default=2, help="plain/controlled run pairs")
    parser.add_argument("--poll-hz", type=float, default=2.0, help="client polling rate")
    parser.add_argument(
        "--tokenizers",
        nargs=2,
        default=TOKENIZERS,
        metavar=("STUDENT", "TEACHER"),
        help="tokenizer pair of the tiny runs",
    )
    parser.add_argument(
        "--interleaved-texts",
        type=int,
        default=0,
        help="also one long run with the clients on and off in alternating windows (0: skip)",
    )
    parser.add_argument("--window-s", type=float, default=5.0, help="interleaved window length")
    parser.add_argument("--interleaved-epochs", type=int, default=8, help="passes of that run")
    parser.add_argument(
        "--gpu",
        "--interleaved-gpu",
        action="store_true",
        help="the overhead runs train the qwen3-0.6b preset on CUDA (CE only) on equal long texts",
    )
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    TOKENIZERS[:] = args.tokenizers
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_control_"))
    (root / "data").mkdir()
    if args.gpu:
        GPU.update(on=True, corpus=str(root / "data" / "long.jsonl"), data_root=root / "data")
        write_long_corpus(root / "data" / "long.jsonl", max(args.texts, args.interleaved_texts))
    row: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _common.commit(),
        "device": _common.cpu_name(),
        "load_avg": os.getloadavg()[0],
        "texts": args.texts,
    }
    if not args.skip_faults:
        (root / "faults").mkdir()
        row.update(measure_api_and_faults(root / "faults", args.texts, args.reps))
    if not args.skip_overhead:
        plain, controlled, cpu, walls, steady = [], [], [], [], []
        per_plain: list[list[float]] = []
        per_controlled: list[list[float]] = []
        for i in range(args.pairs):
            (root / f"cp-{i}").mkdir()
            # alternate the order: a load that drifts over the pair does not favour one side
            for side in ("plain", "controlled") if i % 2 == 0 else ("controlled", "plain"):
                if side == "plain":
                    per_plain.append(run_plain(root, args.texts, str(i)))
                    plain += per_plain[-1]
                    print(
                        f"pair {i} plain: median step {statistics.median(per_plain[-1]):.4f} s",
                        flush=True,
                    )
                    continue
                s, c_s, wall, st = run_controlled(root, args.texts, str(i), args.poll_hz)
                print(f"pair {i} controlled: median step {statistics.median(s):.4f} s", flush=True)
                steady.append(st)
                controlled += s
                per_controlled.append(s)
                cpu.append(c_s)
                walls.append(wall)
        ratios = [
            statistics.median(c) / statistics.median(p) for p, c in zip(per_plain, per_controlled)
        ]
        p, q = statistics.median(plain), statistics.median(controlled)
        row.update(
            plain_step_median_s=p,
            controlled_step_median_s=q,
            overhead_pct=100 * (q - p) / p,
            plain_steps=len(plain),
            controlled_steps=len(controlled),
            control_cpu_s=sum(cpu),
            control_cpu_pct_of_one_core=100 * sum(cpu) / sum(walls),
            control_steady_cpu_pct_of_one_core=statistics.mean(steady),
            plain_step_medians=[statistics.median(x) for x in per_plain],
            controlled_step_medians=[statistics.median(x) for x in per_controlled],
            pair_ratios=ratios,
            median_pair_overhead_pct=100 * (statistics.median(ratios) - 1),
            pooled_median_overhead_pct_ci95=median_ratio_ci95(plain, controlled),
            mean_pair_overhead_pct=(m := mean_ci95([100 * (r - 1) for r in ratios]))[0],
            mean_pair_overhead_ci95_pct=m[1],
            gpu=args.gpu,
            poll_hz=args.poll_hz,
        )
    if args.interleaved_texts:
        (root / "interleaved").mkdir()
        row.update(
            measure_interleaved(
                root / "interleaved",
                args.interleaved_texts,
                args.window_s,
                args.poll_hz,
                args.interleaved_epochs,
            )
        )
    row["load_avg_end"] = os.getloadavg()[0]
    _common.append_rows(_common.RESULTS_DIR / "control.jsonl", [row])
    for k, v in row.items():
        print(f"{k:32s} {v:.4f}" if isinstance(v, float) else f"{k:32s} {v}")


if __name__ == "__main__":
    main()
