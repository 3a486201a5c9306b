"""Profile the queue's hot path: claim round trip, W2 small puts/gets, W1 large puts/gets.

One server process (``xtoken queue serve``, optionally under cProfile) and one client process
(this one) on loopback TCP, plus a raw pyzmq ROUTER in a second process as the floor of the same
process pair. Prints one table and appends one row to
``benchmarks/results/queue_hot_path.jsonl``.

Phases (each on its own partition):
  claim1      claim(batch 1) of a ready sample with one 20-token int64 jagged field, then ack;
              p50/p99 of the claim alone and of claim + ack
  claim2      as bench_queue.py: batch 1 with input_ids [L] int64 + hidden [L, 64] float32
  w2          4,096 samples of ~20 tokens, puts and claims(+ack) of 64: samples/s
  w1          64 samples, L ~ U[512, 4096], int64 [L] + float32 [L, 64]: put and get MB/s
  raw         raw pyzmq tiny round trip and the W1/W2 bytes as multipart frames
  codec       in-process encode/decode of the claim1 reply (no sockets)
  w1pair      W1 through the queue and through raw pyzmq alternately, round by round: ratios

Usage:
  python benchmarks/queue/profile_hot_path.py [--iters 2000] [--rounds 7]
      [--profile-server out.prof] [--profile-client out.prof] [--phases claim1,w2]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pathlib
import pstats
import signal
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
import workloads  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "queue_hot_path.jsonl"
ALL_PHASES = ("codec", "raw", "claim1", "claim2", "w2", "w1", "w1pair")


def _commit() -> str:
    """Short commit, with ``+dirty`` when services/queue or xtoken_core/wire has changes."""
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "services/queue", "xtoken_core/wire"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    except OSError:
        return "unknown"
    return _common.commit() + ("+dirty" if dirty.stdout.strip() else "")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ----------------------------------------------------------------------------- server


class Server:
    """`xtoken queue serve` subprocess, optionally under cProfile (stopped by SIGTERM)."""

    def __init__(self, profile: str | None, extra: list[str]) -> None:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="hot-path-"))
        ready = tmp / "ready"
        cmd = [sys.executable]
        if profile:
            cmd += ["-m", "cProfile", "-o", profile]
        cmd += ["-m", "services.cli", "--log-level", "WARNING", "queue", "serve"]
        cmd += ["--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready), "--capacity", "8GiB"]
        cmd += extra
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError("queue server exited at start-up")
            time.sleep(0.02)
        self.address = json.loads(ready.read_text())["endpoint"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


# ----------------------------------------------------------------------------- phases


def phase_claim(client, iters: int, fields: tuple[str, ...]) -> dict:
    cols = workloads.columns(workloads.lengths(iters + 50, 20, 20, 7), 7)
    cols = {k: v for k, v in cols.items() if k in fields}
    part = f"claim-{len(fields)}-{time.monotonic_ns()}"
    client.put(part, [f"s{j}" for j in range(iters + 50)], workloads.jagged(cols))
    for _ in range(50):  # warm-up
        got = client.claim(part, "t", list(fields), 1, timeout_s=5)
        client.ack(part, "t", got["lease_id"])
    claim_s, both_s = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        got = client.claim(part, "t", list(fields), 1, timeout_s=5)
        t1 = time.perf_counter()
        client.ack(part, "t", got["lease_id"])
        t2 = time.perf_counter()
        claim_s.append(t1 - t0)
        both_s.append(t2 - t0)
    assert len(got["keys"]) == 1
    client.clear(part)
    return {
        "claim_p50_ms": _pct(claim_s, 50) * 1e3,
        "claim_p99_ms": _pct(claim_s, 99) * 1e3,
        "claim_ack_p50_ms": _pct(both_s, 50) * 1e3,
        "claim_ack_p99_ms": _pct(both_s, 99) * 1e3,
    }


def _w2_batches():
    return [
        workloads.jagged(
            workloads.columns(
                workloads.lengths(
                    workloads.W2_BATCH, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 1000 + b
                ),
                1000 + b,
            )
        )
        for b in range(workloads.W2_SAMPLES // workloads.W2_BATCH)
    ]


def phase_w2(client, rounds: int) -> dict:
    batches = _w2_batches()
    n = workloads.W2_BATCH
    fields = list(workloads.FIELDS)
    put_sps, get_sps = [], []
    for r in range(rounds):
        part = f"w2-{r}"
        t = time.perf_counter()
        for b, cols in enumerate(batches):
            client.put(part, [f"b{b}-{j}" for j in range(n)], cols)
        put_sps.append(workloads.W2_SAMPLES / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in batches:
            got = client.claim(part, "t", fields, n, timeout_s=5)
            client.ack(part, "t", got["lease_id"])
        get_sps.append(workloads.W2_SAMPLES / (time.perf_counter() - t))
        client.clear(part)
    return {
        "put_samples_s": statistics.median(put_sps),
        "get_samples_s": statistics.median(get_sps),
    }


def phase_w1(client, rounds: int) -> dict:
    lens = workloads.lengths(workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, 0)
    cols = workloads.columns(lens, 0)
    nbytes = workloads.nbytes(cols)
    fields = workloads.jagged(cols)
    keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    put_s, get_s = [], []
    for r in range(rounds):
        part = f"w1-{r}"
        t = time.perf_counter()
        client.put(part, keys, fields)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = client.claim(part, "t", list(workloads.FIELDS), workloads.W1_SAMPLES, timeout_s=5)
        client.ack(part, "t", got["lease_id"])
        get_s.append(time.perf_counter() - t)
        del got
        client.clear(part)
    return {
        "nbytes": nbytes,
        "put_mb_s": nbytes / statistics.median(put_s) / 1e6,
        "get_mb_s": nbytes / statistics.median(get_s) / 1e6,
    }


def phase_w1pair(client, rounds: int) -> dict:
    """W1 put/get, each round also through the raw pyzmq pair (same moment, same bytes)."""
    import zmq

    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_raw_server, args=(child,), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(parent.recv())
    lens = workloads.lengths(workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, 0)
    cols = workloads.columns(lens, 0)
    nbytes = workloads.nbytes(cols)
    fields = workloads.jagged(cols)
    frames = [memoryview(t.numpy()) for pair in cols.values() for t in pair]
    keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    t_s: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": []}
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        sock.send_multipart([b"put", *frames], copy=False)
        sock.recv_multipart()
        t1 = time.perf_counter()
        sock.send(b"get")
        sock.recv_multipart(copy=False)
        t2 = time.perf_counter()
        client.put(f"w1p-{r}", keys, fields)
        t3 = time.perf_counter()
        got = client.claim(f"w1p-{r}", "t", list(workloads.FIELDS), len(keys), timeout_s=5)
        client.ack(f"w1p-{r}", "t", got["lease_id"])
        t4 = time.perf_counter()
        del got
        client.clear(f"w1p-{r}")
        if r:  # round 0 warms both up
            t_s["raw_put"].append(t1 - t0)
            t_s["raw_get"].append(t2 - t1)
            t_s["put"].append(t3 - t2)
            t_s["get"].append(t4 - t3)
    sock.send(b"stop")
    sock.recv()
    sock.close()
    proc.join(10)
    med = {k: statistics.median(v) for k, v in t_s.items()}
    return {
        "put_mb_s": nbytes / med["put"] / 1e6,
        "raw_put_mb_s": nbytes / med["raw_put"] / 1e6,
        "put_over_raw": med["raw_put"] / med["put"],
        "get_mb_s": nbytes / med["get"] / 1e6,
        "raw_get_mb_s": nbytes / med["raw_get"] / 1e6,
        "get_over_raw": med["raw_get"] / med["get"],
    }


def _raw_server(conn) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    kept: list = []
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, op = frames[0], frames[1].bytes
        if op == b"ping":
            sock.send_multipart([ident, b"pong"])
        elif op == b"put":
            kept.append(frames[2:])
            sock.send_multipart([ident, b"ok"])
        elif op == b"get":
            sock.send_multipart([ident, *kept.pop(0)], copy=False)
        else:
            sock.send_multipart([ident, b"bye"])
            break
    sock.close()
    ctx.term()


def phase_raw(iters: int, rounds: int) -> dict:
    import zmq

    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_raw_server, args=(child,), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(parent.recv())

    def put(frames):
        sock.send_multipart([b"put", *frames], copy=False)
        sock.recv_multipart()

    def get():
        sock.send(b"get")
        return sock.recv_multipart(copy=False)

    def frames_of(cols):
        out = []
        for values, offsets in cols.values():
            out += [memoryview(values.numpy()), memoryview(offsets.numpy())]
        return out

    lat = []
    for i in range(iters + 50):
        t = time.perf_counter()
        sock.send(b"ping")
        sock.recv()
        if i >= 50:
            lat.append(time.perf_counter() - t)
    lens = workloads.lengths(workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, 0)
    cols = workloads.columns(lens, 0)
    nbytes = workloads.nbytes(cols)
    frames = frames_of(cols)
    put(frames)
    get()
    put_s, get_s = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        put(frames)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        get()
        get_s.append(time.perf_counter() - t)
    w2 = [
        frames_of(
            workloads.columns(
                workloads.lengths(
                    workloads.W2_BATCH, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, b
                ),
                b,
            )
        )
        for b in range(workloads.W2_SAMPLES // workloads.W2_BATCH)
    ]
    t = time.perf_counter()
    for fr in w2:
        put(fr)
    w2_put = workloads.W2_SAMPLES / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in w2:
        get()
    w2_get = workloads.W2_SAMPLES / (time.perf_counter() - t)
    sock.send(b"stop")
    sock.recv()
    sock.close()
    proc.join(10)
    return {
        "ping_p50_ms": _pct(lat, 50) * 1e3,
        "ping_p99_ms": _pct(lat, 99) * 1e3,
        "w1_put_mb_s": nbytes / statistics.median(put_s) / 1e6,
        "w1_get_mb_s": nbytes / statistics.median(get_s) / 1e6,
        "w2_put_samples_s": w2_put,
        "w2_get_samples_s": w2_get,
    }


def phase_codec(iters: int) -> dict:
    """In-process encode + decode of a claim1-like reply (no sockets)."""
    import torch

    from xtoken_core.wire import JaggedColumn, decode_message, encode_message

    body = {
        "keys": ["s17"],
        "fields": {
            "input_ids": JaggedColumn(
                torch.arange(20, dtype=torch.int64), torch.tensor([0, 20], dtype=torch.int64)
            )
        },
        "lease_id": 123,
    }
    enc, dec = [], []
    for i in range(iters + 50):
        t0 = time.perf_counter()
        frames = encode_message("reply", body, request_id=i)
        t1 = time.perf_counter()
        decode_message(frames, jagged="column")
        t2 = time.perf_counter()
        if i >= 50:
            enc.append(t1 - t0)
            dec.append(t2 - t1)
    return {"encode_p50_us": _pct(enc, 50) * 1e6, "decode_p50_us": _pct(dec, 50) * 1e6}


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="claim round trips per phase")
    parser.add_argument("--rounds", type=int, default=7, help="W1/W2 rounds (median)")
    parser.add_argument("--phases", default=",".join(ALL_PHASES), help="comma-separated")
    parser.add_argument("--profile-server", default=None, help="write the server's cProfile here")
    parser.add_argument("--profile-client", default=None, help="write the client's cProfile here")
    parser.add_argument(
        "--server-args", default="", help="extra `queue serve` flags, e.g. '--busy-poll-us 0'"
    )
    parser.add_argument("--note", default="", help="free text stored with the row")
    parser.add_argument("--no-save", action="store_true", help="do not append a results row")
    args = parser.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    for p in phases:
        if p not in ALL_PHASES:
            parser.error(f"unknown phase {p!r}; use some of {','.join(ALL_PHASES)}")

    import torch

    from services.queue.client import QueueClient

    torch.set_num_threads(1)
    res: dict = {}
    if "codec" in phases:
        res["codec"] = phase_codec(args.iters)
    if "raw" in phases:
        res["raw"] = phase_raw(args.iters, args.rounds)
    server = Server(args.profile_server, args.server_args.split())
    prof = cProfile.Profile() if args.profile_client else None
    try:
        with QueueClient(server.address, timeout_s=60) as client:
            client.hello()
            if prof:
                prof.enable()
            if "claim1" in phases:
                res["claim1"] = phase_claim(client, args.iters, ("input_ids",))
            if "claim2" in phases:
                res["claim2"] = phase_claim(client, args.iters, workloads.FIELDS)
            if "w2" in phases:
                res["w2"] = phase_w2(client, args.rounds)
            if "w1" in phases:
                res["w1"] = phase_w1(client, args.rounds)
            if "w1pair" in phases:
                res["w1pair"] = phase_w1pair(client, args.rounds)
            if prof:
                prof.disable()
    finally:
        server.stop()
    if prof:
        prof.dump_stats(args.profile_client)
        pstats.Stats(args.profile_client).sort_stats("tottime").print_stats(25)

    commit = _commit()
    print(
        f"\ncommit {commit} | {os.cpu_count()} cores, loopback TCP | server args "
        f"'{args.server_args}' | {args.note}"
    )
    print("| phase | metric | value |")
    print("|---|---|---|")
    for phase, figures in res.items():
        for k, v in figures.items():
            print(f"| {phase} | {k} | {v:.4g} |")
    if not args.no_save:
        row = {
            "bench": "queue_hot_path",
            "commit": commit,
            "device": f"CPU {os.cpu_count()} cores, loopback TCP",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "iters": args.iters,
            "rounds": args.rounds,
            "note": args.note,
            "server_args": args.server_args,
            **res,
        }
        _common.append_rows(RESULTS, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
