"""Benchmark: block sizes of the P-KL projection backward kernel (pkl_projection._proj_bwd_kernel).

Also sweeps the chunk-KL backward (pkl_chunk_kl) and the projection forward block sizes.

Times ``pkl_projection.project_rows_backward`` (read the logits, gather ``dq`` through the restricted
ELL table, write ``dz``) at the KD-loss benchmark's shape (bf16 logits, V_s 151,936, V_t
131,072, 8,192 selected teacher columns, 8-entry projection rows) for a few
``(pbwd_block_n, pbwd_block_v, pbwd_warps)`` choices, with ``dq`` stored row-major ([R, K], as
autograd hands it) and column-major ([K, R], as pkl_chunk_kl writes it: one gather of column j
reads the block's rows from one or two sectors). Prints one table, appends rows to
benchmarks/results/losses_pkl_backward.jsonl and, with ``--best``, writes the fastest choice as
JSON (``bench_kd_loss.py --kernel-config`` reads it). GPU only.

``--baseline DIR`` times the default configuration against another tree's kernel in one run:
``DIR`` is a checkout of the baseline commit (``git worktree add DIR <rev>``); this script runs
with ``--kernel-only`` importing that tree's ``xtoken_core``, then here, on the same seeded
inputs; the rows carry ``tree`` (``baseline`` or ``current``), the ratio and whether the gradients
are bitwise equal (``dz_sha``). ``--projection FILE`` uses a real projection file (as ``xtoken run``
caches one, e.g. Qwen3 students from DeepSeek teachers) instead of the synthetic one.

``--with-ce`` times the gradient of P-KL plus the student CE on the same logits two ways on the
same inputs: apart (the projection backward, the CE backward, and their sum, as autograd makes
it) and together (``project_rows_backward(..., ce=...)``: one read of the logits, one write of the
gradient); rows ``pkl_backward_with_ce`` with the ratio and the largest difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from bench_kd_loss import TEMPERATURE, VOCAB_TOPK, _projection  # noqa: E402

from xtoken_core.data.projection import Projection  # noqa: E402
from xtoken_core.kernels import logit_rows, pkl_chunk_kl, pkl_projection  # noqa: E402
from xtoken_core.losses.modes.pkl import PROB_EPS  # noqa: E402

#: (block_n, block_v, warps) candidates; the first is the default before the first sweep
#: (KERNEL_CONFIG now holds the winner, (16, 256, 4)).
CONFIGS = [
    (32, 256, 8),
    (16, 256, 4),
    (16, 512, 4),
    (16, 512, 8),
    (32, 128, 4),
    (32, 512, 8),
    (64, 128, 8),
    (64, 256, 8),
    (16, 1024, 8),
    (32, 256, 4),
    (64, 64, 4),
]
LAYOUTS = ("row", "col")
#: (klb_block_r, klb_block_k, klb_warps) candidates of the chunk-KL backward (pkl_chunk_kl),
#: which writes the column-major dq the projection backward reads; the first is the default.
KL_CONFIGS = [
    (8, 256, 4),
    (4, 256, 4),
    (2, 512, 4),
    (4, 512, 4),
    (2, 1024, 4),
    (1, 1024, 4),
    (1, 2048, 8),
    (16, 128, 4),
]
#: (proj_block_n, proj_block_e, proj_block_j, proj_warps) of the projection forward; first = default.
FWD_CONFIGS = [
    (32, 32, 32, 4),
    (64, 32, 32, 4),
    (32, 64, 32, 4),
    (16, 32, 64, 4),
    (32, 32, 64, 4),
    (64, 64, 32, 8),
    (16, 64, 32, 4),
    (32, 16, 32, 4),
    (64, 32, 64, 8),
]


def _sweep_projection_forward(z_BTV, lse_R, tables, device) -> list[dict]:
    """Time pkl_projection.project_rows_forward over FWD_CONFIGS; print a table."""
    keys = ("proj_block_n", "proj_block_e", "proj_block_j", "proj_warps")
    saved = {k: logit_rows.KERNEL_CONFIG[k] for k in keys}
    rows = []
    try:
        for cfg in FWD_CONFIGS:
            logit_rows.KERNEL_CONFIG.update(zip(keys, cfg, strict=True))
            ms = _common.bench_ms(
                lambda: pkl_projection.project_rows_forward(z_BTV, lse_R, *tables[:4], TEMPERATURE)
            )
            bn, be, bj, warps = cfg
            rows.append(
                dict(
                    bench="pkl_projection_forward",
                    commit=_common.commit(),
                    device=_common.device_name(device),
                    T=z_BTV.shape[1],
                    V_s=z_BTV.shape[2],
                    K=VOCAB_TOPK,
                    block_n=bn,
                    block_e=be,
                    block_j=bj,
                    warps=warps,
                    ms=ms,
                    gbs=z_BTV.numel() * z_BTV.element_size() / ms / 1e6,
                )
            )
    finally:
        logit_rows.KERNEL_CONFIG.update(saved)
    for row in rows:
        row["vs_default"] = rows[0]["ms"] / row["ms"]
    _common.print_table(rows, ["block_n", "block_e", "block_j", "warps", "ms", "gbs", "vs_default"])
    return rows


def _sweep_chunk_kl_backward(T: int, device, gen) -> list[dict]:
    """Time pkl_chunk_kl.chunk_kl_backward (column-major dq) over KL_CONFIGS; print a table."""
    K = VOCAB_TOPK
    nidx_R = torch.arange(T, device=device) * 4 // 5  # chunks of 1-2 rows, like the KD bench
    N = int(nidx_R[-1]) + 1
    offsets_N1 = torch.searchsorted(nidx_R, torch.arange(N + 1, device=device))
    q_RK = torch.rand(T, K, generator=gen, device=device) / K
    lp_NK = torch.log_softmax(torch.randn(N, K, generator=gen, device=device), -1)
    _, qc_NK, stats_N2 = pkl_chunk_kl.chunk_kl_forward(
        q_RK, torch.arange(T, device=device), offsets_N1, lp_NK, TEMPERATURE, False, PROB_EPS
    )
    grad = torch.ones(1, device=device)
    keys = ("klb_block_r", "klb_block_k", "klb_warps")
    saved = {k: logit_rows.KERNEL_CONFIG[k] for k in keys}
    rows = []
    try:
        for br, bk, warps in KL_CONFIGS:
            logit_rows.KERNEL_CONFIG.update(klb_block_r=br, klb_block_k=bk, klb_warps=warps)
            ms = _common.bench_ms(
                lambda: pkl_chunk_kl.chunk_kl_backward(
                    grad,
                    q_RK,
                    nidx_R,
                    offsets_N1,
                    lp_NK,
                    qc_NK,
                    stats_N2,
                    TEMPERATURE,
                    False,
                    PROB_EPS,
                )
            )
            rows.append(
                dict(
                    bench="pkl_chunk_kl_backward",
                    commit=_common.commit(),
                    device=_common.device_name(device),
                    T=T,
                    K=K,
                    N=N,
                    block_r=br,
                    block_k=bk,
                    warps=warps,
                    ms=ms,
                    # q read, dq written, the chunk rows of q_n and L read once
                    gbs=(2 * T + 2 * N) * K * 4 / ms / 1e6,
                )
            )
    finally:
        logit_rows.KERNEL_CONFIG.update(saved)
    for row in rows:
        row["vs_default"] = rows[0]["ms"] / row["ms"]
    _common.print_table(rows, ["block_r", "block_k", "warps", "ms", "gbs", "vs_default"])
    return rows


def _row_head(bench: str, device, T: int, V_s: int, tables) -> dict:
    """The keys every projection-backward row opens with."""
    return dict(
        bench=bench,
        commit=_common.commit(),
        device=_common.device_name(device),
        T=T,
        V_s=V_s,
        K=VOCAB_TOPK,
        P=int(tables[4].shape[0]),
    )


def _backward_inputs(z_BTV, device, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projection backward's seeded inputs at the default layout: the row logsumexps, ``dq``
    column-major (as pkl_chunk_kl writes it) and ``dot``."""
    T = z_BTV.shape[1]
    lse_R = logit_rows.row_logsumexp(z_BTV, torch.arange(T, device=device), TEMPERATURE)
    dq_RK = torch.randn(T, VOCAB_TOPK, generator=gen, device=device).t().contiguous().t()
    dot_R = torch.randn(T, generator=gen, device=device)
    return lse_R, dq_RK, dot_R


def _projection_name(args) -> str:
    """The rows' ``projection``: the file's name, or "synthetic"."""
    return os.path.basename(args.projection) if args.projection else "synthetic"


def _kernel_only(args, z_BTV, tables, device, gen) -> int:
    """Time the default config (column-major dq) at ``args.T``; with ``--baseline``, the other
    tree's kernel first, in its own process, then this one, and their ratio."""
    baseline = _run_baseline(args) if args.baseline else []
    T, V_s = z_BTV.shape[1:]
    lse_R, dq_RK, dot_R = _backward_inputs(z_BTV, device, gen)

    def run():
        return pkl_projection.project_rows_backward(
            z_BTV, lse_R, dq_RK, dot_R, *tables[4:], TEMPERATURE
        )

    dz = run()
    ms = _common.bench_ms(run)
    row = dict(
        **_row_head("pkl_backward_kernel", device, T, V_s, tables),
        tree=args.tree,
        projection=_projection_name(args),
        block_n=logit_rows.KERNEL_CONFIG["pbwd_block_n"],
        block_v=logit_rows.KERNEL_CONFIG["pbwd_block_v"],
        warps=logit_rows.KERNEL_CONFIG["pbwd_warps"],
        ms=ms,
        gbs=2 * z_BTV.numel() * z_BTV.element_size() / ms / 1e6,
        dz_sha=hashlib.sha256(dz.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16],
    )
    rows = baseline + [row]
    if baseline:
        row["vs_baseline"] = baseline[0]["ms"] / ms
        row["bitwise_equal"] = baseline[0]["dz_sha"] == row["dz_sha"]
    _common.print_table(rows, ["tree", "commit", "T", "projection", "ms", "gbs", "dz_sha"])
    if args.kernel_only and not args.baseline:
        print("ROW " + json.dumps(row))
    else:
        _common.append_rows(args.results, rows)
    return 0


def _with_ce(args, z_BTV, tables, device, gen) -> int:
    """The P-KL + CE gradient apart (two kernels and their sum) and together (one kernel)."""
    from xtoken_core.kernels import row_ce

    T, V_s = z_BTV.shape[1:]
    lse_R, dq_RK, dot_R = _backward_inputs(z_BTV, device, gen)
    ids = torch.randint(0, V_s, (1, T), generator=gen, device=device)
    _, ce_lse_R, target_R = row_ce.row_ce_forward(z_BTV, ids, None, None)
    g_1 = torch.tensor([0.5], device=device)
    ell = tables[4:]

    def apart():
        dz = row_ce.row_ce_backward(g_1, z_BTV, ce_lse_R, target_R)
        return dz.add_(
            pkl_projection.project_rows_backward(z_BTV, lse_R, dq_RK, dot_R, *ell, TEMPERATURE)
        )

    def together():
        return pkl_projection.project_rows_backward(
            z_BTV, lse_R, dq_RK, dot_R, *ell, TEMPERATURE, ce=(ce_lse_R, target_R, g_1)
        )

    diff = (apart().float() - together().float()).abs().max().item()
    rows = []
    for variant, fn in (("apart", apart), ("together", together)):
        rows.append(
            dict(
                **_row_head("pkl_backward_with_ce", device, T, V_s, tables),
                projection=_projection_name(args),
                temperature=TEMPERATURE,
                variant=variant,
                ms=_common.bench_ms(fn),
                max_abs_diff=diff,
            )
        )
    rows[1]["vs_apart"] = rows[0]["ms"] / rows[1]["ms"]
    _common.print_table(rows, ["variant", "T", "projection", "ms", "vs_apart", "max_abs_diff"])
    _common.append_rows(args.results, rows)
    return 0


def _run_baseline(args) -> list[dict]:
    """This script with ``--kernel-only``, importing ``xtoken_core`` from the baseline checkout
    (first on ``PYTHONPATH``); its row."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(args.baseline), env.get("PYTHONPATH")) if p
    )
    commit = args.baseline_commit
    if commit is None:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=args.baseline,
            capture_output=True,
            text=True,
        )
        commit = rev.stdout.strip() if rev.returncode == 0 else "unknown"
    env["XTOKEN_COMMIT"] = commit
    cmd = [sys.executable, os.path.abspath(__file__), "--kernel-only", "--T", str(args.T)]
    cmd += ["--tree", "baseline"] + (["--projection", args.projection] if args.projection else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode != 0 or not rows:
        raise SystemExit(f"the baseline run failed ({out.returncode}): {out.stderr[-2000:]}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/losses_pkl_backward.jsonl")
    parser.add_argument("--best", default=None, help="write the fastest config here (JSON)")
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--kernel-only", action="store_true", help="time the default config only")
    parser.add_argument("--baseline", default=None, help="a checkout of the baseline commit")
    parser.add_argument(
        "--baseline-commit", default=None, help="its commit, where DIR has no .git (an export)"
    )
    parser.add_argument("--projection", default=None, help="a projection file (.pt, top-k)")
    parser.add_argument("--tree", default="current", help="the rows' tree label")
    parser.add_argument(
        "--with-ce", action="store_true", help="P-KL + CE gradient: apart against together"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda")
    V_s, V_t, T = 151936, 131072, args.T
    torch.manual_seed(0)  # idx_K below draws from the global generator
    gen = torch.Generator(device=device).manual_seed(0)
    if args.projection:
        saved_topk = torch.load(args.projection, weights_only=False)
        V_t = int(saved_topk["meta"]["teacher_vocab_size"])
        V_s = max(V_s, saved_topk["indices"].shape[0])
    z_BTV = (torch.randn(1, T, V_s, generator=gen, device=device) * 3).to(torch.bfloat16)
    if args.projection:
        indices = saved_topk["indices"].to(device)
        likelihoods = saved_topk["likelihoods"].to(device)
    else:
        indices, likelihoods = _projection(V_s, V_t, gen, device)
    M = Projection.from_topk(indices, likelihoods, device).sparse(V_s, V_t)
    idx_K = torch.sort(torch.randperm(V_t, device=device)[:VOCAB_TOPK]).values
    tables = pkl_projection.restrict_tables(pkl_projection.build_projection_tables(M), idx_K)
    if args.with_ce:
        return _with_ce(args, z_BTV, tables, device, gen)
    if args.kernel_only or args.baseline:
        return _kernel_only(args, z_BTV, tables, device, gen)
    nidx_R = torch.arange(T, device=device)
    lse_R = logit_rows.row_logsumexp(z_BTV, nidx_R, TEMPERATURE)
    dq_row = torch.randn(T, VOCAB_TOPK, generator=gen, device=device)
    dq_by_layout = {"row": dq_row, "col": dq_row.t().contiguous().t()}
    dot_R = torch.randn(T, generator=gen, device=device)
    saved = {k: logit_rows.KERNEL_CONFIG[k] for k in ("pbwd_block_n", "pbwd_block_v", "pbwd_warps")}
    rows = []
    try:
        for (bn, bv, warps), layout in ((c, lay) for lay in LAYOUTS for c in CONFIGS):
            logit_rows.KERNEL_CONFIG.update(pbwd_block_n=bn, pbwd_block_v=bv, pbwd_warps=warps)
            dq_RK = dq_by_layout[layout]
            ms = _common.bench_ms(
                lambda dq_RK=dq_RK: pkl_projection.project_rows_backward(
                    z_BTV, lse_R, dq_RK, dot_R, *tables[4:], TEMPERATURE
                )
            )
            rows.append(
                dict(
                    **_row_head("pkl_backward", device, T, V_s, tables),
                    block_n=bn,
                    block_v=bv,
                    warps=warps,
                    dq=layout,
                    ms=ms,
                    gbs=2 * z_BTV.numel() * z_BTV.element_size() / ms / 1e6,
                )
            )
    finally:
        logit_rows.KERNEL_CONFIG.update(saved)
    for row in rows:
        row["vs_default"] = rows[0]["ms"] / row["ms"]
    _common.print_table(rows, ["dq", "block_n", "block_v", "warps", "ms", "gbs", "vs_default"])
    _common.append_rows(args.results, rows)
    best = min(rows, key=lambda r: r["ms"])
    kl_rows = _sweep_chunk_kl_backward(T, device, gen)
    _common.append_rows(args.results, kl_rows)
    kl_best = min(kl_rows, key=lambda r: r["ms"])
    fwd_rows = _sweep_projection_forward(z_BTV, lse_R, tables, device)
    _common.append_rows(args.results, fwd_rows)
    fwd_best = min(fwd_rows, key=lambda r: r["ms"])
    if args.best:
        with open(args.best, "w") as fh:
            json.dump(
                dict(
                    pbwd_block_n=best["block_n"],
                    pbwd_block_v=best["block_v"],
                    pbwd_warps=best["warps"],
                    klb_block_r=kl_best["block_r"],
                    klb_block_k=kl_best["block_k"],
                    klb_warps=kl_best["warps"],
                    proj_block_n=fwd_best["block_n"],
                    proj_block_e=fwd_best["block_e"],
                    proj_block_j=fwd_best["block_j"],
                    proj_warps=fwd_best["warps"],
                ),
                fh,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
