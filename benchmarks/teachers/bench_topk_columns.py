"""Benchmark: why P-KL over a column subset (``trainer.loss.vocab_topk``) is off with top-K teacher
targets, and what other readings of the targets give.

On ``bench_topk.py``'s material (SmolLM2-135M teacher over demo-corpus texts, the student logits
of another tokenizer), for each K: the distinct ids the positions sent, how many of the 8,192
columns P-KL keeps from the decoded targets are the ones it keeps from the full logits, and the
gradient error of P-KL w.r.t. the student logits against the full logits for

* ``spread``: the targets as decoded (the rest spread evenly over the ids not sent: the default);
* ``nothing``: the rest put on nothing (ids not sent at the floor, far below the sent ones);
* ``cap``: the kept columns capped at the number of distinct ids sent;
* ``all-columns``: P-KL over every column (``vocab_topk: null``), the spread decode.

Prints one table, appends its rows to benchmarks/results/teachers_topk_columns.jsonl and rewrites
benchmarks/results/teachers_topk_columns.md.

    python benchmarks/teachers/bench_topk_columns.py                # K = 32, 64, 256, 1024
    python benchmarks/teachers/bench_topk_columns.py --texts 1 --ks 8 --no-write

Legend: B texts, T student tokens, U teacher tokens, V student vocab, W teacher vocab, K ids kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import bench_topk  # noqa: E402

from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig  # noqa: E402
from xtoken_core.losses.alignment import alignment_from_batch, valid_chunks  # noqa: E402
from xtoken_core.losses.modes.pkl import select_teacher_columns  # noqa: E402
from xtoken_core.wire.topk import LOG_FLOOR, decode_topk, encode_topk  # noqa: E402

JSONL = _common.RESULTS_DIR / "teachers_topk_columns.jsonl"
MARKDOWN = _common.RESULTS_DIR / "teachers_topk_columns.md"
COMMAND = "python benchmarks/teachers/bench_topk_columns.py"
KEPT = 8192  # P-KL's default vocab_topk


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_topk.add_material_args(p)
    p.add_argument("--ks", default="32,64,256,1024", help="K values, comma-separated")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def nothing_decode(targets, width: int) -> torch.Tensor:
    """``[B, U, W]``: the sent ids at their logits, every other id at the floor (the rest on
    nothing)."""
    top_BUK = targets.logprobs_NK.float() + targets.lse_N[..., None]
    floor_BUW = (targets.lse_N + LOG_FLOOR)[..., None].expand(*targets.lse_N.shape, width)
    return floor_BUW.contiguous().scatter_(-1, targets.ids_NK.long(), top_BUK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    start = time.perf_counter()
    batch, projection, _, _, zt_BUW, zs_BTV = bench_topk.setup(args)
    W = int(zt_BUW.shape[-1])
    used_BU = batch["teacher_token_mask"].bool()

    def pkl(z_BUW: torch.Tensor, vocab_topk: int | None) -> torch.Tensor:
        config = CrossTokenizerLossConfig(
            projection=(projection["indices"], projection["likelihoods"]),
            ce_weight=0.0,
            mode="pkl",
            vocab_topk=vocab_topk,
        )
        return bench_topk.kd_loss_and_grad(CrossTokenizerLoss(config), zs_BTV, z_BUW, batch)[1]

    config = CrossTokenizerLossConfig(projection=(projection["indices"], projection["likelihoods"]))
    _, t_ids_BU, _ = valid_chunks(alignment_from_batch(batch, 0), config, batch.get("sample_mask"))
    ref_grad = pkl(zt_BUW, KEPT)
    ref_all = pkl(zt_BUW, None)
    ref_cols = set(select_teacher_columns(zt_BUW, t_ids_BU, KEPT).tolist())
    common = {
        "date": dt.date.today().isoformat(),
        "commit": _common.commit(),
        "device": _common.cpu_name(),
        "teacher": bench_topk.TEACHER,
        "student": f"{args.student}:{args.student_model}",
        "texts": int(used_BU.shape[0]),
        "teacher_tokens": int(used_BU.sum()),
        "W": W,
        "vocab_topk": KEPT,
    }
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        targets = encode_topk(zt_BUW, k)
        spread_BUW = decode_topk(targets, W)
        sent = int(torch.unique(targets.ids_NK[used_BU]).numel())
        cols = set(select_teacher_columns(spread_BUW, t_ids_BU, KEPT).tolist())
        rows.append({
            **common, "K": k, "distinct_ids_sent": sent, "kept_as_reference": len(cols & ref_cols),
            "grad_rel_err_spread": bench_topk.relative(pkl(spread_BUW, KEPT), ref_grad),
            "grad_rel_err_nothing": bench_topk.relative(
                pkl(nothing_decode(targets, W), KEPT), ref_grad
            ),
            "grad_rel_err_cap": bench_topk.relative(pkl(spread_BUW, min(KEPT, sent)), ref_grad),
            "grad_rel_err_all_columns": bench_topk.relative(pkl(spread_BUW, None), ref_all),
        })  # fmt: skip
        print(f"K={k} done at {time.perf_counter() - start:.0f} s", flush=True)
    cols = [
        "K", "distinct_ids_sent", "kept_as_reference", "grad_rel_err_spread",
        "grad_rel_err_nothing", "grad_rel_err_cap", "grad_rel_err_all_columns",
    ]  # fmt: skip
    _common.print_table(rows, cols)
    if not args.no_write:
        _common.append_rows(JSONL, rows)
        MARKDOWN.write_text(markdown(rows, time.perf_counter() - start), encoding="utf-8")
        print(f"wrote {JSONL} and {MARKDOWN}")
    return 0


def markdown(rows: list[dict], seconds: float) -> str:
    """The results file: the current figures first, then the table."""
    r0 = rows[0]
    lines = [
        "# P-KL's column pick over top-K teacher targets",
        "",
        f"**Current figures** (commit {r0['commit']}, {r0['date']}, {r0['device']}; teacher "
        f"{r0['teacher']}, W = {r0['W']:,}; student {r0['student']}; {r0['texts']} demo-corpus "
        f"texts, {r0['teacher_tokens']} teacher tokens; {seconds:.0f} s). Command: `{COMMAND}`.",
        "",
        f"P-KL keeps the {r0['vocab_topk']:,} teacher columns with the largest logit over the "
        "positions. From top-K targets it picks other columns than from the full logits even "
        "where more distinct ids were sent than it keeps, because each position's logits carry "
        "its own shift and a column a position did not send holds that position's fill; and "
        "its gradient w.r.t. the student logits stays far off for every reading of the targets. "
        "Over every column (`trainer.loss.vocab_topk: null`) it is close: the setting for top-K "
        "targets (the `topk` transport, a teacher cache). Errors: `||g - g_ref|| / ||g_ref||` "
        "against the full fp32 logits at the same setting.",
        "",
        "| K | distinct ids sent | kept columns as the reference's | grad err, spread (default) "
        "| rest on nothing | kept capped at the ids sent | every column |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['K']} | {r['distinct_ids_sent']:,} | {r['kept_as_reference']:,} of "
            f"{r['vocab_topk']:,} | {r['grad_rel_err_spread']:.1%} | "
            f"{r['grad_rel_err_nothing']:.1%} | {r['grad_rel_err_cap']:.1%} | "
            f"{r['grad_rel_err_all_columns']:.1%} |"
        )
    lines += ["", f"Rows: [{JSONL.name}]({JSONL.name}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
