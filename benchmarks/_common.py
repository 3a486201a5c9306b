"""Shared benchmark helpers: commit, machine description, timing, peak memory, result rows, tables.

A benchmark script imports this module after putting ``benchmarks/`` on ``sys.path``::

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import _common  # noqa: E402
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------- what ran where


def commit() -> str:
    """Short commit that was measured: $XTOKEN_COMMIT when set, else git HEAD, else "unknown".

    The variable wins because a copied working tree (the GPU device copy) can carry a stale
    ``.git`` whose HEAD is not the code being run.
    """
    env = os.environ.get("XTOKEN_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model(fallback: str = "cpu") -> str:
    """CPU model from /proc/cpuinfo where readable, else ``platform.processor()``, else ``fallback``."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or fallback


def usable_cores() -> int | None:
    """Cores this process may run on (its affinity mask where the OS has one, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_name() -> str:
    """CPU model (from /proc/cpuinfo where readable) and the cores this process may use."""
    return f"{cpu_model()}, {usable_cores()}-core CPU"


def device_name(device: str | torch.device = "cuda") -> str:
    """Name of CUDA device 0 for a CUDA ``device``, else :func:`cpu_name`."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(0)
    return cpu_name()


def stack() -> str:
    """The versions a kernel timing depends on: torch and Triton (the compiler of the kernels)."""
    try:
        import triton

        compiler = f"triton {triton.__version__}"
    except ImportError:
        compiler = "no triton"
    return f"torch {torch.__version__}, {compiler}"


# --------------------------------------------------------------------------- timing


def bench_ms(fn: Callable[[], object], *, warmup=25, rep=200, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(
        triton.testing.do_bench(
            fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"
        )
    )


def cpu_median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall-clock milliseconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_ms(fn: Callable[[], object], device: str, reps: int, *, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn``: :func:`bench_ms` (``warmup``/``rep`` in ms) on CUDA, else
    :func:`cpu_median_ms` over ``reps`` calls."""
    if device == "cuda":
        return bench_ms(fn, warmup=warmup, rep=rep)
    return cpu_median_ms(fn, reps)


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep=300)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def extra_peak_bytes(fn: Callable[[], object], necessary_bytes: int = 0) -> int:
    """Peak CUDA memory allocated while ``fn`` runs, beyond what was allocated before and the
    ``necessary_bytes`` of outputs (e.g. the result and the gradient); the result is kept
    alive until the peak is read."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - necessary_bytes
    del result
    return peak


def timed_steps(steps: list[dict], warmup: int, exclude: Iterable[int] = ()) -> list[tuple]:
    """A run's steady steps with their durations, from its step records.

    A step's record is written once the next step is queued (the last one's at once, at the
    end), so the records' ``time`` says nothing exact about when a step ran. Each record's
    ``started`` (the wall-clock time its step began) does: a measured step lasts from its start
    to the next step's, which holds every launch, wait and gap between them; the last step,
    with no next one, is not timed.

    Args:
        steps: a rank's ``step`` records in order.
        warmup: the steps left out.
        exclude: more steps left out (a profiled step and the trace's export are no steady
            step).

    Returns:
        ``(record, seconds)`` per timed step.
    """
    skip = set(exclude)
    measured = [r for r in steps if r["step"] > warmup and "started" in r]
    return [
        (r, after["started"] - r["started"])
        for r, after in zip(measured, measured[1:])
        if r["step"] not in skip and after["step"] == r["step"] + 1
    ]


def steady_rate(
    steps: list[dict], warmup: int, exclude: Iterable[int] = ()
) -> tuple[float | None, float | None, int]:
    """Tokens per second of a run's steady steps (:func:`timed_steps`).

    Returns:
        ``(tokens_per_s, span_s, counted)``: the tokens of the timed steps over the sum of
        their durations ``span_s``; ``(None, None, 0)`` when no step has a next one to time it.
    """
    timed = timed_steps(steps, warmup, exclude)
    if not timed:
        return None, None, 0
    span = sum(s for _, s in timed)
    tokens = sum(r["tokens"] for r, _ in timed)
    return (tokens / span if span > 0 else None), span, len(timed)


# --------------------------------------------------------------------------- output


def append_rows(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Append JSON rows to ``path`` (one per line), creating its folder.

    Returns:
        The number of rows written.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            n += 1
    return n


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Print rows as one fixed-width table (benchmarks are CLIs: print is their output)."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def print_cells(headers: list[str], cells: list[list[str]]) -> None:
    """Print already formatted ``cells`` (one list per row) under ``headers``, right-justified."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
