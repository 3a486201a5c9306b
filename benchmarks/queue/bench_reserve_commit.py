"""A capacity-sized shm reserve: its latency, the memory it commits, and an 8 MiB put into it.

One server (``--capacity 1GiB --shm-reserve-max 1GiB --shm-pool-free 0``: every reserve makes a
new segment, as the first reserve of a cold server does). Each round: reserve 1 GiB (timed,
while a second client pings the server with ``hello`` to see how long the event loop stalls),
read the segment's committed bytes (``st_blocks * 512`` of /dev/shm/<name>) and the server's
shared RSS, put 8 MiB into the reservation (timed), read the committed bytes again, clear.
Medians over the rounds.

    python benchmarks/queue/bench_reserve_commit.py [--rounds 5]

Appends one row to benchmarks/results/queue_reserve_commit.jsonl (``"bench": "queue_reserve_commit"``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "queue_reserve_commit.jsonl"
CAPACITY = 1 << 30
PUT_BYTES = 8 << 20


def _server(tmp: pathlib.Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"ready-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "queue", "serve"]
    cmd += ["--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready)]
    cmd += ["--capacity", "1GiB", "--shm-reserve-max", "1GiB", "--shm-pool-free", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError("queue server exited at start-up")
        time.sleep(0.02)
    return proc, json.loads(ready.read_text())["endpoint"]


def _committed(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def _rss_shmem(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return -1


def _pinger(address: str, stop: threading.Event, worst: list[float]) -> None:
    """Another client: hello round trips while the reserve runs; keeps the slowest."""
    from services.queue.client import QueueClient

    with QueueClient(address, timeout_s=60, name="bench-pinger") as other:
        other.hello()
        while not stop.is_set():
            t = time.perf_counter()
            other.hello()
            worst[0] = max(worst[0], time.perf_counter() - t)


def run(address: str, pid: int, rounds: int) -> dict:
    """Rounds of reserve + put; returns medians."""
    import torch

    from services.queue.client import QueueClient

    x = torch.ones(1, PUT_BYTES // 4)
    rows: list[dict] = []
    with QueueClient(address, timeout_s=60, shm_min_bytes=0, name="bench-producer") as client:
        client.hello()
        for r in range(rounds + 1):  # round 0 warms up the client's code paths
            stop, worst = threading.Event(), [0.0]
            pinger = threading.Thread(target=_pinger, args=(address, stop, worst))
            pinger.start()
            time.sleep(0.2)  # the pinger is connected and pinging
            t = time.perf_counter()
            region = client.reserve(CAPACITY, timeout_s=60)
            reserve_s = time.perf_counter() - t
            time.sleep(0.05)
            stop.set()
            pinger.join()
            # an fd, not the name: the server may copy a small put out and unlink the segment
            fd = os.open(os.path.join("/dev/shm", region.name), os.O_RDONLY)
            after_reserve = _committed(fd)
            rss_reserve = _rss_shmem(pid)
            t = time.perf_counter()
            client.put(f"rc{r}", ["a"], {"x": x}, reservation=region)
            put_s = time.perf_counter() - t
            after_put = _committed(fd)
            os.close(fd)
            client.clear(f"rc{r}")
            del region
            if r:
                rows.append(
                    {
                        "reserve_ms": reserve_s * 1e3,
                        "ping_max_ms": worst[0] * 1e3,
                        "committed_after_reserve": after_reserve,
                        "server_rss_shmem_after_reserve": rss_reserve,
                        "put_ms": put_s * 1e3,
                        "committed_after_put": after_put,
                    }
                )
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label", default="", help="a note for the row (e.g. before/after)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-reserve-"))
    proc, address = _server(tmp)
    try:
        result = run(address, proc.pid, args.rounds)
    finally:
        proc.terminate()
        proc.wait(10)
    commit = _common.commit()
    device = f"{_common.cpu_model(fallback='unknown')}, {os.cpu_count()} cores (CPU)"
    mib = 1 << 20
    table = "\n".join(
        [
            "| reserve 1 GiB (= --capacity) | reserve ms | max hello ms meanwhile | committed after "
            "reserve MiB | server RssShmem MiB | put 8 MiB ms | committed after put MiB |",
            "|---|---|---|---|---|---|---|",
            f"| {commit} {args.label} | {result['reserve_ms']:.2f} | {result['ping_max_ms']:.2f} "
            f"| {result['committed_after_reserve'] / mib:.1f} "
            f"| {result['server_rss_shmem_after_reserve'] / mib:.1f} | {result['put_ms']:.2f} "
            f"| {result['committed_after_put'] / mib:.1f} |",
        ]
    )
    print(f"\ncommit {commit} | {device} | {args.rounds} rounds (medians)")
    print(table)
    _common.append_rows(
        RESULTS,
        [
            {
                "bench": "queue_reserve_commit",
                "commit": commit,
                "label": args.label,
                "device": device,
                "shape": f"reserve {CAPACITY} bytes (= --capacity), put {PUT_BYTES} bytes into it",
                "rounds": args.rounds,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                **result,
            }
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
