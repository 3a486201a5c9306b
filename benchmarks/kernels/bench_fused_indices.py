"""Benchmark: fused_indices_to_multihot (Triton) fwd+bwd vs the PyTorch reference.

Usage (GPU):  python benchmarks/kernels/bench_fused_indices.py
Smoke (CPU):  TRITON_INTERPRET=1 python benchmarks/kernels/bench_fused_indices.py --quick

Routing: every token picks its top-k of 2E global experts; the first E are local, so about half
of the slots are dropped, as on a rank holding half of the experts. Rows are appended to
benchmarks/results/kernels_fused_indices.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.ops import indices_to_multihot as fi  # noqa: E402

RESULTS = _common.RESULTS_DIR / "kernels_fused_indices.jsonl"


def _graph_ms(fn) -> float:
    """Median milliseconds of one CUDA-graph replay of fn() (launch and autograd overhead gone).

    Returns NaN when fn cannot be captured.
    """

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # capture is best effort; eager numbers are always reported
        print(f"graph capture failed: {exc}")
        return float("nan")
    return _common.bench_ms(graph.replay, warmup=25, rep=100)


def _inputs(n: int, k: int, e: int, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.rand(n, 2 * e, generator=gen, device=device)
    probs_NK, indices_NK = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    grad_NE = torch.randn(n, e, generator=gen, device=device)
    return indices_NK, probs_NK.contiguous(), grad_NE


def _fwd_bwd(convert, indices_NK, probs_NK, e, grad_NE):
    leaf = probs_NK.detach().requires_grad_(True)
    probs_NE = convert(indices_NK, leaf, e)
    (grad,) = torch.autograd.grad(probs_NE, leaf, grad_NE)
    return grad


def _autograd_floor(x):
    leaf = x.detach().requires_grad_(True)
    return torch.autograd.grad(leaf * 1.0, leaf, torch.ones_like(x))


def _fused(indices_NK, probs_NK, e):
    return fi.IndicesToMultihot.apply(indices_NK, probs_NK, e)[1]


def _reference(indices_NK, probs_NK, e):
    return fi.indices_to_multihot_reference(indices_NK, probs_NK, e)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter smoke)")
    parser.add_argument("--no-save", action="store_true", help="do not append to results")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_name = _common.device_name(device)
    if args.quick:
        grid = [(64, 2, 8), (128, 8, 64)]
    else:
        grid = [(n, k, e) for n in (4096, 65536) for e in (8, 64, 256) for k in (2, 8)]
    commit = args.commit or _common.commit()
    # What one eager torch.autograd.grad call costs with no real work: the eager f+b floor.
    tiny = torch.ones(4, device=device)
    floor_ms = _common.time_ms(functools.partial(_autograd_floor, tiny), device, 20)
    rows = []
    for n, k, e in grid:
        indices_NK, probs_NK, grad_NE = _inputs(n, k, e, device, seed=n + 7 * k + e)
        # Correctness first: same outputs and gradient as the reference on these inputs.
        ref = fi.indices_to_multihot_reference(indices_NK, probs_NK, e)
        out = fi.indices_to_multihot_forward(indices_NK, probs_NK, e)
        assert all(torch.equal(a, b) for a, b in zip(ref, out)), (n, k, e)
        assert torch.equal(
            _fwd_bwd(_fused, indices_NK, probs_NK, e, grad_NE),
            _fwd_bwd(_reference, indices_NK, probs_NK, e, grad_NE),
        ), (n, k, e)
        reps = 3 if args.quick else 20
        fwd_fused = functools.partial(fi.indices_to_multihot_forward, indices_NK, probs_NK, e)
        fwd_ref = functools.partial(fi.indices_to_multihot_reference, indices_NK, probs_NK, e)
        both = (indices_NK, probs_NK, e, grad_NE)
        t = {
            "fused_fwd_ms": _common.time_ms(fwd_fused, device, reps),
            "ref_fwd_ms": _common.time_ms(fwd_ref, device, reps),
            "fused_fwdbwd_ms": _common.time_ms(
                functools.partial(_fwd_bwd, _fused, *both), device, reps
            ),
            "ref_fwdbwd_ms": _common.time_ms(
                functools.partial(_fwd_bwd, _reference, *both), device, reps
            ),
        }
        if device == "cuda":
            # GPU time alone: replaying a captured graph removes launch and autograd overhead,
            # which dominate the eager numbers at these sizes.
            t["fused_fwdbwd_graph_ms"] = _graph_ms(functools.partial(_fwd_bwd, _fused, *both))
            t["ref_fwdbwd_graph_ms"] = _graph_ms(functools.partial(_fwd_bwd, _reference, *both))
        else:
            t["fused_fwdbwd_graph_ms"] = t["ref_fwdbwd_graph_ms"] = float("nan")
        # Fewest bytes: fwd reads ids+probs, writes mask+probs+position; bwd reads ids, the
        # position and grad at the K slots, writes the [N, K] grad.
        fwd_bytes = n * k * (8 + 4) + n * e * (1 + 4 + 1)
        bwd_bytes = n * k * (8 + 1 + 4 + 4)
        row = {
            "commit": commit,
            "device": dev_name,
            "tokens": n,
            "experts": e,
            "topk": k,
            **{key: round(v, 5) for key, v in t.items()},
            "fwd_speedup": round(t["ref_fwd_ms"] / t["fused_fwd_ms"], 2),
            "fwdbwd_speedup": round(t["ref_fwdbwd_ms"] / t["fused_fwdbwd_ms"], 2),
            "autograd_floor_ms": round(floor_ms, 5),
            "fwdbwd_graph_speedup": round(t["ref_fwdbwd_graph_ms"] / t["fused_fwdbwd_graph_ms"], 2),
            "fused_fwdbwd_graph_GBps": round(
                (fwd_bytes + bwd_bytes) / (t["fused_fwdbwd_graph_ms"] * 1e6), 1
            ),
        }
        rows.append(row)
    header = (
        f"{'tokens':>7} {'E':>4} {'K':>2} | {'fused fwd':>10} {'ref fwd':>10} {'x':>6} | "
        f"{'fused f+b':>10} {'ref f+b':>10} {'x':>6} | "
        f"{'graph f+b':>10} {'ref graph':>10} {'x':>6} {'GB/s':>7}"
    )
    print(f"fused_indices_to_multihot on {dev_name} (ms, median; x = reference / fused)")
    print(
        f"eager autograd floor (torch.autograd.grad of leaf * 1): {floor_ms:.4f} ms; "
        "graph = CUDA-graph replay (GPU time only)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['experts']:>4} {r['topk']:>2} | {r['fused_fwd_ms']:>10.4f} "
            f"{r['ref_fwd_ms']:>10.4f} {r['fwd_speedup']:>6.1f} | {r['fused_fwdbwd_ms']:>10.4f} "
            f"{r['ref_fwdbwd_ms']:>10.4f} {r['fwdbwd_speedup']:>6.1f} | "
            f"{r['fused_fwdbwd_graph_ms']:>10.4f} {r['ref_fwdbwd_graph_ms']:>10.4f} "
            f"{r['fwdbwd_graph_speedup']:>6.1f} {r['fused_fwdbwd_graph_GBps']:>7.1f}"
        )
    if not args.no_save and not args.quick:
        _common.append_rows(RESULTS, rows)
        print(f"appended {len(rows)} rows to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
