"""Claim round trip beside its floor (raw pyzmq), broken down, per CPU placement and load.

One run, side by side, interleaved repetition by repetition (so that drift of a shared machine
hits every case alike):

* raw    pyzmq DEALER -> ROUTER (a spawned process) with the claim's exact frame sizes: the
         request and reply frames of a real claim (batch 1, input_ids [L] int64 + hidden [L, 64]
         float32, L ~ U[10, 30], the bench_queue.py workload), then an ack-sized pair, untimed,
         as the queue loop below does: the floor of this process pair.
* queue  ``xtoken queue serve`` subprocesses (profile_hot_path.Server) with ``--busy-poll-us``
         300 (the default) and 0, one QueueClient each: claim(batch 1) timed, ack untimed
         (bench_queue.py's claim phase); once more through the shared-memory pool (shm=True).

Per case: p50/p90/p99 over every timed claim, and the min-max of the p50 of each repetition
(the spread). Breakdown of one claim:

* client us     CPU time of this thread inside ``QueueClient.claim`` (time.thread_time_ns):
                body, encode, send, poll, receive, decode, and the system calls' kernel work
                (waking a thread on another core included); not the sleep, nor time preempted.
                (The wall time outside the poller's wait, which includes preemption, is kept in
                the jsonl as client_wall_us.)
* server us     CPU time of the server's request handling run in this process (a QueueServer
                bound to its own socket, fed by a DEALER): receive + ``_on_frames`` (decode,
                validate, claim, encode, send) + the loop's per-wake-up work, as
                ``QueueServer._loop`` does it, under the case's placement and load.
* remainder us  p50 - client - server: the wire, both sides' zmq I/O threads, wake-ups, and
                time a runnable thread waited for a core.
* CPU us/iter   on-CPU time (/proc/<pid>/task/*/schedstat) of the server process and of this
                client process per claim + ack iteration: a busy-polling server burns its
                core while a client loops.

Placements (threads of a process, zmq I/O threads included, pinned with sched_setaffinity):
``free`` (the scheduler decides, within this process's cores), ``split`` (server on core a,
client on core b), ``shared`` (both on core a); ``+spin``: a third process spinning in a Python
loop (load ~1), on any core (``free``) or on the server's core (``split``); ``+duty``: a third
process spinning 2 ms of every 4 ms (load ~0.5, cores that go idle and get busy again).

Usage:
  python benchmarks/queue/bench_roundtrip.py [--quick] [--iters 1000] [--reps 5] [--no-save]
  taskset -c 0,1 python benchmarks/queue/bench_roundtrip.py     # 2 cores of a bigger machine
Prints one table; appends one row per case to benchmarks/results/queue_roundtrip.jsonl.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402
import profile_hot_path  # noqa: E402
import workloads  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "queue_roundtrip.jsonl"
FIELDS = list(workloads.FIELDS)
WARMUP = 30  # untimed iterations at the start of every case (after re-pinning)
_pct = profile_hot_path._pct


# ----------------------------------------------------------------------------- processes


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` (zmq I/O threads included) to ``cpus``; threads it
    starts later inherit the mask of the thread that starts them."""
    for tid in _tids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of ``pid``: /proc schedstat (ns), else /proc stat
    utime + stime (clock ticks)."""
    total = 0
    for tid in _tids(pid):
        try:
            total += int(pathlib.Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, IndexError):
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int((int(fields[11]) + int(fields[12])) * _TICK_NS)
    return total


# What the third process runs: a spin, or a spin of 2 ms in every 4 ms.
LOADS = {
    "spin": "while True: pass",
    "duty": (
        "import time\n"
        "while True:\n"
        "    end = time.perf_counter() + 0.002\n"
        "    while time.perf_counter() < end: pass\n"
        "    time.sleep(0.002)\n"
    ),
}


class Spinner:
    """A third process that runs ``LOADS[kind]``; stopped (SIGSTOP) when not wanted, so that
    it loads the machine only in the cases that ask for it."""

    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", LOADS[kind]])
        self.proc.send_signal(signal.SIGSTOP)

    def run(self, cpus: set[int]) -> None:
        pin(self.proc.pid, cpus)
        self.proc.send_signal(signal.SIGCONT)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


# ----------------------------------------------------------------------------- raw pyzmq


def _raw_server(conn) -> None:
    """ROUTER answering [b"c", *request] with the claim reply's frames and [b"a", ...] with
    the ack reply's (bytes given through ``conn``), [b"s"] with a last reply, then exits."""
    import zmq

    claim_reply, ack_reply = conn.recv()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart()
        op = frames[1]
        if op == b"c":
            sock.send_multipart([frames[0], *claim_reply])
        elif op == b"a":
            sock.send_multipart([frames[0], *ack_reply])
        else:
            sock.send_multipart([frames[0], b"bye"])
            break
    sock.close()
    ctx.term()


class Raw:
    """The raw pyzmq pair: a spawned ROUTER process and a DEALER here."""

    def __init__(self, frames: dict[str, list[bytes]]) -> None:
        import zmq

        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe()
        self.proc = mp.Process(target=_raw_server, args=(child,), daemon=True)
        self.proc.start()
        parent.send((frames["claim_reply"], frames["ack_reply"]))
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(parent.recv())
        self.claim = [b"c", *frames["claim_request"]]
        self.ack = [b"a", *frames["ack_request"]]
        self.pid = self.proc.pid

    def iteration(self) -> tuple[int, int, int]:
        """One claim-sized round trip (timed) and one ack-sized (untimed): (wall ns, client
        CPU ns, client wall ns outside the wait; -1: not measured)."""
        sock, cpu = self.sock, time.thread_time_ns
        c0, t0 = cpu(), time.perf_counter_ns()
        sock.send_multipart(self.claim)
        sock.recv_multipart()
        t1, c1 = time.perf_counter_ns(), cpu()
        sock.send_multipart(self.ack)
        sock.recv_multipart()
        return t1 - t0, c1 - c0, -1

    def stop(self) -> None:
        self.sock.send(b"s")
        self.sock.recv_multipart()
        self.sock.close()
        self.proc.join(10)


# ----------------------------------------------------------------------------- queue


class _TimedPoll:
    """A zmq.Poller whose blocking time is summed (wraps a QueueClient's poller)."""

    def __init__(self, poller) -> None:
        self.poller = poller
        self.ns = 0

    def poll(self, timeout=None):
        t = time.perf_counter_ns()
        try:
            return self.poller.poll(timeout)
        finally:
            self.ns += time.perf_counter_ns() - t

    def register(self, *args, **kwargs):
        return self.poller.register(*args, **kwargs)


def _put_ready(client, partition: str, n: int) -> None:
    cols = workloads.columns(workloads.lengths(n, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 7), 7)
    client.put(partition, [f"s{j}" for j in range(n)], workloads.jagged(cols))


class Queue:
    """One ``xtoken queue serve`` subprocess and a client of it, samples ready to claim."""

    def __init__(self, busy_poll_us: int, samples: int, shm: bool) -> None:
        from services.queue.client import QueueClient
        from services.queue.errors import QueueError

        self.server = profile_hot_path.Server(None, ["--busy-poll-us", str(busy_poll_us)])
        self.pid = self.server.proc.pid
        self.shm = False
        self.polls: dict[int, _TimedPoll] = {}
        try:
            self.client = QueueClient(self.server.address, timeout_s=60, shm="never")
            self.client.hello()
            self.partition = "rt"
            _put_ready(self.client, self.partition, samples)
            if shm:
                self.shm_client = QueueClient(self.server.address, timeout_s=60, shm="always")
                try:
                    _put_ready(self.shm_client, "rt-shm", samples)
                    self.shm = self.shm_client._shm.puts == 1
                except QueueError as e:
                    print(f"[roundtrip] no shared-memory pool here, shm case left out: {e}")
                if not self.shm:
                    self.shm_client.close()
        except BaseException:
            self.server.stop()
            raise

    def iterations(self, task: str, n: int, shm: bool = False):
        """``n`` claim (timed) + ack iterations as a new task: yields (wall ns, client CPU ns:
        this thread's, client wall ns outside the poller's wait)."""
        client = self.shm_client if shm else self.client
        part = "rt-shm" if shm else self.partition
        timed = self.polls.get(id(client))
        if timed is None or client._poller is not timed:
            timed = self.polls[id(client)] = _TimedPoll(client._poller)
            client._poller = timed
        claim, ack = client.claim, client.ack
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        for _ in range(n):
            p0 = timed.ns
            c0, t0 = cpu(), clock()
            got = claim(part, task, FIELDS, 1, timeout_s=5, shm=shm)
            t1, c1 = clock(), cpu()
            waited = timed.ns - p0
            ack(part, task, got["lease_id"])
            assert len(got["keys"]) == 1, got["keys"]
            yield t1 - t0, c1 - c0, (t1 - t0) - waited

    def stop(self) -> None:
        self.client.close()
        if self.shm:
            self.shm_client.close()
        self.server.stop()


# ----------------------------------------------------------------------------- in-process


class HandlerProbe:
    """The queue server's request handling in this process: a QueueServer bound to its own
    socket (its loop never runs), fed claims by a DEALER here, handled the way
    ``QueueServer._loop`` handles them (receive, ``_on_frames``, the loop's per-wake-up work).
    Also captures the frames of a real claim and ack (for the raw pair) and times the client's
    own codec calls and a poll that does not wait."""

    def __init__(self, samples: int) -> None:
        import zmq

        from services.queue.client import QueueClient
        from services.queue.server import QueueServer, ServerConfig
        from xtoken_core.wire import encode_message

        self.zmq = zmq
        self.server = QueueServer(ServerConfig(bind="tcp://127.0.0.1:*", busy_poll_us=0))
        self.server.bind()
        self.poller = zmq.Poller()
        self.poller.register(self.server._sock, zmq.POLLIN)
        self.dealer = zmq.Context.instance().socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.server.endpoint)
        self.body_claim, self.body_lease = QueueClient.body_claim, QueueClient.body_lease
        self.encode = encode_message
        self.ids = iter(range(1, 1 << 62))
        hello = QueueClient(self.server.endpoint, shm="never", name="probe").body_hello()
        self._request("hello", hello)
        from xtoken_core.wire import JaggedColumn

        cols = workloads.columns(
            workloads.lengths(samples, workloads.W2_MIN_LEN, workloads.W2_MAX_LEN, 7), 7
        )
        fields = {k: JaggedColumn(v, o) for k, (v, o) in cols.items()}
        self._request(
            "put",
            QueueClient.body_put("rt", [f"s{j}" for j in range(samples)], fields, 5.0),
        )
        self.frames: dict[str, list[bytes]] = {}

    def _serve_one(self) -> tuple[int, int]:
        """Handle the request waiting at the server socket; returns (CPU ns, wall ns)."""
        from services.common.lifecycle import progress
        from services.queue.transport import recv_frames

        srv, zmq = self.server, self.zmq
        assert self.poller.poll(5000), "the probe's request did not arrive"
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        frames = recv_frames(srv._sock, zmq.NOBLOCK)
        srv._on_frames(frames)
        self.poller.poll(0)
        srv._run_timers()
        progress()
        srv._poll_timeout_ms()
        return time.thread_time_ns() - c0, time.perf_counter_ns() - t0

    def _request(self, msg_type: str, body: dict) -> tuple[list[bytes], list[bytes], tuple]:
        from xtoken_core.wire import decode_message

        request = [bytes(f) for f in self.encode(msg_type, body, request_id=next(self.ids))]
        self.dealer.send_multipart(request)
        ns = self._serve_one()
        reply = self.dealer.recv_multipart()
        msg = decode_message(reply, jagged="column")
        assert msg.msg_type == "reply", msg.body
        self.last = msg.body
        return request, reply, ns

    def handler_ns(self, task: str, n: int) -> list[tuple[int, int]]:
        """Server handling (CPU ns, wall ns) of ``n`` claims (each acked) as a new task."""
        out = []
        for _ in range(n):
            body = self.body_claim("rt", task, FIELDS, 1, None, 5.0, 60.0)
            req, rep, ns = self._request("claim", body)
            out.append(ns)
            lease = self.last["lease_id"]
            self.frames.setdefault("claim_request", req)
            self.frames.setdefault("claim_reply", rep)
            areq, arep, _ = self._request("ack", self.body_lease("rt", task, lease, None))
            self.frames.setdefault("ack_request", areq)
            self.frames.setdefault("ack_reply", arep)
        return out

    def client_codec_ns(self, n: int) -> dict[str, float]:
        """Median ns of the client's own calls on a claim: body + encode, decode of the reply,
        and a poll of its two sockets that returns at once (a reply is already there)."""
        from xtoken_core.wire import decode_message

        zmq = self.zmq
        reply = self.frames["claim_reply"]
        enc, dec, poll = [], [], []
        # a poller like the client's: its DEALER and a second socket (the client's monitor)
        spare = zmq.Context.instance().socket(zmq.PAIR)
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(spare, zmq.POLLIN)
        status = self.encode("status", {"partition": "rt", "task": "t"}, request_id=next(self.ids))
        self.dealer.send_multipart(status)  # a reply to leave waiting
        self._serve_one()
        for i in range(n + 20):
            t0 = time.perf_counter_ns()
            body = self.body_claim("rt", "t", FIELDS, 1, None, 5.0, 60.0)
            self.encode("claim", body, request_id=i + 1)
            t1 = time.perf_counter_ns()
            decode_message(reply, jagged="column")
            t2 = time.perf_counter_ns()
            poller.poll(1000)
            t3 = time.perf_counter_ns()
            if i >= 20:
                enc.append(t1 - t0)
                dec.append(t2 - t1)
                poll.append(t3 - t2)
        self.dealer.recv_multipart()
        spare.close()
        return {
            "encode_ns": statistics.median(enc),
            "decode_ns": statistics.median(dec),
            "poll_ns": statistics.median(poll),
        }

    def stop(self) -> None:
        self.dealer.close()
        self.server._sock.close(linger=0)
        self.server.pool.close()


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    target: str  # "raw" or "queue"
    placement: str  # "free", "split", "shared"
    load: str = ""  # a third process: "" none, or a key of LOADS
    busy_poll_us: int = 300
    shm: bool = False

    @property
    def name(self) -> str:
        what = "raw pyzmq" if self.target == "raw" else f"queue busy{self.busy_poll_us}"
        if self.shm:
            what += " shm"
        return f"{what} {self.placement}{'+' + self.load if self.load else ''}"


def cases(two_cores: bool) -> list[Case]:
    """Every case, raw pyzmq first; ``split`` ones only with two cores or more."""
    places = [("free", ""), ("split", ""), ("shared", ""), ("free", "spin"), ("split", "spin")]
    places += [("free", "duty")]
    if not two_cores:
        places = [p for p in places if p[0] != "split"]
    out = [Case("raw", p, load) for p, load in places]
    for busy in (300, 0):
        out += [Case("queue", p, load, busy) for p, load in places]
    out.append(Case("queue", "free", "", 300, shm=True))
    return out


def placement(case: Case, cores: list[int]) -> tuple[set[int], set[int], set[int]]:
    """(server cpus, client cpus, spinner cpus) of a case."""
    every = set(cores)
    a, b = cores[0], cores[-1]
    if case.placement == "free":
        return every, every, every
    if case.placement == "split":
        return {a}, {b}, {a}  # a spinner shares the server's core
    return {a}, {a}, {b}


# ----------------------------------------------------------------------------- run


def _run_case(case: Case, rep: int, iters: int, cores: list[int], parts: dict, r: dict) -> None:
    """One repetition of one case: pin, load, WARMUP + ``iters`` iterations, accumulate."""
    me = os.getpid()
    srv_cpus, cli_cpus, spin_cpus = placement(case, cores)
    queue = parts["queues"].get(case.busy_poll_us) if case.target == "queue" else None
    pid = queue.pid if queue else parts["raw"].pid
    pin(pid, srv_cpus)
    pin(me, cli_cpus)
    if case.load:
        parts["loads"][case.load].run(spin_cpus)
    try:
        if queue:
            it = queue.iterations(f"{case.name}-{rep}", WARMUP + iters, case.shm)
        else:
            it = (parts["raw"].iteration() for _ in range(WARMUP + iters))
        for _ in range(WARMUP):
            next(it)
        c0, s0 = cpu_ns(me), cpu_ns(pid)
        got = list(it)
        r["cpu_c"] += cpu_ns(me) - c0
        r["cpu_s"] += cpu_ns(pid) - s0
        r["n"] += len(got)
        lat = [ns for ns, _, _ in got]
        r["lat"] += lat
        r["cli"] += [c for _, c, _ in got]
        r["cli_wall"] += [w for _, _, w in got]
        r["p50s"].append(_pct(lat, 50))
        if queue and not case.shm:
            # the server's handling in this process, under this case's placement and load
            handled = parts["probe"].handler_ns(f"probe {case.name}-{rep}", max(50, iters // 5))
            r["srv"] += [c for c, _ in handled]
            r["srv_wall"] += [w for _, w in handled]
    finally:
        if case.load:
            parts["loads"][case.load].pause()
        pin(pid, set(cores))
        pin(me, set(cores))


def measure(all_cases: list[Case], cores: list[int], iters: int, reps: int) -> tuple:
    """Start the processes, run every case ``reps`` times (interleaved), stop them all.

    Returns:
        (the cases run: those through the pool only where it works here, per-case
        accumulators, client codec ns, frame sizes of a claim and an ack)
    """
    samples = iters + 2 * WARMUP + 10  # every case and rep claims them as a new task
    started: list = []  # stopped in reverse, whatever happens (the spinner above all)
    parts: dict = {"queues": {}}
    try:
        probe = parts["probe"] = HandlerProbe(iters + 64)
        started.append(probe)
        probe.handler_ns("warm", 50)
        codec = probe.client_codec_ns(iters)
        parts["raw"] = Raw(probe.frames)
        started.append(parts["raw"])
        for busy in sorted({c.busy_poll_us for c in all_cases if c.target == "queue"}):
            wants_shm = any(c.shm and c.busy_poll_us == busy for c in all_cases)
            parts["queues"][busy] = Queue(busy, samples, shm=wants_shm)
            started.append(parts["queues"][busy])
        all_cases = [c for c in all_cases if not c.shm or parts["queues"][c.busy_poll_us].shm]
        parts["loads"] = {}
        for kind in sorted({c.load for c in all_cases if c.load}):
            parts["loads"][kind] = Spinner(kind)
            started.append(parts["loads"][kind])
        for q in parts["queues"].values():  # warm every path
            list(q.iterations("warm", WARMUP))
            if q.shm:
                list(q.iterations("warm-shm", WARMUP, shm=True))
        for _ in range(WARMUP):
            parts["raw"].iteration()
        res = {
            c: {
                "lat": [],
                "cli": [],
                "cli_wall": [],
                "p50s": [],
                "srv": [],
                "srv_wall": [],
                "cpu_s": 0,
                "cpu_c": 0,
                "n": 0,
            }
            for c in all_cases
        }
        for rep in range(reps):
            k = rep % len(all_cases)
            for case in all_cases[k:] + all_cases[:k]:  # rotated: no case always first
                _run_case(case, rep, iters, cores, parts, res[case])
            print(f"[roundtrip] rep {rep + 1}/{reps} done", flush=True)
    finally:
        for thing in reversed(started):
            thing.stop()
    frame_sizes = {k: [len(f) for f in v] for k, v in probe.frames.items()}
    return all_cases, res, codec, frame_sizes


# ----------------------------------------------------------------------------- report


def _rows(all_cases: list[Case], res: dict) -> list[dict]:
    """One summary dict per case (microseconds)."""

    def med_us(xs):
        return statistics.median(xs) / 1e3 if xs else None

    raw_p50 = {
        (c.placement, c.load): _pct(res[c]["lat"], 50) / 1e3 for c in all_cases if c.target == "raw"
    }
    rows = []
    for case in all_cases:
        r = res[case]
        p50, p90, p99 = (_pct(r["lat"], q) / 1e3 for q in (50, 90, 99))
        client_us, server_us = med_us(r["cli"]), med_us(r["srv"])
        raw_same = raw_p50.get((case.placement, case.load))
        rows.append(
            {
                "case": case.name,
                "target": case.target,
                "placement": case.placement,
                "load": case.load,
                "shm": case.shm,
                "busy_poll_us": case.busy_poll_us if case.target == "queue" else None,
                "p50_us": p50,
                "p90_us": p90,
                "p99_us": p99,
                "p50_reps_us": [x / 1e3 for x in r["p50s"]],
                "client_us": client_us,
                "server_us": server_us,
                "remainder_us": p50 - client_us - server_us if server_us is not None else None,
                "over_raw_us": p50 - raw_same if case.target == "queue" and raw_same else None,
                "client_wall_us": med_us(r["cli_wall"]) if case.target == "queue" else None,
                "server_wall_us": med_us(r["srv_wall"]),
                "cpu_server_us_per_iter": r["cpu_s"] / r["n"] / 1e3,
                "cpu_client_us_per_iter": r["cpu_c"] / r["n"] / 1e3,
            }
        )
    return rows


def _print_table(rows: list[dict]) -> None:
    def f(x):
        return "-" if x is None else f"{x:.0f}"

    headers = [
        "case",
        "p50 us",
        "p90",
        "p99",
        "p50 min-max",
        "client us",
        "server us",
        "remainder",
        "p50-raw",
        "CPU us/iter srv",
        "CPU cli",
    ]
    cells = [
        [
            row["case"],
            f(row["p50_us"]),
            f(row["p90_us"]),
            f(row["p99_us"]),
            f"{min(row['p50_reps_us']):.0f}-{max(row['p50_reps_us']):.0f}",
            f(row["client_us"]),
            f(row["server_us"]),
            f(row["remainder_us"]),
            f(row["over_raw_us"]),
            f(row["cpu_server_us_per_iter"]),
            f(row["cpu_client_us_per_iter"]),
        ]
        for row in rows
    ]
    _common.print_cells(headers, cells)
    print(
        "client/server us: CPU time of one claim on each side's main thread (medians; raw: "
        "pyzmq send + recv); remainder = p50 - both: wire, zmq I/O threads, wake-ups, waiting "
        "for a core; p50-raw: over the raw pair of the same placement; CPU us/iter: on-CPU "
        "time of every thread per claim + ack iteration (server process / this process)"
    )


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 60 s)")
    parser.add_argument("--iters", type=int, default=None, help="timed claims per case and rep")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (the spread)")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--note", default="", help="free text stored with the rows")
    parser.add_argument("--no-save", action="store_true", help="do not append result rows")
    args = parser.parse_args()
    iters = args.iters or (200 if args.quick else 1000)
    reps = args.reps or (3 if args.quick else 5)

    import torch

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    all_cases = [c for c in cases(len(cores) >= 2) if args.only in c.name]
    if not all_cases:
        parser.error(f"--only {args.only!r} matches no case")
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    all_cases, res, codec, frame_sizes = measure(all_cases, cores, iters, reps)
    load_end = os.getloadavg()
    rows = _rows(all_cases, res)

    commit = profile_hot_path._commit()
    device = (
        f"{_common.cpu_model(fallback='unknown')}, {len(cores)} of {os.cpu_count()} cores "
        f"(cpus {','.join(map(str, cores))}), loopback TCP"
    )
    print()
    print(
        f"commit {commit} | {device} | load {load_start[0]:.2f} -> {load_end[0]:.2f} | "
        f"{reps} reps x {iters} claims per case | {time.perf_counter() - t_start:.0f} s"
    )
    print(
        f"claim batch 1, frames request {frame_sizes['claim_request']} reply "
        f"{frame_sizes['claim_reply']} bytes; client codec in a tight loop: encode "
        f"{codec['encode_ns'] / 1e3:.1f} us, decode {codec['decode_ns'] / 1e3:.1f} us, a poll "
        f"that does not wait {codec['poll_ns'] / 1e3:.1f} us"
    )
    _print_table(rows)
    if not args.no_save:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        common = {
            "bench": "queue_roundtrip",
            "commit": commit,
            "device": device,
            "cores": cores,
            "loadavg_start": load_start,
            "loadavg_end": load_end,
            "time": stamp,
            "iters": iters,
            "reps": reps,
            "quick": args.quick,
            "note": args.note,
            "frames": frame_sizes,
            "client_codec_us": {k: v / 1e3 for k, v in codec.items()},
        }
        _common.append_rows(RESULTS, [{**common, **row} for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
