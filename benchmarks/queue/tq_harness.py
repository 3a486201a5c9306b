"""TransferQueue 0.1.11 side of bench_queue.py: runs the same workloads, prints one JSON object.

Run with the separate venv (see README.md): ``.venv-bench/bin/python benchmarks/queue/tq_harness.py``.
TransferQueue's controller and storage unit are ``@ray.remote`` classes whose work happens in
their own ZMQ threads; here their undecorated classes (``__ray_actor_class__``) run in one
server process started with multiprocessing, without a Ray cluster, and the client talks to
them over TCP like it does under Ray. One storage unit (our queue is one server process too).
"get" is TransferQueue's consumer path: ``get_meta`` (sample selection, marks them consumed
for the task) + ``get_data`` (fetch from the storage unit).

``--xtoken`` (main venv: ``python benchmarks/queue/tq_harness.py --xtoken``) runs the same
TransferQueue client code against an xtoken queue server, through xtoken's TransferQueue-style
client (``services/queue/tq_client.py``): only the server start and the import differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import workloads  # noqa: E402

QUIET = "ERROR"


def _serve(conn) -> None:
    """Server process: TransferQueue controller + one SimpleStorage unit, no Ray cluster."""
    os.environ.setdefault("TQ_LOG_LEVEL", QUIET)
    logging.disable(logging.WARNING)
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    controller = TransferQueueController.__ray_actor_class__()
    unit = SimpleStorageUnit.__ray_actor_class__(
        {"total_storage_size": None, "num_data_storage_units": 1}
    )
    conn.send((controller.get_zmq_server_info(), unit.get_zmq_server_info(), os.getpid()))
    conn.recv()  # any message: stop


def _tensordict(cols):
    import torch
    from tensordict import TensorDict

    fields = {
        name: torch.nested.nested_tensor_from_jagged(values, offsets)
        for name, (values, offsets) in cols.items()
    }
    n = int(next(iter(cols.values()))[1].numel() - 1)
    return TensorDict(fields, batch_size=[n])


def _start_transfer_queue():
    """TransferQueue's server process and client: (client, server pid, stop, system name)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    controller_info, unit_info, pid = parent.recv()

    import transfer_queue
    from transfer_queue import TransferQueueClient

    client = TransferQueueClient("bench", controller_info)
    client.initialize_storage_manager("SimpleStorage", {"zmq_info": {"unit0": unit_info}})

    def stop() -> None:
        parent.send("stop")
        server.join(10)
        if server.is_alive():
            server.terminate()

    return client, pid, stop, f"TransferQueue {getattr(transfer_queue, '__version__', '?')}"


def _start_xtoken():
    """An xtoken queue server process and the TransferQueue-style client over it."""
    import subprocess
    import tempfile

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from services.common.lifecycle import read_ready
    from services.queue.tq_client import TransferQueueClient

    ready = pathlib.Path(tempfile.mkdtemp()) / "ready"
    cmd = [sys.executable, "-m", "services.cli", "queue", "serve", "--bind", "tcp://127.0.0.1:*"]
    cmd += ["--ready-file", str(ready), "--capacity", "4GiB", "--log-level", "WARNING"]
    server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the xtoken queue server did not start")
        time.sleep(0.05)
    # frames over loopback TCP, like for like with TransferQueue (no shared-memory pool)
    client = TransferQueueClient("bench", read_ready(ready)["endpoint"], timeout_s=120, shm="never")

    def stop() -> None:
        client.close()
        server.terminate()
        server.wait(20)

    return client, server.pid, stop, "xtoken (TransferQueue-style client)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--w2-reps", type=int, default=5)
    parser.add_argument("--rss-mb", type=int, default=500)
    parser.add_argument("--lat-iters", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--xtoken", action="store_true", help="drive an xtoken queue server instead"
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)

    t0 = time.perf_counter()
    client, pid, stop, system = _start_xtoken() if args.xtoken else _start_transfer_queue()
    startup_s = time.perf_counter() - t0

    import numpy as np
    import torch

    torch.set_num_threads(1)
    out: dict = {"system": system, "startup_s": startup_s}
    fields = list(workloads.FIELDS)

    def put(cols, partition):
        client.put(data=_tensordict(cols), partition_id=partition)

    def get(n, partition, task="bench"):
        meta = client.get_meta(
            data_fields=fields, batch_size=n, partition_id=partition, task_name=task
        )
        return client.get_data(meta)

    # warm-up (connections, first partition)
    warm = workloads.columns(workloads.lengths(4, 8, 16, 99), 99)
    put(warm, "warm")
    get(4, "warm")
    client.clear_partition("warm")

    # server memory: ~rss_mb of W1-like batches
    base = workloads.rss_bytes(pid)
    stored, i = 0, 0
    while stored < args.rss_mb * 1e6:
        cols = workloads.columns(
            workloads.lengths(
                workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, 100 + i
            ),
            100 + i,
        )
        put(cols, f"rss{i}")
        stored += workloads.nbytes(cols)
        i += 1
    time.sleep(0.5)
    after = workloads.rss_bytes(pid)
    out["rss"] = {"baseline": base, "after": after, "stored": stored}
    for j in range(i):
        client.clear_partition(f"rss{j}")

    # W1: 64 samples, L in 512..4096, input_ids [L] int64 + hidden [L, 64] float32
    lens = workloads.lengths(
        workloads.W1_SAMPLES, workloads.W1_MIN_LEN, workloads.W1_MAX_LEN, args.seed
    )
    cols = workloads.columns(lens, args.seed)
    nbytes = workloads.nbytes(cols)
    put_s, get_s = [], []
    for r in range(args.rounds):
        t = time.perf_counter()
        put(cols, f"w1_{r}")
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = get(workloads.W1_SAMPLES, f"w1_{r}")
        get_s.append(time.perf_counter() - t)
        if r == 0:
            want = torch.nested.nested_tensor_from_jagged(*cols["hidden"])
            assert torch.equal(got["hidden"][5], want[5]), "TransferQueue returned other data"
        del got
        client.clear_partition(f"w1_{r}")
    out["w1"] = {"nbytes": nbytes, "put_s": put_s, "get_s": get_s}

    # W2: 4096 samples of ~20 tokens, puts and gets of 64
    batches = [
        workloads.columns(
            workloads.lengths(
                workloads.W2_BATCH, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 1000 + b
            ),
            1000 + b,
        )
        for b in range(workloads.W2_SAMPLES // workloads.W2_BATCH)
    ]
    w2_put, w2_get = [], []
    for r in range(args.w2_reps):
        t = time.perf_counter()
        for b in batches:
            put(b, f"w2_{r}")
        w2_put.append(time.perf_counter() - t)
        t = time.perf_counter()
        seen = 0
        for _ in batches:
            seen += get(workloads.W2_BATCH, f"w2_{r}")["input_ids"].size(0)
        w2_get.append(time.perf_counter() - t)
        assert seen == workloads.W2_SAMPLES, seen
        client.clear_partition(f"w2_{r}")
    out["w2"] = {"samples": workloads.W2_SAMPLES, "put_s": w2_put, "get_s": w2_get}

    # claim round trip on a ready sample: get_meta(batch 1), and get_meta + get_data
    lat_cols = workloads.columns(
        workloads.lengths(args.lat_iters, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 7), 7
    )
    put(lat_cols, "lat")
    meta_s, full_s = [], []
    for _ in range(args.lat_iters):
        t = time.perf_counter()
        meta = client.get_meta(
            data_fields=fields, batch_size=1, partition_id="lat", task_name="lat"
        )
        t1 = time.perf_counter()
        client.get_data(meta)
        t2 = time.perf_counter()
        meta_s.append(t1 - t)
        full_s.append(t2 - t)
    out["claim"] = {
        "meta_p50_ms": float(np.percentile(meta_s, 50) * 1e3),
        "meta_p99_ms": float(np.percentile(meta_s, 99) * 1e3),
        "p50_ms": float(np.percentile(full_s, 50) * 1e3),
        "p99_ms": float(np.percentile(full_s, 99) * 1e3),
        "iters": args.lat_iters,
    }
    client.clear_partition("lat")
    client.close()
    stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
