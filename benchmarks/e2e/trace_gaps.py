"""Where a GPU waits: the idle gaps between kernels in a torch.profiler chrome trace, and the host
work that ran while the GPU had nothing queued.

A step whose phases (CUDA events) are longer than the same phases in ``bench_student_step.py``
spends the difference with the GPU idle, waiting for the host to queue the next kernel: a host
sync (a pageable copy, ``.item()``), the Python of a feed thread holding the GIL, a collective.
This reads a trace that ``trainer.observe.profile_steps`` wrote (``RUN_DIR/profile/*.json.gz``)
and prints the GPU's busy share of the traced window, the largest gaps, and for each the host
operations (``cpu_op`` and ``python_function`` events) that were running when it began, deepest
last; then the CUDA runtime calls that held the host longest (a synchronization, a copy from
pageable memory) with the operations around each.

Usage::

    python benchmarks/e2e/trace_gaps.py RUN_DIR/profile/trainer.rank0.step3.json.gz --top 15
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Trace categories of the GPU's own work (kernels, copies, memsets).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Trace categories of host work that may explain a gap.
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime")


@dataclass(frozen=True)
class Gap:
    """An interval with no GPU work queued.

    Attributes:
        start_us: when the last kernel before it ended (trace microseconds).
        length_us: its length.
        host: the host events running at ``start_us``, outermost first (names).
    """

    start_us: float
    length_us: float
    host: tuple[str, ...]


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The complete events (``ph == "X"``) of a chrome trace (``.json`` or ``.json.gz``).

    Raises:
        ValueError: a file that is not a chrome trace (names it).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a chrome trace ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list: not a chrome trace")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def gpu_intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The GPU's busy time as sorted, merged ``(start, end)`` intervals (every stream)."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") in GPU_CATEGORIES
    )
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def host_at(events: list[dict[str, Any]], t_us: float) -> tuple[str, ...]:
    """Names of the host events running at ``t_us``, outermost (longest) first."""
    running = [
        e
        for e in events
        if e.get("cat") in HOST_CATEGORIES
        and float(e["ts"]) <= t_us < float(e["ts"]) + float(e["dur"])
    ]
    running.sort(key=lambda e: -float(e["dur"]))
    return tuple(str(e.get("name", "?")) for e in running)


_OURS = re.compile(r"(?:^|/)((?:services|xtoken_core|benchmarks)/[^()]*\.py\(\d+\): .*)$")


def our_frame(host: tuple[str, ...]) -> str | None:
    """The innermost Python frame of this project's code among ``host`` (a trace taken with
    stacks, as the trainer's is: ``services/trainer/step.py(338): run``), its path from the
    package on; None when there is none."""
    for name in reversed(host):
        found = _OURS.search(name)
        if found:
            return found.group(1)
    return None


def gaps(events: list[dict[str, Any]], min_us: float = 50.0) -> tuple[float, float, list[Gap]]:
    """The traced window's length, the GPU's busy time in it, and its gaps of at least
    ``min_us``, longest first.

    Args:
        events: complete events of a trace (:func:`read_trace`).
        min_us: shortest gap reported.

    Returns:
        ``(window_us, busy_us, gaps)``: the window runs from the first to the last GPU event.
    """
    busy = gpu_intervals(events)
    if not busy:
        return 0.0, 0.0, []
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    found = [
        Gap(prev_end, start - prev_end, host_at(events, prev_end))
        for (_, prev_end), (start, _) in zip(busy, busy[1:])
        if start - prev_end >= min_us
    ]
    found.sort(key=lambda g: -g.length_us)
    return window, busy_us, found


def long_runtime_calls(
    events: list[dict[str, Any]], min_us: float = 1000.0
) -> list[tuple[float, str, tuple[str, ...]]]:
    """The CUDA runtime calls that took at least ``min_us`` on the host, longest first: where the
    host waited on the GPU (a synchronization, a copy from pageable memory, a full launch queue,
    an allocation), each with the host events around it, outermost first.

    Returns:
        ``(duration_us, name, host)`` per call.
    """
    out = []
    for e in events:
        if e.get("cat") != "cuda_runtime" or float(e["dur"]) < min_us:
            continue
        mid = float(e["ts"]) + float(e["dur"]) / 2
        host = tuple(n for n in host_at(events, mid) if n != e.get("name"))
        out.append((float(e["dur"]), str(e.get("name", "?")), host))
    out.sort(key=lambda c: -c[0])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a chrome trace (.json or .json.gz)")
    p.add_argument("--top", type=int, default=15, help="gaps printed")
    p.add_argument("--min-us", type=float, default=50.0, help="shortest gap counted")
    p.add_argument("--depth", type=int, default=4, help="innermost host events named per gap")
    p.add_argument(
        "--min-call-ms", type=float, default=1.0, help="shortest CUDA runtime call listed"
    )
    args = p.parse_args(argv)
    try:
        events = read_trace(args.trace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    window, busy, found = gaps(events, args.min_us)
    if not window:
        print(f"error: {args.trace} holds no GPU events (a CPU run's trace?)", file=sys.stderr)
        return 2
    idle = sum(g.length_us for g in found)
    print(
        f"window {window / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / window:.0%}), "
        f"{len(found)} gaps >= {args.min_us:.0f} us: {idle / 1e3:.1f} ms"
    )
    origin = gpu_intervals(events)[0][0]
    for g in found[: args.top]:
        host = " > ".join(g.host[-args.depth :]) or "(no host event)"
        print(
            f"{g.length_us / 1e3:8.2f} ms at +{(g.start_us - origin) / 1e3:7.1f} ms  {host}"
            + _from(g.host, args.depth)
        )
    calls = long_runtime_calls(events, args.min_call_ms * 1e3)
    print(f"{len(calls)} CUDA runtime calls of >= {args.min_call_ms:g} ms (the host waiting):")
    for dur, name, host in calls[: args.top]:
        print(f"{dur / 1e3:8.2f} ms  {' > '.join(host[-args.depth :])} > {name}" + _from(host, 1))
    return 0


def _from(host: tuple[str, ...], shown: int) -> str:
    """``  [from <our innermost frame>]`` where the innermost ``shown`` names leave it out."""
    frame = our_frame(host)
    if frame is None or any(frame in name for name in host[-shown:]):
        return ""
    return f"  [from {frame}]"


if __name__ == "__main__":
    raise SystemExit(main())
