"""Benchmark: the student CE, reference (fp32 copy + log-softmax) vs the row_ce kernels, fwd + bwd.

For each (B, T) shape at vocab V (bf16 logits, a token mask with a padded tail) it times the
forward and backward of :func:`xtoken_core.losses.backends.reference.student_ce_loss` (the logits
cast to fp32, a full log-softmax, the same again in the backward) and of
:func:`xtoken_core.kernels.row_ce.row_cross_entropy` (the kernel backend's CE:
each row's logsumexp, target logit and argmax on the bf16 logits; a one-pass backward), and
reports the median ms, the peak memory above the inputs (GiB, and as a multiple of the logits'
bytes: the gradient alone is 1x), the loss's relative difference and the gradients' cosine.
``ms_kernel_lse`` is the kernels given the rows' logsumexps (what gold at temperature 1 hands
them; made outside the timed call). ``floor_ms`` is the fewest bytes a fwd + bwd must move
(the logits read twice, the gradient written once) over the measured device-to-device copy rate.

Prints one table and appends rows to benchmarks/results/losses_ce.jsonl (CUDA only).
GPU: ``python benchmarks/losses/bench_ce.py``; CPU smoke run (tiny shapes, the kernels in the
Triton interpreter, no results file): ``python benchmarks/losses/bench_ce.py --device cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402

from xtoken_core.kernels.logit_rows import row_logsumexp  # noqa: E402
from xtoken_core.kernels.row_ce import row_cross_entropy  # noqa: E402
from xtoken_core.losses.backends.reference import student_ce_loss  # noqa: E402

SHAPES = [(1, 4096), (4, 2048)]
VOCAB = 151936
SMOKE_SHAPES, SMOKE_VOCAB = [(1, 64), (2, 33)], 1007
GIB = float(1 << 30)


def _inputs(B: int, T: int, V: int, device: torch.device):
    """bf16 logits (std 3), random ids, a token mask whose last sample has a padded tail."""
    gen = torch.Generator(device=device).manual_seed(B * T + V)
    logits = (torch.randn(B, T, V, generator=gen, device=device) * 3).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), generator=gen, device=device)
    token_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    token_mask[-1, -T // 8 :] = False
    sample_mask = torch.ones(B, dtype=torch.bool, device=device)
    return logits, ids, token_mask, sample_mask


def _fwd_bwd(fn, x, *args, **kw):
    """One forward + backward of ``fn`` from a fresh gradient; returns (nll_sum, correct)."""

    def call():
        x.grad = None
        nll, correct, _ = fn(x, *args, **kw)
        nll.backward()
        return nll.detach(), correct

    return call


def run_shape(B: int, T: int, V: int, device: torch.device, reps: int, copy_bps) -> dict:
    logits, ids, token_mask, sample_mask = _inputs(B, T, V, device)
    x = logits.requires_grad_()
    targets = (ids, token_mask, sample_mask)
    ref = _fwd_bwd(student_ce_loss, x, *targets)
    ker = _fwd_bwd(row_cross_entropy, x, *targets)
    with torch.no_grad():
        lse_R = row_logsumexp(logits, None, 1.0)
    ker_lse = _fwd_bwd(row_cross_entropy, x, *targets, lse_R=lse_R)

    nll_ref, correct_ref = ref()
    grad_ref = x.grad.float()
    nll_ker, correct_ker = ker()
    grad_ker = x.grad.float()
    cosine = float((grad_ker * grad_ref).sum() / (grad_ker.norm() * grad_ref.norm()))
    del grad_ref, grad_ker
    x.grad = None
    logits_bytes = logits.numel() * logits.element_size()
    row = dict(
        bench="student_ce",
        B=B,
        T=T,
        V=V,
        dtype="bf16",
        ms_reference=_common.time_ms(ref, device.type, reps),
        ms_kernel=_common.time_ms(ker, device.type, reps),
        ms_kernel_lse=_common.time_ms(ker_lse, device.type, reps),
        loss_rel_diff=abs(float(nll_ker) - float(nll_ref)) / abs(float(nll_ref)),
        correct_equal=bool(float(correct_ker) == float(correct_ref)),
        grad_cosine=cosine,
        logits_gib=logits_bytes / GIB,
    )
    row["speedup"] = row["ms_reference"] / row["ms_kernel"]
    if device.type == "cuda":
        x.grad = None
        peak_ref = _common.extra_peak_bytes(ref)
        x.grad = None
        peak_ker = _common.extra_peak_bytes(ker)
        x.grad = None
        row.update(
            peak_gib_reference=peak_ref / GIB,
            peak_gib_kernel=peak_ker / GIB,
            peak_x_logits_reference=peak_ref / logits_bytes,
            peak_x_logits_kernel=peak_ker / logits_bytes,
            mem_ratio=peak_ref / max(peak_ker, 1),
            floor_ms=3 * logits_bytes / copy_bps * 1e3,
        )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", nargs="+", default=None, help="BxT, e.g. 1x4096 4x2048")
    parser.add_argument("--vocab", type=int, default=None, help=f"V (default {VOCAB})")
    parser.add_argument("--reps", type=int, default=5, help="timed runs on the CPU")
    parser.add_argument("--results", default="benchmarks/results/losses_ce.jsonl")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --device cpu)")
            return 1
        shapes, V = SHAPES, VOCAB
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels run interpreted on CPU tensors
        shapes, V = SMOKE_SHAPES, SMOKE_VOCAB
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    V = args.vocab or V
    copy_bps = _common.copy_bandwidth_gbs(1 << 30) * 1e9 if device.type == "cuda" else None
    meta = dict(commit=_common.commit(), device=_common.device_name(device), stack=_common.stack())
    rows = []
    for B, T in shapes:
        row = run_shape(B, T, V, device, args.reps, copy_bps)
        row.update(meta)
        if copy_bps:
            row["copy_gbs"] = copy_bps / 1e9
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    _common.print_table(
        rows,
        [
            "B",
            "T",
            "V",
            "ms_reference",
            "ms_kernel",
            "ms_kernel_lse",
            "speedup",
            "floor_ms",
            "peak_gib_reference",
            "peak_gib_kernel",
            "peak_x_logits_reference",
            "peak_x_logits_kernel",
            "loss_rel_diff",
            "grad_cosine",
            "correct_equal",
        ],
    )
    if device.type == "cuda":
        _common.append_rows(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
