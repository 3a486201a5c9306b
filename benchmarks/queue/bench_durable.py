"""Benchmark: the queue's durable mode (``--data-dir``) against memory mode, in one run.

* Put cost: W1 (64 samples, ~41 MB, frames over loopback TCP) and W2 (4,096 samples of ~20
  tokens in puts of 64) of bench_queue.py, the same phases, against a memory-mode server and a
  durable one (``--fsync interval``, the default; and ``--fsync always``), alternating servers
  per repetition so that the machine's drift hits every mode alike. Medians over all rounds.
* Recovery after SIGKILL: a server holding ``--recovery-mb`` of W1 puts plus a registered task
  that consumed half of 4,096 W2 samples is SIGKILLed and restarted on the same address (and
  ``--data-dir``); the time from the restart to the first answered request, the log replay time
  (from the server's log line), and what the new instance holds.

* ``--paired N`` (the put cost against memory mode): a memory-mode server, a durable one and a memory-mode
  one beside a stand-in process that does the log writer's work without the server (CRC32 and an
  append of one W2 put's 341 KB to a growing file, from 64 distinct buffers, then 0.6 ms of
  sleep, at the writer's nice 19) live together, and the W2 put and get phases (with ``--w1``,
  also a W1 put and get) go round-robin over them N rounds, so that the machine's load hits
  each alike; paired medians against memory mode, the log bytes written during the put phase (a
  writer that gets no CPU then moves its work into the acks of the get phase), the CPU of the
  log writer process (or the stand-in) during the put phase. One row is appended to
  queue_durable.jsonl (``"bench": "queue_durable_paired"``); the .md is left alone.

Usage:  python benchmarks/queue/bench_durable.py [--quick | --paired N [--w1]]
Rows are appended to benchmarks/results/queue_durable.jsonl; the table is written to
benchmarks/results/queue_durable.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402
import bench_queue  # noqa: E402
import workloads  # noqa: E402

RESULTS_JSONL = ROOT / "benchmarks" / "results" / "queue_durable.jsonl"
RESULTS_MD = ROOT / "benchmarks" / "results" / "queue_durable.md"
MODES = {
    "memory": (),
    "durable interval": ("--fsync", "interval"),
    "durable always": ("--fsync", "always"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``xtoken queue serve`` subprocess at a fixed address."""

    def __init__(self, tmp: pathlib.Path, address: str, args: tuple[str, ...]) -> None:
        from services.common.lifecycle import read_ready

        ready = tmp / f"ready-{time.monotonic_ns()}"
        self.log_path = tmp / f"server-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "services.cli", "queue", "serve", "--bind", address]
        cmd += ["--ready-file", str(ready), "--capacity", "8GiB", *args]
        self.started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while read_ready(ready) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"queue server exited: {self.log_path.read_text()}")
            time.sleep(0.01)
        self.address = address

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def replay_s(self) -> float | None:
        m = re.search(r"records of .* in ([0-9.]+)s", self.log_path.read_text())
        return float(m.group(1)) if m else None


def put_cost(tmp: pathlib.Path, reps: int, rounds: int, w2_reps: int) -> dict:
    """W1 and W2 put/get times per mode, servers alternating per repetition."""
    from services.queue.client import QueueClient

    out: dict[str, dict[str, list[float]]] = {
        m: {"w1_put": [], "w1_get": [], "w2_put": [], "w2_get": []} for m in MODES
    }
    for rep in range(reps):
        for mode, args in MODES.items():
            data = tmp / f"data-{rep}-{mode.replace(' ', '-')}"
            extra = (*args, "--data-dir", str(data)) if args else ()
            server = Server(tmp, f"tcp://127.0.0.1:{_free_port()}", extra)
            try:
                with QueueClient(server.address, timeout_s=120, shm="never") as client:
                    client.hello()
                    w1 = bench_queue._w1_phase(client, rounds, seed=rep)
                    w2 = bench_queue._w2_phase(client, w2_reps)
            finally:
                server.stop()
                shutil.rmtree(data, ignore_errors=True)
            out[mode]["w1_put"] += w1["put_s"]
            out[mode]["w1_get"] += w1["get_s"]
            out[mode]["w2_put"] += w2["put_s"]
            out[mode]["w2_get"] += w2["get_s"]
            print(f"[bench] rep {rep} {mode}: done", flush=True)
    nbytes = workloads.nbytes(bench_queue._w1(0))
    summary = {}
    for mode, t in out.items():
        summary[mode] = {
            "w1_put_mb_s": nbytes / statistics.median(t["w1_put"]) / 1e6,
            "w1_get_mb_s": nbytes / statistics.median(t["w1_get"]) / 1e6,
            "w2_put_samples_s": workloads.W2_SAMPLES / statistics.median(t["w2_put"]),
            "w2_get_samples_s": workloads.W2_SAMPLES / statistics.median(t["w2_get"]),
            "w1_put_ms": statistics.median(t["w1_put"]) * 1e3,
            "w2_put_ms": statistics.median(t["w2_put"]) * 1e3,
        }
    return summary


# The stand-in for the log writer's work, in its own process: CRC32 and an append of 341 KB (one
# W2 put) from 64 distinct buffers (a log's data is not in the cache), truncated every ~1 GB.
_STAND_IN = """
import os, sys, time, zlib
bufs, n = [memoryview(os.urandom(341_000)) for _ in range(64)], 0
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.nice(19)  # as the log writer
while True:
    buf = bufs[n % 64]
    zlib.crc32(buf)
    os.write(fd, buf)
    n += 1
    if n % 3000 == 0:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
    time.sleep(0.0006)
"""


def _cpu_ms(pid: int) -> float:
    """On-CPU milliseconds of all threads of ``pid`` (/proc schedstat)."""
    total = 0.0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0]) / 1e6
        except (OSError, ValueError):
            continue
    return total


def _children(pid: int) -> list[int]:
    return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _written(pid: int | None) -> int:
    """Bytes ``pid`` wrote so far (its log writes, snapshots included: /proc io wchar)."""
    if pid is None:
        return 0
    for line in pathlib.Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no wchar for pid {pid}")


def paired(tmp: pathlib.Path, rounds: int, w1: bool) -> dict:
    """W2 (and W1) put and get phases round-robin over live servers (the module docstring)."""
    from services.queue.client import QueueClient

    modes = {"memory": (), "durable interval": ("--data-dir", str(tmp / "paired")), "stand-in": ()}
    batches = [workloads.jagged(b) for b in bench_queue._w2_batches()]
    w1_fields = workloads.jagged(bench_queue._w1(0))
    w1_keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    n = workloads.W2_BATCH
    servers, clients, stand_in = {}, {}, None
    keys = ("put", "get", "log_mb", "writer_cpu_ms", "w1_put", "w1_get", "w1_log_mb")
    res = {m: {k: [] for k in keys} for m in modes}
    try:
        for mode, args in modes.items():
            servers[mode] = Server(tmp, f"tcp://127.0.0.1:{_free_port()}", args)
            clients[mode] = QueueClient(servers[mode].address, timeout_s=120, shm="never")
            clients[mode].hello()
        (writer,) = _children(servers["durable interval"].proc.pid)
        stand_in = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(tmp / "stand-in")])
        os.kill(stand_in.pid, signal.SIGSTOP)
        for r in range(rounds + 1):  # round 0 warms up
            for mode, client in clients.items():
                out = res[mode] if r else {k: [] for k in keys}
                if mode == "stand-in":
                    os.kill(stand_in.pid, signal.SIGCONT)
                pid = {"stand-in": stand_in.pid, "durable interval": writer}.get(mode)
                log0, cpu0 = _written(pid), _cpu_ms(pid) if pid else 0.0
                t = time.perf_counter()
                for b, fields in enumerate(batches):
                    client.put(f"p{r}", [f"b{b}-{j}" for j in range(n)], fields)
                out["put"].append(time.perf_counter() - t)
                out["writer_cpu_ms"].append(_cpu_ms(pid) - cpu0 if pid else 0.0)
                out["log_mb"].append((_written(pid) - log0) / 1e6)
                t = time.perf_counter()
                for _ in batches:
                    got = client.claim(f"p{r}", "bench", bench_queue.FIELDS, n, timeout_s=5)
                    client.ack(f"p{r}", "bench", got["lease_id"])
                out["get"].append(time.perf_counter() - t)
                client.clear(f"p{r}")
                if w1:
                    log0 = _written(pid)
                    t = time.perf_counter()
                    client.put(f"w1_{r}", w1_keys, w1_fields)
                    out["w1_put"].append(time.perf_counter() - t)
                    out["w1_log_mb"].append((_written(pid) - log0) / 1e6)
                    t = time.perf_counter()
                    got = client.claim(
                        f"w1_{r}", "bench", bench_queue.FIELDS, len(w1_keys), timeout_s=5
                    )
                    client.ack(f"w1_{r}", "bench", got["lease_id"])
                    out["w1_get"].append(time.perf_counter() - t)
                    del got
                    client.clear(f"w1_{r}")
                if mode == "stand-in":
                    os.kill(stand_in.pid, signal.SIGSTOP)
    finally:
        if stand_in is not None:
            stand_in.kill()
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
    out = {}
    base = res["memory"]

    def vs_memory(mode: str, key: str) -> float:
        return statistics.median(a / b for a, b in zip(res[mode][key], base[key])) - 1

    for mode, r in res.items():
        total = [p + g for p, g in zip(r["put"], r["get"])]
        base_total = [p + g for p, g in zip(base["put"], base["get"])]
        out[mode] = {
            "w2_put_ms": statistics.median(r["put"]) * 1e3,
            "w2_get_ms": statistics.median(r["get"]) * 1e3,
            "put_vs_memory": vs_memory(mode, "put"),
            "get_vs_memory": vs_memory(mode, "get"),
            "put_get_vs_memory": statistics.median(a / b for a, b in zip(total, base_total)) - 1,
            "log_mb_during_put": statistics.median(r["log_mb"]),
            "writer_cpu_ms_during_put": statistics.median(r["writer_cpu_ms"]),
        }
        if w1:
            out[mode].update(
                w1_put_ms=statistics.median(r["w1_put"]) * 1e3,
                w1_get_ms=statistics.median(r["w1_get"]) * 1e3,
                w1_put_vs_memory=vs_memory(mode, "w1_put"),
                w1_get_vs_memory=vs_memory(mode, "w1_get"),
                w1_log_mb_during_put=statistics.median(r["w1_log_mb"]),
            )
    return out


def recovery(tmp: pathlib.Path, mode: str, recovery_mb: int) -> dict:
    """Load a server, SIGKILL it, restart it on the same address; time the way back."""
    from services.queue.client import QueueClient

    address = f"tcp://127.0.0.1:{_free_port()}"
    data = tmp / f"recovery-{mode.replace(' ', '-')}"
    args = (*MODES[mode], "--data-dir", str(data)) if MODES[mode] else ()
    server = Server(tmp, address, args)
    stored, i = 0, 0
    with QueueClient(address, timeout_s=120, shm="never") as client:
        while stored < recovery_mb * 1e6:
            cols = bench_queue._w1(100 + i)
            keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
            client.put(f"w1_{i}", keys, workloads.jagged(cols))
            stored += workloads.nbytes(cols)
            i += 1
        for b, batch in enumerate(bench_queue._w2_batches()):
            client.put(
                "w2", [f"b{b}-{j}" for j in range(workloads.W2_BATCH)], workloads.jagged(batch)
            )
        for _ in range(workloads.W2_SAMPLES // workloads.W2_BATCH // 2):
            got = client.claim("w2", "train", bench_queue.FIELDS, workloads.W2_BATCH, register=True)
            client.ack("w2", "train", got["lease_id"])
        before = client.stats()
    log_bytes = sum(f.stat().st_size for f in data.glob("log.*")) if MODES[mode] else 0
    server.kill()
    t0 = time.perf_counter()
    server = Server(tmp, address, args)
    ready_s = time.perf_counter() - t0
    try:
        with QueueClient(address, timeout_s=120, shm="never") as client:
            after = client.stats()
            answered_s = time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    return {
        "mode": mode,
        "stored_bytes_before": before["bytes_used"],
        "samples_before": before["samples"],
        "log_bytes": log_bytes,
        "restart_to_ready_s": ready_s,
        "restart_to_answer_s": answered_s,
        "replay_s": server.replay_s(),
        "samples_after": after["samples"],
        "stored_bytes_after": after["bytes_used"],
    }


def _table(cost: dict, rec: list[dict]) -> str:
    base = cost["memory"]
    lines = [
        "| metric | memory | durable interval | durable always |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("w1_put_mb_s", "W1 put MB/s (frames, TCP)"),
        ("w1_get_mb_s", "W1 get (claim + ack) MB/s"),
        ("w2_put_samples_s", "W2 put samples/s"),
        ("w2_get_samples_s", "W2 get (claim + ack) samples/s"),
    ):
        cells = [f"{base[key]:.1f}"]
        for mode in ("durable interval", "durable always"):
            v = cost[mode][key]
            cells.append(f"{v:.1f} ({base[key] / v - 1:+.0%} time)")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        "| after SIGKILL | stored before | log bytes | restart -> ready s | restart -> first "
        "answer s | log replay s | samples before -> after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rec:
        replay = f"{r['replay_s']:.3f}" if r["replay_s"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['stored_bytes_before'] / 1e6:.0f} MB | {r['log_bytes'] / 1e6:.0f} MB "
            f"| {r['restart_to_ready_s']:.2f} | {r['restart_to_answer_s']:.2f} | {replay} "
            f"| {r['samples_before']} -> {r['samples_after']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, less data")
    parser.add_argument("--reps", type=int, default=None, help="servers per mode")
    parser.add_argument("--recovery-mb", type=int, default=None)
    parser.add_argument(
        "--paired", type=int, default=0, metavar="N", help="only the paired W2 rounds (N)"
    )
    parser.add_argument("--w1", action="store_true", help="--paired: W1 rounds too")
    parser.add_argument("--note", default="", help="free text stored with the --paired row")
    args = parser.parse_args()
    if args.paired:
        return _paired_main(args.paired, args.w1, args.note)
    reps = args.reps or (1 if args.quick else 3)
    rounds = 3 if args.quick else 5
    w2_reps = 1 if args.quick else 2
    recovery_mb = args.recovery_mb or (100 if args.quick else 500)
    import torch

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-durable-"))
    try:
        cost = put_cost(tmp, reps, rounds, w2_reps)
        rec = [recovery(tmp, m, recovery_mb) for m in ("memory", "durable interval")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    commit = _common.commit()
    device = f"{_common.cpu_model(fallback='unknown')}, {os.cpu_count()} cores (CPU VM, ext4 disk)"
    table = _table(cost, rec)
    head = (
        f"commit {commit} | {device} | {reps} server(s) per mode x W1 {rounds} rounds, "
        f"W2 {w2_reps} reps (medians) | recovery with {recovery_mb} MB of W1 + 4,096 W2 samples"
    )
    print()
    print(head)
    print(table)
    row = {
        "bench": "queue_durable",
        "commit": commit,
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "reps": reps,
        "rounds": rounds,
        "put_cost": cost,
        "recovery": rec,
    }
    _common.append_rows(RESULTS_JSONL, [row])
    if not args.quick:
        notes = ""
        if RESULTS_MD.exists() and "\n## Notes" in RESULTS_MD.read_text(encoding="utf-8"):
            text = RESULTS_MD.read_text(encoding="utf-8")
            notes = "\n" + text[text.index("\n## Notes") :].lstrip("\n")
        RESULTS_MD.write_text(
            f"# Queue durable mode (benchmarks/queue/bench_durable.py)\n\n{head}\n\n{table}{notes}",
            encoding="utf-8",
        )
    return 0


def _paired_main(rounds: int, w1: bool, note: str) -> int:
    import torch

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-durable-"))
    load0 = os.getloadavg()
    try:
        out = paired(tmp, rounds, w1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    commit = _common.commit()
    cores = len(os.sched_getaffinity(0))
    device = f"{_common.cpu_model(fallback='unknown')}, {cores} of {os.cpu_count()} cores"
    print(
        f"\ncommit {commit} | {device} | {rounds} paired rounds | "
        f"load {load0[0]:.2f} -> {load1[0]:.2f}"
    )
    print(
        "| W2 | put ms | put vs memory | get ms | get vs memory | put+get vs memory "
        "| log MB written during put | log writer (stand-in) CPU ms during put |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in out.items():
        label = "memory + stand-in writer process" if mode == "stand-in" else mode
        print(
            f"| {label} | {r['w2_put_ms']:.1f} | {r['put_vs_memory']:+.0%} | {r['w2_get_ms']:.1f} "
            f"| {r['get_vs_memory']:+.0%} | {r['put_get_vs_memory']:+.0%} "
            f"| {r['log_mb_during_put']:.1f} | {r['writer_cpu_ms_during_put']:.1f} |"
        )
    if w1:
        print(
            "\n| W1 | put ms | put vs memory | get ms | get vs memory | log MB written during put |"
        )
        print("|---|---|---|---|---|---|")
        for mode, r in out.items():
            label = "memory + stand-in writer process" if mode == "stand-in" else mode
            print(
                f"| {label} | {r['w1_put_ms']:.1f} | {r['w1_put_vs_memory']:+.0%} "
                f"| {r['w1_get_ms']:.1f} | {r['w1_get_vs_memory']:+.0%} "
                f"| {r['w1_log_mb_during_put']:.1f} |"
            )
    row = {
        "bench": "queue_durable_paired",
        "commit": commit,
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rounds": rounds,
        "loadavg_start": load0,
        "loadavg_end": load1,
        "note": note,
        "w2": out,
    }
    _common.append_rows(RESULTS_JSONL, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
