"""Host cost of one Triton launch, split: the ``kernel[grid](...)`` path vs its parts (GPU).

Prints host microseconds per call for a tiny torch op, the normal Triton launch of a real
kernel (``_row_lse_kernel``), Triton's argument binder alone, the stream/device lookups and a
direct call of the compiled kernel's launcher (what a cached fast path would pay), and dumps
the installed Triton's ``JITFunction.run`` source (``--source``) to compare versions.
Usage: ``python benchmarks/kernels/bench_launch.py [--source FILE]``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch


def _us(fn, n: int = 2000) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="write JITFunction.run's source here")
    args = parser.parse_args(argv)
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from xtoken_core.kernels import logit_rows

    print(f"triton {triton.__version__}, torch {torch.__version__}")
    if args.source:
        with open(args.source, "w") as fh:
            fh.write(inspect.getsource(JITFunction.run))
            fh.write("\n\n")
            fh.write(inspect.getsource(JITFunction.create_binder))
    dev = torch.device("cuda")
    z = torch.ones(1, 1, 16, device=dev)
    nidx = torch.zeros(1, dtype=torch.long, device=dev)
    lse = torch.empty(1, device=dev)
    a = torch.ones(16, device=dev)
    jitted = logit_rows._row_lse_kernel.jitted()
    # (z, nidx_R, lse_R, sum_R, T, V, stride_b, stride_t, scale2)
    call_args = (z, nidx, lse, lse, 1, 16, 16, 16, 1.4426950408889634)
    kw = dict(ALL_ROWS=False, SUMS=False, BLOCK_V=16, num_warps=4)
    kernel = jitted[(1,)](*call_args, **kw)
    rows = {
        "torch add": lambda: a + 1,
        "torch.empty": lambda: torch.empty(16, device=dev),
        "kernel[grid](...)": lambda: jitted[(1,)](*call_args, **kw),
        "wrapper row_logsumexp": lambda: logit_rows.row_logsumexp(z, nidx, 1.0),
        "driver current device": lambda: driver.active.get_current_device(),
        "driver current stream": lambda: driver.active.get_current_stream(0),
        "torch current_stream": lambda: torch.cuda.current_stream().cuda_stream,
    }
    binder = jitted.device_caches[driver.active.get_current_device()][-1]
    opts = dict(kw, debug=False)
    try:
        bound, _, _ = binder(*call_args, **opts)
        rows["binder"] = lambda: binder(*call_args, **opts)
    except Exception as exc:  # noqa: BLE001 - report what this Triton version wants
        print(f"binder call failed: {exc!r}")
        bound = None
    stream = driver.active.get_current_stream(0)
    if bound is not None:
        vals = tuple(bound.values())
        try:
            kernel.run(
                1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals
            )
            rows["compiled kernel.run direct"] = lambda: kernel.run(
                1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals
            )
        except Exception as exc:  # noqa: BLE001
            print(f"direct kernel.run failed: {exc!r}")
    for name, fn in rows.items():
        print(f"  {name:32s} {_us(fn):7.2f} us host per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
