"""W1 put/get through the queue: the shared-memory pool vs frames (tcp://127.0.0.1 and ipc://) vs raw pyzmq.

Workload W1 of workloads.py (64 samples, L ~ U[512, 4096], int64 [L] + float32 [L, 64], ~41 MB
per put). Each round: one put of the 64 samples (timed), one claim of all 64 + ack (timed;
frames in the frames modes, views of the pool with ``shm=True`` in the shm modes), clear.
Median over the rounds after a warm-up round. The raw pyzmq floor is bench_queue.bench_raw
(multipart sends of the same buffers over loopback TCP).

    python benchmarks/queue/bench_shm_put.py [--rounds 10]

Appends one row to benchmarks/results/queue.jsonl (``"bench": "queue_shm"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "queue.jsonl"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        name, pathlib.Path(__file__).parent / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


workloads = _load("workloads")
bench_queue = _load("bench_queue")


def _server(bind: str, tmp: pathlib.Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"ready-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "queue", "serve"]
    cmd += ["--bind", bind, "--ready-file", str(ready), "--capacity", "8GiB"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError("queue server exited at start-up")
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())["endpoint"]


def run_mode(address: str, shm: str, rounds: int, seed: int) -> dict:
    """W1 rounds against one server with one client shm mode; returns medians in MB/s."""
    import torch

    from services.queue.client import QueueClient

    cols = bench_queue._w1(seed)
    fields = workloads.jagged(cols)
    nbytes = workloads.nbytes(cols)
    keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    put_s, get_s = [], []
    with QueueClient(address, timeout_s=60, shm=shm) as client:
        client.hello()
        for r in range(rounds + 1):  # round 0 warms up
            part = f"w1_{shm}_{r}"
            t = time.perf_counter()
            client.put(part, keys, fields)
            put = time.perf_counter() - t
            t = time.perf_counter()
            got = client.claim(
                part,
                "bench",
                workloads.FIELDS,
                workloads.W1_SAMPLES,
                timeout_s=5,
                shm=shm == "always",
            )
            client.ack(part, "bench", got["lease_id"])
            get = time.perf_counter() - t
            if r == 0:
                assert torch.equal(got["fields"]["hidden"].values, cols["hidden"][0])
            else:
                put_s.append(put)
                get_s.append(get)
            del got
            client.clear(part)
        used_shm = client._shm.puts
    return {
        "shm": shm,
        "shm_puts": used_shm,
        "put_mb_s": nbytes / statistics.median(put_s) / 1e6,
        "get_mb_s": nbytes / statistics.median(get_s) / 1e6,
        "put_ms_p50": statistics.median(put_s) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-shm-"))
    results: dict[str, dict] = {}
    for transport, bind in (("tcp", "tcp://127.0.0.1:*"), ("ipc", f"ipc://{tmp}/q.sock")):
        proc, address = _server(bind, tmp)
        try:
            for shm in ("never", "always"):
                name = f"{transport} {'shm' if shm == 'always' else 'frames'}"
                print(f"[bench] {name}", flush=True)
                results[name] = run_mode(address, shm, args.rounds, args.seed)
        finally:
            proc.terminate()
            proc.wait(10)
    print("[bench] raw pyzmq (tcp)", flush=True)
    raw = bench_queue._summarize(bench_queue.bench_raw(args.rounds, 1, 50, args.seed))
    raw_put, raw_get = raw["w1_put_mb_s"], raw["w1_get_mb_s"]

    commit = _common.commit()
    device = f"{_common.cpu_model(fallback='unknown')}, {os.cpu_count()} cores (CPU)"
    nbytes = workloads.nbytes(bench_queue._w1(args.seed))
    lines = [
        "| W1 (41 MB / put) | put MB/s | put ms | get (claim+fetch) MB/s | put / raw "
        "| put / tcp frames |",
        "|---|---|---|---|---|---|",
    ]
    base = results["tcp frames"]["put_mb_s"]
    for name, r in results.items():
        lines.append(
            f"| xtoken {name} | {r['put_mb_s']:.1f} | {r['put_ms_p50']:.1f} | {r['get_mb_s']:.1f} "
            f"| {r['put_mb_s'] / raw_put:.2f}x | {r['put_mb_s'] / base:.2f}x |"
        )
    lines.append(f"| raw pyzmq tcp | {raw_put:.1f} | - | {raw_get:.1f} | 1.00x | - |")
    table = "\n".join(lines)
    print(f"\ncommit {commit} | {device} | {args.rounds} rounds | W1 {nbytes / 1e6:.1f} MB")
    print(table)
    row = {
        "bench": "queue_shm",
        "commit": commit,
        "device": device,
        "shape": f"W1 {workloads.W1_SAMPLES} samples, {nbytes / 1e6:.1f} MB per put",
        "rounds": args.rounds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "xtoken": results,
        "raw_pyzmq": {"w1_put_mb_s": raw_put, "w1_get_mb_s": raw_get},
        "ratios": {
            "shm_put_vs_raw": results["tcp shm"]["put_mb_s"] / raw_put,
            "shm_put_vs_tcp_frames": results["tcp shm"]["put_mb_s"] / base,
        },
    }
    _common.append_rows(RESULTS, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
