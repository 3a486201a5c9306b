"""Shared helpers for the kernel benchmarks: device name, commit, copy bandwidth, timing, rows."""

import json
import os
import subprocess

import torch


def commit() -> str:
    """Short commit of the working tree (or $XTOKEN_COMMIT where .git did not travel)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("XTOKEN_COMMIT", "unknown")


def device_name() -> str:
    """Name of CUDA device 0."""
    return torch.cuda.get_device_name(0)


def bench_ms(fn, *, warmup=25, rep=200, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(
        triton.testing.do_bench(
            fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"
        )
    )


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep=300)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def extra_peak_bytes(fn, necessary_bytes: int) -> int:
    """Peak memory allocated while ``fn`` runs, beyond what was allocated before and the
    ``necessary_bytes`` of outputs (e.g. the result and the gradient)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - necessary_bytes


def append_rows(path: str, rows: list[dict]) -> None:
    """Append JSON rows to ``path`` (one per line)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Print rows as one fixed-width table (benchmarks are CLIs: print is their output)."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
