"""Benchmark: the whole KD loss, reference formulation vs the kernel-backed path (fwd + bwd).

For each mode (P-KL, gold, relaxed gold / xtoken), each (B, T, V_s, V_t) shape, bf16 logits and
~0.8 T chunks of 1-2 tokens per side, it times ``CrossTokenizerLoss(...)(...)`` forward and
backward with ``backend="reference"`` (one-hot bmm chunk averages, fp32 [B, T, V] copies) and
``backend="kernel"`` (the kernel backend, xtoken_core/losses/backends/kernel.py), and reports the median
time (at least 5 runs and 0.3 s of runs: the fast cases are host-bound, and host jitter is
their noise), the peak memory above the inputs, both ratios, the relative loss difference and the
relative gradient error (norm of the difference over the norm of the reference gradient).
Floors: ``floor_ms`` is the fewest bytes a fwd+bwd must move (student logits read twice, teacher
logits read once, the gradient written once) over the measured device-to-device copy rate;
``grad_gib`` is the gradient itself, the least memory the kernel path can peak at.
The CE term is off (ce_weight=0) so that only the KD term is measured.

``ms_kernel`` is the kernels launched eagerly, from a synchronized GPU to the end of the backward:
it includes the host's path to the first launch, while the GPU idles. ``ms_kernel_step`` (CUDA)
is the same call queued behind the student's lm_head matmul, as in a training step where the
forward still runs when the loss is called: the GPU's span from the end of that matmul to the end
of the backward (CUDA events), in which the host's start is hidden but every wait inside the loss
still counts. In the P-KL rows of older commits (the CUDA-graph replay of the KD phase, since
removed: benchmarks/results/history/e2e_pipeline.md) ``ms_kernel`` is the replay and ``ms_kernel_eager`` /
``speedup_eager`` the eager kernels, as ``ms_kernel`` is now.

Prints one table and appends rows to benchmarks/results/losses_kd_loss.jsonl.
GPU: ``python benchmarks/losses/bench_kd_loss.py``; CPU smoke run: ``--smoke``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402

from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig  # noqa: E402

# (V_s, V_t): Qwen3 student / Mistral-like teacher, Llama-3 student / Qwen3 teacher.
VOCAB_PAIRS = [(151936, 131072), (128256, 151936)]
SHAPES = [(b, t) for t in (1024, 4096) for b in (1, 2)]
MODES = ("pkl", "gold", "xtoken")
TEMPERATURE = 2.0
VOCAB_TOPK = 8192
PROJ_K = 8
#: The student's hidden size for ``ms_kernel_step``'s lm_head matmul ([B*T, H] x [H, V_s], bf16).
STEP_HIDDEN = 1024


def _chunk_ids(B: int, T: int, C: int, gen: torch.Generator, device) -> torch.Tensor:
    """Runs of 1-2 positions, ids < C, a padded tail of -1 (one row per sample, varied)."""
    rows = []
    for _ in range(B):
        lengths = torch.randint(1, 3, (T,), generator=gen, device=device)
        cid = torch.repeat_interleave(torch.arange(T, device=device), lengths)[:T]
        cid = torch.where(cid < C, cid, torch.full_like(cid, -1))
        cid[-8:] = -1
        rows.append(cid)
    return torch.stack(rows)


def _projection(V_s: int, V_t: int, gen: torch.Generator, device):
    """60% of the shared id range maps one-hot (common vocab); other rows get K random ids."""
    indices = torch.randint(0, V_t, (V_s, PROJ_K), generator=gen, device=device)
    likelihoods = torch.rand(V_s, PROJ_K, generator=gen, device=device) + 0.05
    likelihoods = likelihoods / likelihoods.sum(1, keepdim=True)
    n_exact = int(0.6 * min(V_s, V_t))
    indices[:n_exact, 0] = torch.arange(n_exact, device=device)
    indices[:n_exact, 1:] = -1
    likelihoods[:n_exact, 0] = 1.0
    likelihoods[:n_exact, 1:] = 0.0
    return indices, likelihoods


def _make_inputs(B, T, V_s, V_t, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    C = int(0.8 * T)
    student = (torch.randn(B, T, V_s, generator=gen, device=device) * 3).to(torch.bfloat16)
    teacher = (torch.randn(B, T, V_t, generator=gen, device=device) * 3).to(torch.bfloat16)
    batch = {
        "alignment_pair_valid": torch.ones(B, C, dtype=torch.bool, device=device),
        "alignment_pair_is_correct": torch.ones(B, C, dtype=torch.bool, device=device),
        "alignment_student_chunk_id": _chunk_ids(B, T, C, gen, device),
        "alignment_teacher_chunk_id": _chunk_ids(B, T, C, gen, device),
        "alignment_num_chunks": torch.full((B,), C, device=device),
    }
    return student, teacher, batch, _projection(V_s, V_t, gen, device), C


def make_loss(mode, projection, backend: str, check_inputs: bool = True) -> CrossTokenizerLoss:
    """The benchmarked loss: KD term only (``ce_weight=0``), the bench's temperature and top-k."""
    return CrossTokenizerLoss(
        CrossTokenizerLossConfig(
            projection=projection,
            mode=mode,
            temperature=TEMPERATURE,
            vocab_topk=VOCAB_TOPK,
            ce_weight=0.0,
            backend=backend,
            check_inputs=check_inputs,
        )
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(fn, device, reps: int, min_ms: float = 0.0) -> tuple[float, int]:
    """Median ms over at least ``reps`` runs and ``min_ms`` of runs, after one warm-up, and
    the peak bytes above the start (fast cases get more runs: host jitter is their noise)."""
    fn()
    _sync(device)
    times = []
    while len(times) < reps or sum(times) < min_ms:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def _measure_in_step(fn, ahead, reps: int) -> float:
    """Median ms of ``fn``'s GPU span queued behind ``ahead()``'s GPU work, over ``reps`` runs
    after one warm-up: from the end of that work to the end of ``fn``'s, by CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        ahead()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(
    mode, B, T, V_s, V_t, device, reps, copy_bps=None, check_inputs=True, min_ms=0.0
) -> dict:
    student, teacher, batch, projection, C = _make_inputs(B, T, V_s, V_t, device, seed=B * T)
    x = student.clone().requires_grad_()
    row = dict(
        bench="kd_loss",
        mode=mode,
        B=B,
        T=T,
        C=C,
        V_s=V_s,
        V_t=V_t,
        dtype="bf16",
        vocab_topk=VOCAB_TOPK if mode == "pkl" else None,
        check_inputs=check_inputs,
    )
    losses, grads = {}, {}
    for backend in ("reference", "kernel"):
        loss_fn = make_loss(mode, projection, backend, check_inputs)

        def fwd_bwd(loss_fn=loss_fn):
            x.grad = None
            loss, _ = loss_fn(x, teacher, batch)
            loss.backward()
            return loss

        try:
            losses[backend] = float(fwd_bwd().detach())
            grads[backend] = x.grad.float().clone()
            ms, peak = _measure(fwd_bwd, device, reps, min_ms)
            row[f"ms_{backend}"] = ms
            row[f"peak_gib_{backend}"] = peak / 2**30
            if backend == "kernel" and device.type == "cuda":
                hidden_BH = torch.randn(B * T, STEP_HIDDEN, device=device, dtype=student.dtype)
                lm_head_HV = torch.randn(STEP_HIDDEN, V_s, device=device, dtype=student.dtype)
                lm_head = functools.partial(torch.mm, hidden_BH, lm_head_HV)
                row["ms_kernel_step"] = _measure_in_step(
                    fwd_bwd, lm_head, max(reps, round(min_ms / ms))
                )
                del hidden_BH, lm_head_HV, lm_head
        except torch.OutOfMemoryError:
            row[f"ms_{backend}"] = "oom"
            row[f"peak_gib_{backend}"] = "oom"
        x.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "reference" in losses and "kernel" in losses:
        row["loss_rel_diff"] = abs(losses["kernel"] - losses["reference"]) / max(
            abs(losses["reference"]), 1e-30
        )
    if "reference" in grads and "kernel" in grads:
        ref_norm = grads["reference"].norm()
        row["grad_rel_err"] = float((grads["kernel"] - grads["reference"]).norm() / ref_norm)
    grads.clear()
    elt = student.element_size()
    row["grad_gib"] = B * T * V_s * elt / 2**30
    if copy_bps:
        row["floor_ms"] = (3 * B * T * V_s + B * T * V_t) * elt / copy_bps * 1e3
    if isinstance(row.get("ms_reference"), float) and isinstance(row.get("ms_kernel"), float):
        row["speedup"] = row["ms_reference"] / row["ms_kernel"]
        if row["peak_gib_kernel"]:
            row["mem_ratio"] = row["peak_gib_reference"] / row["peak_gib_kernel"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results/losses_kd_loss.jsonl")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--reps", type=int, default=5, help="at least this many timed runs")
    parser.add_argument(
        "--min-ms", type=float, default=300.0, help="and at least this much time of timed runs"
    )
    parser.add_argument(
        "--no-check-inputs",
        action="store_true",
        help="check_inputs=False for both backends (no finite/range scans of the logits)",
    )
    parser.add_argument("--shapes", nargs="+", default=None, help="BxT, e.g. 1x1024 2x4096")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes, no results file")
    parser.add_argument(
        "--kernel-config",
        default=None,
        help="JSON file of KERNEL_CONFIG overrides (e.g. bench_pkl_backward.py --best)",
    )
    args = parser.parse_args(argv)
    if args.kernel_config and os.path.exists(args.kernel_config):
        from xtoken_core.kernels.logit_rows import KERNEL_CONFIG

        with open(args.kernel_config) as fh:
            overrides = json.load(fh)
        KERNEL_CONFIG.update(overrides)
        print(f"KERNEL_CONFIG overrides: {overrides}", file=sys.stderr)
    if args.smoke:
        device, pairs, shapes = torch.device("cpu"), [(211, 197)], [(1, 64), (2, 64)]
    elif torch.cuda.is_available():
        device, pairs, shapes = torch.device("cuda"), VOCAB_PAIRS, SHAPES
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference bmm stays true fp32
    else:
        print("needs a CUDA device (or --smoke)")
        return 1
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    device_name = _common.device_name(device)
    commit, stack = _common.commit(), _common.stack()
    # Device-to-device copy rate in bytes/s (bytes read plus written) over 1 GiB.
    copy_bps = _common.copy_bandwidth_gbs(1 << 30) * 1e9 if device.type == "cuda" else None
    rows = []
    for V_s, V_t in pairs:
        for B, T in shapes:
            for mode in args.modes:
                row = run_case(
                    mode,
                    B,
                    T,
                    V_s,
                    V_t,
                    device,
                    args.reps,
                    copy_bps,
                    not args.no_check_inputs,
                    args.min_ms,
                )
                row.update(commit=commit, device=device_name, stack=stack)
                if copy_bps:
                    row["copy_gbs"] = copy_bps / 1e9
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    _common.print_table(
        rows,
        [
            "mode",
            "check_inputs",
            "B",
            "T",
            "V_s",
            "V_t",
            "ms_reference",
            "ms_kernel",
            "ms_kernel_step",
            "speedup",
            "peak_gib_reference",
            "peak_gib_kernel",
            "mem_ratio",
            "grad_gib",
            "floor_ms",
            "loss_rel_diff",
            "grad_rel_err",
        ],
    )
    if not args.smoke:
        _common.append_rows(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
