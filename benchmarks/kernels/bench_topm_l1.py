"""Benchmark: the gold loss's sorted top-m L1 from counts (kernels.topm_l1) vs torch.topk.

Usage (GPU):  python benchmarks/kernels/bench_topm_l1.py
Smoke (CPU):  TRITON_INTERPRET=1 python benchmarks/kernels/bench_topm_l1.py --quick

Rows of chunk-mean log-probs as the gold loss at 1x4096 sees them (N = 3276 chunks, 73,293
uncommon student columns against 52,429 teacher columns, m = 8192), for three teachers:
independent of the student, a tempered copy of it, and nearly the student itself (the count path's
hard case: the two sorted lists cross at almost every rank), and rows as bench_kd_loss's random
logits give them ("gold-bench"). Both paths are checked against each
other first. Rows are appended to benchmarks/results/kernels_topm_l1.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.kernels import topm_l1 as tm  # noqa: E402

RESULTS = _common.RESULTS_DIR / "kernels_topm_l1.jsonl"


def _rows(n, a, b, teacher, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    if teacher == "gold-bench":  # as bench_kd_loss: randn * 3 logits over the full vocabs
        vs, vt = a * 151936 // 73293, b * 131072 // 52429
        s_NA = torch.log_softmax(torch.randn(n, vs, generator=gen, device=device) * 3, -1)
        t_NB = torch.log_softmax(torch.randn(n, vt, generator=gen, device=device) * 3, -1)
        return s_NA[:, :a].contiguous(), t_NB[:, :b].contiguous()
    z = torch.randn(n, a, generator=gen, device=device) * 1.5
    s_NA = torch.log_softmax(z, -1)
    if teacher == "independent":
        t_NB = torch.log_softmax(torch.randn(n, b, generator=gen, device=device) * 1.5, -1)
    elif teacher == "tempered":
        t_NB = torch.log_softmax(z[:, :b] * 1.3, -1)
    else:  # "near": the student's own values, perturbed by 1e-4 nats
        t_NB = s_NA[:, :b] + 1e-4 * torch.randn(n, b, generator=gen, device=device)
    return s_NA.contiguous(), t_NB.contiguous()


def _falls_back(s_NA, t_NB, m):
    """Whether the count path hands rows to the reference (its pool or lists too small)."""
    calls = []
    original = tm._reference_signs
    tm._reference_signs = lambda *args: calls.append(1) or original(*args)
    try:
        tm.topm_l1(s_NA, t_NB, m)
    finally:
        tm._reference_signs = original
    return bool(calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter smoke)")
    parser.add_argument("--results", default=str(RESULTS), help="jsonl file the rows go to")
    parser.add_argument("--no-save", action="store_true", help="do not append to results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, a, b, m = (16, 700, 500, 80) if args.quick else (3276, 73293, 52429, 8192)
    reps = 2 if args.quick else 20
    rows = []
    for teacher in ("gold-bench", "independent", "tempered", "near"):
        s_NA, t_NB = _rows(n, a, b, teacher, device, seed=len(teacher))
        l1_ref, g_ref, gsum_ref = tm.topm_l1_reference(s_NA, t_NB, m)
        l1, g, gsum = tm.topm_l1(s_NA, t_NB, m)
        l1_err = ((l1 - l1_ref).abs() / l1_ref.abs().clamp_min(1e-30)).max().item()
        g_err = ((g - g_ref).norm() / g_ref.norm()).item()
        fell_back = _falls_back(s_NA, t_NB, m)
        stats = tm.plan_stats(s_NA, t_NB, m)
        ref = functools.partial(tm.topm_l1_reference, s_NA, t_NB, m)
        ms_ref = _common.time_ms(ref, device, reps)
        ms = _common.time_ms(functools.partial(tm.topm_l1, s_NA, t_NB, m), device, reps)
        rows.append(
            {
                "commit": _common.commit(),
                "device": _common.device_name(device),
                "rows": n,
                "student_cols": a,
                "teacher_cols": b,
                "m": m,
                "teacher": teacher,
                "topk_ms": round(ms_ref, 4),
                "counts_ms": round(ms, 4),
                "speedup": round(ms_ref / ms, 2),
                "fell_back": fell_back,
                "l1_max_rel_diff": l1_err,
                "g_rel_err": g_err,
                **{k: round(v, 1) for k, v in stats.items()},
            }
        )
        del s_NA, t_NB, g, g_ref
    cols = ["teacher", "topk_ms", "counts_ms", "speedup", "fell_back", "l1_max_rel_diff"]
    _common.print_table(rows, [*cols, "g_rel_err", "open_bins_mean", "open_elements_mean"])
    _common.print_table(rows, ["teacher", "open_bins_max", "open_elements_max", "rows_not_ok"])
    if not args.quick and not args.no_save:
        _common.append_rows(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
