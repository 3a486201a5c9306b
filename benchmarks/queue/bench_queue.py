"""Benchmark: xtoken queue vs TransferQueue 0.1.11 vs raw pyzmq, plus the collator service.

One command, one table. Each system runs as a server process on loopback with one client:

* xtoken   ``xtoken queue serve`` subprocess + QueueClient (put; get = claim + ack, the claim
           reply carries the fields). W1 twice: frames over loopback TCP (``shm="never"``,
           like for like with TQ and raw pyzmq), and through the server's shared-memory pool
           (``shm="auto"``: put = reserve + one memcpy into a recycled segment + a put of
           references; get = claim(shm=True) answered with views of the pool, or with
           ``copy=True`` private copies; same server, same run).
* TQ       TransferQueue 0.1.11 controller + one SimpleStorage unit in one process, driven by
           ``tq_harness.py`` under ``.venv-bench/bin/python`` (see README.md).
* raw      pyzmq ROUTER/DEALER, the same buffers as multipart frames with copy=False: put =
           push + 2-byte ack, get = request -> reply carrying the buffers (the transport ceiling).

Workloads (workloads.py): W1 64 samples, L uniform in 512..4096, input_ids [L] int64 + hidden
[L, 64] float32 (~40 MB), put and get MB/s (median of rounds); W2 4,096 samples of ~20 tokens in
puts/gets of 64, samples/s; claim round trip (batch 1) on ready samples, p50/p99; server RSS
after putting ~500 MB; collator samples/s with 1 and 2 workers on the demo corpus.

Usage:  python benchmarks/queue/bench_queue.py [--quick] [--no-tq] [--no-collator]
Rows are appended to benchmarks/results/queue.jsonl; the table is written to
benchmarks/results/queue.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
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

RESULTS_JSONL = ROOT / "benchmarks" / "results" / "queue.jsonl"
RESULTS_MD = ROOT / "benchmarks" / "results" / "queue.md"
TQ_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
FIELDS = list(workloads.FIELDS)


# ----------------------------------------------------------------------------- helpers


def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q))


def _w1(seed: int):
    lens = workloads.lengths(workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, seed)
    return workloads.columns(lens, seed)


def _w2_batches():
    return [
        workloads.columns(
            workloads.lengths(
                workloads.W2_BATCH, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 1000 + b
            ),
            1000 + b,
        )
        for b in range(workloads.W2_SAMPLES // workloads.W2_BATCH)
    ]


# ----------------------------------------------------------------------------- xtoken queue


def bench_xtoken(rounds: int, w2_reps: int, rss_mb: int, lat_iters: int, seed: int) -> dict:
    """Run every workload against a real `xtoken queue serve` subprocess."""
    import torch

    from services.queue.client import QueueClient

    torch.set_num_threads(1)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-queue-"))
    ready = tmp / "ready"
    cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "queue", "serve"]
    cmd += ["--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready), "--capacity", "8GiB"]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    while not ready.exists():
        if server.poll() is not None:
            raise RuntimeError("queue server exited at start-up")
        time.sleep(0.02)
    out: dict = {"system": "xtoken", "startup_s": time.perf_counter() - t0}
    address = json.loads(ready.read_text())["endpoint"]
    try:
        # Frames over TCP: the like-for-like comparison with TransferQueue and raw pyzmq, and an
        # honest RSS row (shared-memory puts are measured by bench_shm_put.py).
        with QueueClient(address, timeout_s=60, shm="never") as client:
            client.hello()
            warm = workloads.columns(workloads.lengths(4, 8, 16, 99), 99)
            client.put("warm", [f"k{i}" for i in range(4)], workloads.jagged(warm))
            client.clear("warm")
            out["rss"] = _rss_phase(client, server.pid, rss_mb)
            out["w1"] = _w1_phase(client, rounds, seed)
        with QueueClient(address, timeout_s=60, shm="auto") as client:
            out["w1_shm"] = _w1_shm_phase(client, rounds, seed)
        with QueueClient(address, timeout_s=60, shm="never") as client:
            out["w2"] = _w2_phase(client, w2_reps)
            out["claim"] = _claim_phase(client, lat_iters)
    except BaseException:
        server.terminate()
        server.wait(10)
        raise
    server.terminate()
    server.wait(10)
    return out


def _rss_phase(client, pid: int, rss_mb: int) -> dict:
    base = workloads.rss_bytes(pid)
    stored, i = 0, 0
    while stored < rss_mb * 1e6:
        cols = workloads.columns(
            workloads.lengths(
                workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, 100 + i
            ),
            100 + i,
        )
        client.put(
            f"rss{i}", [f"s{j}" for j in range(workloads.W1_SAMPLES)], workloads.jagged(cols)
        )
        stored += workloads.nbytes(cols)
        i += 1
    time.sleep(0.5)
    after = workloads.rss_bytes(pid)
    for j in range(i):
        client.clear(f"rss{j}")
    return {"baseline": base, "after": after, "stored": stored}


def _w1_phase(client, rounds: int, seed: int) -> dict:
    import torch

    cols = _w1(seed)
    fields = workloads.jagged(cols)
    keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    put_s, get_s = [], []
    for r in range(rounds):
        part = f"w1_{r}"
        t = time.perf_counter()
        client.put(part, keys, fields)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = client.claim(part, "bench", FIELDS, workloads.W1_SAMPLES, timeout_s=5)
        client.ack(part, "bench", got["lease_id"])
        get_s.append(time.perf_counter() - t)
        if r == 0:
            assert len(got["keys"]) == workloads.W1_SAMPLES, got["keys"]
            assert torch.equal(got["fields"]["hidden"].values, cols["hidden"][0])
        del got
        client.clear(part)
    return {"nbytes": workloads.nbytes(cols), "put_s": put_s, "get_s": get_s}


def _w1_shm_phase(client, rounds: int, seed: int) -> dict:
    """W1 through the shared-memory pool: put, get as views, get as private copies."""
    import torch

    cols = _w1(seed)
    fields = workloads.jagged(cols)
    keys = [f"s{j}" for j in range(workloads.W1_SAMPLES)]
    put_s, view_s, copy_s = [], [], []
    for r in range(rounds + 1):  # round 0 creates the segment and maps it: not timed
        part = f"w1shm_{r}"
        t = time.perf_counter()
        client.put(part, keys, fields)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = client.claim(part, "views", FIELDS, workloads.W1_SAMPLES, timeout_s=5, shm=True)
        client.ack(part, "views", got["lease_id"])
        view_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        own = client.claim(
            part, "copies", FIELDS, workloads.W1_SAMPLES, timeout_s=5, shm=True, copy=True
        )
        client.ack(part, "copies", own["lease_id"])
        copy_s.append(time.perf_counter() - t)
        if r == 0:
            assert client._shm.puts == 1, "the put did not go through the pool"
            assert client._shm.reader.owns(got["fields"]["hidden"].values), "not a view"
            assert not client._shm.reader.owns(own["fields"]["hidden"].values), "not a copy"
            for batch in (got, own):
                assert len(batch["keys"]) == workloads.W1_SAMPLES, batch["keys"]
                assert torch.equal(batch["fields"]["hidden"].values, cols["hidden"][0])
                assert torch.equal(batch["fields"]["input_ids"].values, cols["input_ids"][0])
        del got, own
        client.clear(part)
    stats = client.stats()["shm_pool"]
    return {
        "nbytes": workloads.nbytes(cols),
        "put_s": put_s[1:],
        "get_s": view_s[1:],
        "get_copy_s": copy_s[1:],
        "pool": {k: stats[k] for k in ("segments", "created", "reused")},
    }


def _w2_phase(client, reps: int) -> dict:
    batches = [workloads.jagged(b) for b in _w2_batches()]
    n = workloads.W2_BATCH
    put_s, get_s = [], []
    for r in range(reps):
        part = f"w2_{r}"
        t = time.perf_counter()
        for b, fields in enumerate(batches):
            client.put(part, [f"b{b}-{j}" for j in range(n)], fields)
        put_s.append(time.perf_counter() - t)
        seen = 0
        t = time.perf_counter()
        for _ in batches:
            got = client.claim(part, "bench", FIELDS, n, timeout_s=5)
            client.ack(part, "bench", got["lease_id"])
            seen += len(got["keys"])
        get_s.append(time.perf_counter() - t)
        assert seen == workloads.W2_SAMPLES, seen
        client.clear(part)
    return {"samples": workloads.W2_SAMPLES, "put_s": put_s, "get_s": get_s}


def _claim_phase(client, iters: int) -> dict:
    cols = workloads.columns(
        workloads.lengths(iters, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 7), 7
    )
    client.put("lat", [f"s{j}" for j in range(iters)], workloads.jagged(cols))
    lat = []
    for _ in range(iters):
        t = time.perf_counter()
        got = client.claim("lat", "lat", FIELDS, 1, timeout_s=5)
        lat.append(time.perf_counter() - t)
        assert len(got["keys"]) == 1
        client.ack("lat", "lat", got["lease_id"])
    client.clear("lat")
    return {"p50_ms": _pct(lat, 50) * 1e3, "p99_ms": _pct(lat, 99) * 1e3, "iters": iters}


# ----------------------------------------------------------------------------- raw pyzmq


def _raw_server(endpoint_conn) -> None:
    """ROUTER: 'put' keeps the frames and answers b'ok'; 'get' answers with kept frames."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_conn.send(f"tcp://127.0.0.1:{port}")
    store: list[list] = []
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, op = frames[0], frames[1].bytes
        if op == b"put":
            store.append(frames[2:])
            sock.send_multipart([ident, b"ok"])
        elif op == b"get":
            sock.send_multipart([ident, *store.pop(0)], copy=False)
        elif op == b"ping":
            sock.send_multipart([ident, b"pong"])
        elif op == b"stop":
            sock.send_multipart([ident, b"bye"])
            break
    sock.close()
    ctx.term()


def bench_raw(rounds: int, w2_reps: int, lat_iters: int, seed: int) -> dict:
    """Raw pyzmq multipart sends of the same buffers (W1 and W2)."""
    import zmq

    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_raw_server, args=(child,), daemon=True)
    proc.start()
    address = parent.recv()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def frames_of(cols) -> list:
        out = []
        for values, offsets in cols.values():
            out += [memoryview(values.numpy()), memoryview(offsets.numpy())]
        return out

    def put(frames) -> None:
        sock.send_multipart([b"put", *frames], copy=False)
        sock.recv_multipart()

    def get() -> list:
        sock.send(b"get")
        return sock.recv_multipart(copy=False)

    cols = _w1(seed)
    frames = frames_of(cols)
    put(frames)
    get()  # warm-up
    put_s, get_s = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        put(frames)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = get()
        get_s.append(time.perf_counter() - t)
        assert sum(len(f.buffer) for f in got) == sum(f.nbytes for f in frames)
    batches = [frames_of(b) for b in _w2_batches()]
    w2_put, w2_get = [], []
    for _ in range(w2_reps):
        t = time.perf_counter()
        for fr in batches:
            put(fr)
        w2_put.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in batches:
            get()
        w2_get.append(time.perf_counter() - t)
    rtt = []
    for _ in range(lat_iters):
        t = time.perf_counter()
        sock.send(b"ping")
        sock.recv_multipart(copy=False)
        rtt.append(time.perf_counter() - t)
    sock.send(b"stop")
    sock.recv_multipart()
    sock.close()
    proc.join(10)
    return {
        "system": "raw pyzmq",
        "w1": {"nbytes": workloads.nbytes(cols), "put_s": put_s, "get_s": get_s},
        "w2": {"samples": workloads.W2_SAMPLES, "put_s": w2_put, "get_s": w2_get},
        "claim": {"p50_ms": _pct(rtt, 50) * 1e3, "p99_ms": _pct(rtt, 99) * 1e3, "iters": lat_iters},
    }


# ----------------------------------------------------------------------------- TransferQueue


def bench_tq(rounds: int, w2_reps: int, rss_mb: int, lat_iters: int, seed: int) -> dict | None:
    """Run tq_harness.py with the TransferQueue venv; None when that venv is missing."""
    if not TQ_PYTHON.exists():
        print(f"[bench] {TQ_PYTHON} not found: skipping TransferQueue (see README.md)")
        return None
    cmd = [str(TQ_PYTHON), str(HERE / "tq_harness.py"), "--rounds", str(rounds)]
    cmd += ["--w2-reps", str(w2_reps)]
    cmd += ["--rss-mb", str(rss_mb), "--lat-iters", str(lat_iters), "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"tq_harness failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- collator


def bench_collator(address: str | None, limit: int, workers_list: list[int]) -> list[dict]:
    """Collator service samples/s into a real queue (demo corpus, qwen3 -> mistral)."""
    import logging

    from services.collator.config import CollatorConfig, CorpusConfig
    from services.collator.runner import CollatorRun
    from services.collator.worker import WorkerConfig
    from xtoken_core.data.corpus import build_demo_corpus

    logging.basicConfig(level=logging.WARNING)
    corpus = build_demo_corpus()
    server = None
    if address is None:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-collator-"))
        ready = tmp / "ready"
        cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "queue", "serve"]
        cmd += ["--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready)]
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        while not ready.exists():
            time.sleep(0.02)
        address = json.loads(ready.read_text())["endpoint"]
    rows = []
    try:
        for workers in workers_list:
            config = CollatorConfig(
                data=CorpusConfig(train=str(corpus.train_path), limit=limit),
                worker=WorkerConfig(
                    queue=address,
                    partition=f"collator-{workers}-{time.monotonic_ns()}",
                    student="qwen3",
                    teacher="mistral",
                ),
                workers=workers,
                batch=16,
                log_every_s=60,
            )
            s = CollatorRun(config).run()
            rows.append(
                {
                    "workers": workers,
                    "samples": s.samples,
                    "elapsed_s": s.elapsed_s,
                    "samples_per_s": s.samples_per_s,
                    "steady_samples_per_s": s.steady_samples_per_s,
                    "mb_per_s": s.bytes_per_s / 1e6,
                    "startup_s": max(s.worker_ready_s or [0.0]),
                }
            )
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    return rows


# ----------------------------------------------------------------------------- report


def _summarize(res: dict | None) -> dict:
    if res is None:
        return {}
    s: dict = {}
    if "w1" in res:
        nb = res["w1"]["nbytes"]
        s["w1_put_mb_s"] = nb / statistics.median(res["w1"]["put_s"]) / 1e6
        s["w1_get_mb_s"] = nb / statistics.median(res["w1"]["get_s"]) / 1e6
    if "w1_shm" in res:
        w = res["w1_shm"]
        s["w1_shm_put_mb_s"] = w["nbytes"] / statistics.median(w["put_s"]) / 1e6
        s["w1_shm_get_mb_s"] = w["nbytes"] / statistics.median(w["get_s"]) / 1e6
        s["w1_shm_get_copy_mb_s"] = w["nbytes"] / statistics.median(w["get_copy_s"]) / 1e6
        s["w1_shm_pool"] = w["pool"]
    if "w2" in res:
        s["w2_put_samples_s"] = res["w2"]["samples"] / statistics.median(res["w2"]["put_s"])
        s["w2_get_samples_s"] = res["w2"]["samples"] / statistics.median(res["w2"]["get_s"])
    if "claim" in res:
        s["claim_p50_ms"] = res["claim"]["p50_ms"]
        s["claim_p99_ms"] = res["claim"]["p99_ms"]
    if "rss" in res:
        r = res["rss"]
        s["rss_growth_over_stored"] = (r["after"] - r["baseline"]) / r["stored"]
        s["rss_over_stored"] = r["after"] / r["stored"]
        s["rss_stored_mb"] = r["stored"] / 1e6
        s["rss_baseline_mb"] = r["baseline"] / 1e6
    return s


def _table(ours: dict, tq: dict, raw: dict, tq_res: dict | None, collator: list[dict]) -> str:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    lines = [
        "| metric | xtoken | TransferQueue | raw pyzmq | xtoken/TQ | xtoken/raw | target |",
        "|---|---|---|---|---|---|---|",
    ]
    # (label, our key, the TQ / raw key it is compared with, target)
    specs = [
        ("W1 put MB/s, frames (TCP)", "w1_put_mb_s", "w1_put_mb_s", ">= 2.5x TQ, >= 0.75x raw"),
        ("W1 put MB/s, shm pool", "w1_shm_put_mb_s", "w1_put_mb_s", ">= 2.5x TQ, >= 0.75x raw"),
        (
            "W1 get (claim+fetch) MB/s, frames (TCP)",
            "w1_get_mb_s",
            "w1_get_mb_s",
            ">= 2.5x TQ, >= 0.75x raw",
        ),
        (
            "W1 get MB/s, shm pool, zero-copy views",
            "w1_shm_get_mb_s",
            "w1_get_mb_s",
            ">= 2.5x TQ, >= 0.75x raw",
        ),
        (
            "W1 get MB/s, shm pool, copy-out",
            "w1_shm_get_copy_mb_s",
            "w1_get_mb_s",
            ">= 2.5x TQ, >= 0.75x raw",
        ),
        ("W2 put samples/s", "w2_put_samples_s", "w2_put_samples_s", ">= 5x TQ"),
        ("W2 get samples/s", "w2_get_samples_s", "w2_get_samples_s", ">= 5x TQ"),
    ]
    for label, key, ref, target in specs:
        a, b, c = ours.get(key), tq.get(ref), raw.get(ref)
        lines.append(
            f"| {label} | {f(a)} | {f(b)} | {f(c)} | {f(ratio(a, b), '{:.2f}x')} "
            f"| {f(ratio(a, c), '{:.2f}')} | {target} |"
        )
    tq_claim = tq_res["claim"] if tq_res else {}
    lines.append(
        f"| claim round trip p50 ms (batch 1) | {f(ours.get('claim_p50_ms'), '{:.3f}')} "
        f"| {f(tq_claim.get('p50_ms'), '{:.3f}')} (get_meta only "
        f"{f(tq_claim.get('meta_p50_ms'), '{:.3f}')}) "
        f"| {f(raw.get('claim_p50_ms'), '{:.3f}')} (empty req/rep) | "
        f"{f(ratio(tq_claim.get('p50_ms'), ours.get('claim_p50_ms')), '{:.1f}x faster')} | - "
        f"| p50 <= 0.3 ms |"
    )
    lines.append(
        f"| claim round trip p99 ms | {f(ours.get('claim_p99_ms'), '{:.3f}')} "
        f"| {f(tq_claim.get('p99_ms'), '{:.3f}')} (get_meta only "
        f"{f(tq_claim.get('meta_p99_ms'), '{:.3f}')}) "
        f"| {f(raw.get('claim_p99_ms'), '{:.3f}')} | - | - | reported |"
    )
    lines.append(
        f"| server RSS growth / stored bytes | {f(ours.get('rss_growth_over_stored'), '{:.3f}')} "
        f"| {f(tq.get('rss_growth_over_stored'), '{:.3f}')} | - | - | - | <= 1.2 |"
    )
    lines.append(
        f"| server RSS / stored bytes (baseline incl.) "
        f"| {f(ours.get('rss_over_stored'), '{:.3f}')} "
        f"| {f(tq.get('rss_over_stored'), '{:.3f}')} | - | - | - | - |"
    )
    for row in collator:
        lines.append(
            f"| collator samples/s, {row['workers']} worker(s) | "
            f"{row['samples_per_s']:.1f} (steady {row['steady_samples_per_s']:.1f}) "
            f"| - | - | - | - | reported |"
        )
    return "\n".join(lines)


# (our figure, the TQ / raw figure it is compared with)
_RATIO_KEYS = (
    ("w1_put_mb_s", "w1_put_mb_s"),
    ("w1_get_mb_s", "w1_get_mb_s"),
    ("w1_shm_put_mb_s", "w1_put_mb_s"),
    ("w1_shm_get_mb_s", "w1_get_mb_s"),
    ("w1_shm_get_copy_mb_s", "w1_get_mb_s"),
    ("w2_put_samples_s", "w2_put_samples_s"),
    ("w2_get_samples_s", "w2_get_samples_s"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, less data")
    parser.add_argument("--no-tq", action="store_true", help="skip TransferQueue")
    parser.add_argument("--no-collator", action="store_true", help="skip the collator service")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collator-limit", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 15)
    rss_mb = 150 if args.quick else 500
    lat_iters = 200 if args.quick else 2000
    w2_reps = 2 if args.quick else 5
    collator_limit = args.collator_limit or (32 if args.quick else 2000)

    print(f"[bench] raw pyzmq ({rounds} rounds)", flush=True)
    raw_res = bench_raw(rounds, w2_reps, lat_iters, args.seed)
    print("[bench] xtoken queue", flush=True)
    ours_res = bench_xtoken(rounds, w2_reps, rss_mb, lat_iters, args.seed)
    tq_res = None
    if not args.no_tq:
        print("[bench] TransferQueue (subprocess, .venv-bench)", flush=True)
        tq_res = bench_tq(rounds, w2_reps, rss_mb, lat_iters, args.seed)
    collator = []
    if not args.no_collator:
        print(f"[bench] collator service ({collator_limit} demo texts)", flush=True)
        collator = bench_collator(None, collator_limit, [1, 2])

    ours, tq, raw = _summarize(ours_res), _summarize(tq_res), _summarize(raw_res)
    table = _table(ours, tq, raw, tq_res, collator)
    commit = _common.commit()
    device = f"{_common.cpu_model(fallback='unknown')}, {os.cpu_count()} cores (CPU, loopback TCP)"
    shape = (
        f"W1 {workloads.W1_SAMPLES} x L~U[{workloads.W1_MIN_LEN},{workloads.W1_MAX_LEN}] "
        f"(int64 [L] + float32 [L,{workloads.HIDDEN}], "
        f"{ours_res['w1']['nbytes'] / 1e6:.1f} MB); W2 {workloads.W2_SAMPLES} x "
        f"L~U[{workloads.W2_MIN_LEN},{workloads.W2_MAX_LEN}] in batches of {workloads.W2_BATCH}"
    )
    print()
    print(f"commit {commit} | {device} | rounds {rounds} | {shape}")
    print(table)

    row = {
        "bench": "queue",
        "commit": commit,
        "device": device,
        "shape": shape,
        "rounds": rounds,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "xtoken": ours,
        "transferqueue": tq,
        "raw_pyzmq": raw,
        "tq_claim": (tq_res or {}).get("claim"),
        "collator": collator,
        "ratios": {k: (ours[k] / tq[r] if tq.get(r) else None) for k, r in _RATIO_KEYS},
        "ratios_vs_raw": {k: (ours[k] / raw[r] if raw.get(r) else None) for k, r in _RATIO_KEYS},
    }
    _common.append_rows(RESULTS_JSONL, [row])
    if not args.quick:
        # Hand-written analysis below "## Notes" survives a rerun.
        notes = ""
        if RESULTS_MD.exists() and "\n## Notes" in RESULTS_MD.read_text(encoding="utf-8"):
            text = RESULTS_MD.read_text(encoding="utf-8")
            notes = "\n" + text[text.index("\n## Notes") :].lstrip("\n")
        RESULTS_MD.write_text(
            "# Queue benchmark (benchmarks/queue/bench_queue.py)\n\n"
            f"commit `{commit}`, {row['time']}, {device}, {rounds} rounds (median), "
            f"TransferQueue 0.1.11 without a Ray cluster (controller + 1 SimpleStorage unit in "
            f"one process, see tq_harness.py).\n\n{shape}\n\n{table}\n{notes}",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
