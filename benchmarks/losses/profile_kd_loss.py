"""Profile: where the KD loss's fwd+bwd time goes, kernel backend vs the reference backend (GPU).

Runs ``torch.profiler`` over one fwd+bwd of ``CrossTokenizerLoss`` (after a warm-up) for each
mode and backend at one shape, prints the top kernels by CUDA time per backend and writes the
full tables to ``--out``. Usage: ``python benchmarks/losses/profile_kd_loss.py --out /tmp/profile``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kd_loss import _make_inputs, make_loss  # noqa: E402


def _launch_costs(device, n: int = 300) -> None:
    """Host microseconds per call of a tiny torch op and of a tiny Triton kernel (our wrapper)."""
    from xtoken_core.kernels import logit_rows

    a = torch.ones(16, device=device)
    z = torch.ones(1, 1, 16, device=device)
    nidx = torch.zeros(1, dtype=torch.long, device=device)
    for name, fn in (
        ("torch add", lambda: a + 1),
        ("triton row_logsumexp", lambda: logit_rows.row_logsumexp(z, nidx, 1.0)),
    ):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        print(f"  launch cost: {name}: {host_us:.1f} us host per call")


def _fwd_bwd_split(forward, x, label: str, reps: int = 5) -> None:
    """Median host ms of the forward call, its wait for the GPU, and the same for backward."""
    parts = {"fwd host": [], "fwd gpu tail": [], "bwd host": [], "bwd gpu tail": []}
    for _ in range(reps):
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key].append(value * 1e3)
    cells = ", ".join(f"{k} {sorted(v)[len(v) // 2]:.2f}" for k, v in parts.items())
    print(f"  {label} host split (ms): {cells}")


def _python_profile(forward, x, reps: int, top: int) -> None:
    """cProfile ``reps`` fwd+bwd: the Python functions with the most own time (host cost)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(reps):
        x.grad = None
        forward().backward()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile_out")
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--backends", nargs="+", default=["kernel", "reference"], choices=["kernel", "reference"]
    )
    parser.add_argument("--modes", nargs="+", default=["pkl", "gold"], choices=["pkl", "gold"])
    parser.add_argument(
        "--host", action="store_true", help="also time the host side (launch costs, fwd/bwd)"
    )
    parser.add_argument(
        "--cprofile", type=int, default=0, help="cProfile this many fwd+bwd (Python host time)"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    if args.host:
        _launch_costs(device)
    student, teacher, batch, projection, _ = _make_inputs(args.B, args.T, 151936, 131072, device, 1)
    x = student.clone().requires_grad_()
    for mode in args.modes:
        for backend in args.backends:
            loss_fn = make_loss(mode, projection, backend)  # the backend is chosen once, here
            for _ in range(2):  # warm-up: compile, caches
                x.grad = None
                loss_fn(x, teacher, batch)[0].backward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x.grad = None
            loss_fn(x, teacher, batch)[0].backward()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
            fwd = lambda fn=loss_fn: fn(x, teacher, batch)[0]  # noqa: E731
            if args.host:
                _fwd_bwd_split(fwd, x, f"{mode} {backend}")
            if args.cprofile:
                _python_profile(fwd, x, args.cprofile, args.top)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                x.grad = None
                loss_fn(x, teacher, batch)[0].backward()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            with open(os.path.join(args.out, f"profile_{mode}_{backend}.txt"), "w") as fh:
                fh.write(table)
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            events.sort(key=lambda e: -e.self_device_time_total)
            total = sum(e.self_device_time_total for e in events) / 1e3
            print(f"== {mode} {backend} B={args.B} T={args.T}: {total:.2f} ms of kernels")
            for e in events[: args.top]:
                ms = e.self_device_time_total / 1e3
                print(f"  {ms:8.2f} ms  x{e.count:<4d} {e.key[:90]}")
            # Host side: wall time unprofiled, launches, syncs, and the top ops by host time.
            averages = {e.key: e for e in prof.key_averages()}
            launches = sum(
                e.count for k, e in averages.items() if "LaunchKernel" in k or "cuLaunch" in k
            )
            syncs = sum(e.count for k, e in averages.items() if "Synchronize" in k or "Memcpy" in k)
            print(f"  wall {wall_ms:.2f} ms unprofiled; {launches} launches; {syncs} sync/memcpy")
            host = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
            for e in host[: args.top]:
                ms = e.cpu_time_total / 1e3
                print(f"  host {ms:8.2f} ms  x{e.count:<4d} {e.key[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
