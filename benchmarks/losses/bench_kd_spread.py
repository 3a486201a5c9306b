"""Diagnostic: how much the kernel loss's fwd+bwd time moves between fresh inputs of one process.

``bench_kd_loss.py`` gives one median per case, and the medians of gold at 1x4096 moved by up to
0.5 ms between cases of the same code on the same machine (one process's gold 7.00 and relaxed
gold 7.50 ms, the next process's 7.33 and 7.04). This script separates the candidate causes:

* **placement**: each case allocates its logits anew (same seed, same values). A spread between
  cases of one process, with ``--heat 0``, points at where the tensors landed (their offsets
  are printed modulo 2 MiB);
* **heat**: ``--heat N`` runs the reference loss N times before each case, as the bench does
  (its reference takes ~380 ms a call); a spread that appears only then points at the GPU's
  clocks (the SM clock and temperature are printed where ``pynvml`` is installed);
* **host**: the host time of one call (its Python path, up to the backward's return, no sync)
  beside its wall time; on CUDA, ``--profiled N`` more calls per case under the profiler
  (CUDA activity only) split each call's span from its first kernel to its last into kernel
  time and GPU idle time (the GPU waiting for the host), with the longest idle stretch and the
  kernel that ended it. The same kernel times and more idle in a slower case point at the host.
  The profiler stays attached once started and slows the host of every later call (on one H100
  the medians of later cases rose by up to 0.5 ms): run ``--profiled`` as its own process and
  compare its walls only with each other.

Prints one row per case (median, min, p90 of ``--reps`` timed calls, sync to sync, as the bench
times them; the medians of the profiled calls' kernel time and idle time) and the spread of the
medians. Nothing is written to ``benchmarks/results``.
GPU: ``python benchmarks/losses/bench_kd_spread.py --mode gold --cases 8``; CPU: ``--smoke``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402
from bench_kd_loss import _make_inputs, _sync, make_loss  # noqa: E402

_TWO_MIB = 2 << 20


def _clocks() -> str:
    """The SM clock (MHz) and temperature (C) of GPU 0, or "-" without pynvml."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        return f"{sm}/{temp}"
    except Exception:  # noqa: BLE001 - a diagnostic column, never a failure
        return "-"


def _gpu_split(call, reps: int) -> tuple[float, float, str]:
    """Median over ``reps`` profiled calls (each between two syncs) of the kernel time and the
    GPU idle time between a call's first kernel and its last, ms, and the longest idle stretch
    as "ms before <kernel>" (median over the calls, at its place in the call's kernel order)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.cuda.synchronize()
            call()
            torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA
         and not e.name.startswith(("Memcpy", "Memset"))),
        key=lambda e: e.time_range.start,
    )  # fmt: skip
    per_call = len(kernels) // reps  # the same kernels in every call
    busy, idle, gaps = [], [], []
    for i in range(reps):
        calls = kernels[i * per_call : (i + 1) * per_call]
        busy.append(sum(e.time_range.elapsed_us() for e in calls) / 1e3)
        idle.append((calls[-1].time_range.end - calls[0].time_range.start) / 1e3 - busy[-1])
        gaps.append(
            [(b.time_range.start - a.time_range.end) / 1e3 for a, b in zip(calls, calls[1:])]
        )
    at = [statistics.median(g) for g in zip(*gaps)]
    k = max(range(len(at)), key=at.__getitem__)
    name = kernels[k + 1].name.split("(")[0].split("<")[0].split("::")[-1]
    return statistics.median(busy), statistics.median(idle), f"{at[k]:.3f} before {name}"


def run_case(args, device: torch.device, B: int, T: int, V_s: int, V_t: int) -> dict:
    """One case: fresh inputs (the same values every case), ``--heat`` reference calls, then
    ``--reps`` timed kernel calls after one warm-up."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the last case's tensors are gone: its blocks go back
    student, teacher, batch, projection, _ = _make_inputs(B, T, V_s, V_t, device, seed=B * T)
    x = student.clone().requires_grad_()

    def call(loss_fn):
        x.grad = None
        loss, _ = loss_fn(x, teacher, batch)
        loss.backward()

    if args.heat:
        reference = make_loss(args.mode, projection, "reference")
        for _ in range(args.heat):
            call(reference)
        del reference
        x.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kernel = make_loss(args.mode, projection, "kernel")
    call(kernel)
    _sync(device)
    walls, hosts = [], []
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        call(kernel)
        t1 = time.perf_counter()
        _sync(device)
        walls.append((time.perf_counter() - t0) * 1e3)
        hosts.append((t1 - t0) * 1e3)
    walls.sort()  # x.grad is the last timed call's
    split = ("-", "-", "-")
    if args.profiled and device.type == "cuda":
        busy, idle, longest = _gpu_split(lambda: call(kernel), args.profiled)
        split = (f"{busy:.3f}", f"{idle:.3f}", longest)
    row = {
        "split": split,
        "median": statistics.median(walls),
        "min": walls[0],
        "p90": walls[int(0.9 * (len(walls) - 1))],
        "host": statistics.median(hosts),
        "clocks": _clocks(),
        "offsets": "/".join(f"{t.data_ptr() % _TWO_MIB // 1024}" for t in (x, teacher, x.grad)),
    }
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="gold", choices=("pkl", "gold", "xtoken"))
    parser.add_argument("--shape", default="1x4096", help="BxT")
    parser.add_argument("--pair", default="151936x131072", help="V_s x V_t")
    parser.add_argument("--cases", type=int, default=8, help="fresh inputs, one after another")
    parser.add_argument("--reps", type=int, default=40, help="timed calls a case")
    parser.add_argument("--heat", type=int, default=0, help="reference calls before each case")
    parser.add_argument(
        "--profiled", type=int, default=0, help="profiled calls a case (CUDA; 0: none)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes")
    args = parser.parse_args(argv)
    B, T = (int(v) for v in args.shape.split("x"))
    V_s, V_t = (int(v) for v in args.pair.split("x"))
    if args.smoke:
        device, (B, T), (V_s, V_t) = torch.device("cpu"), (1, 64), (211, 197)
        args.reps = min(args.reps, 3)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        print("needs a CUDA device (or --smoke)")
        return 1
    print(
        f"{args.mode} {B}x{T} {V_s}/{V_t} heat={args.heat} reps={args.reps} "
        f"{_common.device_name(device)}, {_common.stack()}, commit {_common.commit()}"
    )
    cells, medians = [], []
    for case in range(args.cases):
        row = run_case(args, device, B, T, V_s, V_t)
        medians.append(row["median"])
        cells.append(
            [str(case)]
            + [f"{row[k]:.3f}" for k in ("median", "min", "p90", "host")]
            + list(row["split"])
            + [row["clocks"], row["offsets"]]
        )
    _common.print_cells(
        [
            "case",
            "median ms",
            "min",
            "p90",
            "host ms",
            "kernels ms",
            "GPU idle ms",
            "longest idle",
            "SM MHz/C",
            "KiB mod 2 MiB (x/teacher/grad)",
        ],
        cells,
    )
    print(
        f"medians {min(medians):.3f}-{max(medians):.3f} ms, spread {max(medians) - min(medians):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
