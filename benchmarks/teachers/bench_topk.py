"""Benchmark: the loss error of top-K teacher targets (``teacher.transport: topk``) against the full
teacher logits, and the bytes per teacher token of every teacher transport.

The real SmolLM2-135M teacher reads texts of the demo corpus; a student of another tokenizer
(default qwen3, its projection built as ``xtoken projection build`` builds it) gives the student
logits. For each KD mode (P-KL, gold, relaxed gold) at the loss defaults, the loss and its
gradient w.r.t. the student logits are computed from the full fp32 teacher logits (the
reference), from the top-K targets decoded as the trainer decodes them (K = 8 ... 256, log-probs
in fp32 and in bf16), and from what the other transports carry at their default dtype (bf16
logits in a ring slot; bf16 hidden states through the teacher's output layer). Errors are
relative: ``|L - L_ref| / |L_ref|`` and ``||g - g_ref|| / ||g_ref||``.

Prints one table, appends its rows to benchmarks/results/teachers_topk.jsonl and rewrites
benchmarks/results/teachers_topk.md with the current figures (the figures it held move under its
``## Earlier`` heading).

    python benchmarks/teachers/bench_topk.py                      # 4 texts of 128 tokens, CPU
    python benchmarks/teachers/bench_topk.py --texts 2 --ctx 128 --no-write   # a quick look

Legend: B texts, T student tokens, U teacher tokens, V student vocab, W teacher vocab, d the
teacher's hidden size, K ids kept per teacher token.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.align import TokenAligner  # noqa: E402
from xtoken_core.data.collator import CrossTokenizerCollator  # noqa: E402
from xtoken_core.data.corpus import build_demo_corpus, read_texts  # noqa: E402
from xtoken_core.data.projection_build import build_projection  # noqa: E402
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig  # noqa: E402
from xtoken_core.models import load_model, split_lm_head  # noqa: E402
from xtoken_core.tokenizers import load_tokenizer  # noqa: E402
from xtoken_core.wire.topk import decode_topk, encode_topk, topk_bytes_per_token  # noqa: E402

JSONL = _common.RESULTS_DIR / "teachers_topk.jsonl"
MARKDOWN = _common.RESULTS_DIR / "teachers_topk.md"
KS = (8, 16, 32, 64, 128, 256)
MODES = {"pkl": "P-KL", "gold": "gold", "xtoken": "relaxed gold", "pkl-all": "P-KL, all columns"}
# The KD modes and their loss settings (the defaults, but pkl-all: P-KL over every teacher column).
MODE_SETTINGS = {
    "pkl": {"mode": "pkl"},
    "gold": {"mode": "gold"},
    "xtoken": {"mode": "xtoken"},
    "pkl-all": {"mode": "pkl", "vocab_topk": None},
}
# The log-prob dtype measured at every K; bf16 is measured at BF16_K (it adds nothing elsewhere).
BF16_K = 64
TEACHER = "smollm2"
COMMAND = "python benchmarks/teachers/bench_topk.py"


def add_material_args(p: argparse.ArgumentParser) -> None:
    """The flags of :func:`setup`'s material: the texts, their length and the student."""
    p.add_argument("--texts", type=int, default=4, help="demo-corpus texts (B)")
    p.add_argument("--ctx", type=int, default=128, help="most tokens per text on each side")
    p.add_argument("--student", default="qwen3", help="student tokenizer")
    p.add_argument("--student-model", default="tiny", help="student model spec")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_material_args(p)
    p.add_argument("--ks", default=",".join(map(str, KS)), help="K values, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` in float64."""
    return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def kd_loss_and_grad(
    loss_fn: CrossTokenizerLoss, zs_BTV: torch.Tensor, zt_BUW: torch.Tensor, batch: dict
) -> tuple[float, torch.Tensor]:
    """The KD loss and its gradient w.r.t. the student logits."""
    zs_BTV = zs_BTV.detach().requires_grad_()
    loss, _ = loss_fn(zs_BTV, zt_BUW, batch)
    (grad_BTV,) = torch.autograd.grad(loss, zs_BTV)
    return float(loss.detach()), grad_BTV


def setup(args: argparse.Namespace) -> tuple:
    """The measured material: the collated batch of ``args.texts`` demo texts, the SmolLM2
    teacher's backbone and output layer, its hidden states and fp32 logits ``[B, U, W]``, the
    student's logits ``[B, T, V]`` and the projection (as ``xtoken projection build`` builds it).

    Returns:
        ``(batch, projection, lm_head, hidden_BUd, zt_BUW, zs_BTV)``.
    """
    corpus = build_demo_corpus()
    texts = read_texts(corpus.train_path, args.texts)
    student_tok, teacher_tok = load_tokenizer(args.student), load_tokenizer(TEACHER)
    projection = build_projection(student_tok, teacher_tok, 8)  # xtoken projection build's K
    collator = CrossTokenizerCollator(
        student_tokenizer=student_tok,
        teacher_tokenizer=teacher_tok,
        aligner=TokenAligner(),
        ctx_length_student=args.ctx,
        ctx_length_teacher=args.ctx,
    )
    batch = collator(texts)

    teacher = load_model(TEACHER).eval()
    backbone, lm_head = split_lm_head(teacher)
    V = int(projection["indices"].shape[0])
    student = load_model(args.student_model, vocab_size=V, seed=0).eval()
    with torch.no_grad():
        hidden_BUd = backbone(batch["teacher_input_ids"], batch["teacher_token_mask"].long())
        zt_BUW = lm_head(hidden_BUd).float()
        zs_BTV = student(batch["input_ids"], attention_mask=batch["token_mask"].long()).logits
        zs_BTV = zs_BTV[..., :V].float()
    return batch, projection, lm_head, hidden_BUd, zt_BUW, zs_BTV


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    start = time.perf_counter()
    ks = [int(k) for k in args.ks.split(",")]
    modes = args.modes.split(",")
    batch, projection, lm_head, hidden_BUd, zt_BUW, zs_BTV = setup(args)
    W, V = zt_BUW.shape[-1], zs_BTV.shape[-1]
    with torch.no_grad():
        # what the other transports carry at their default logits_dtype (bfloat16)
        ring_BUW = zt_BUW.to(torch.bfloat16)
        hidden_BUW = lm_head(hidden_BUd.to(torch.bfloat16).float()).float()
    d = int(hidden_BUd.shape[-1])
    mask_BU = batch["teacher_token_mask"]
    B, U = mask_BU.shape
    print(
        f"{B} texts, {int(batch['token_mask'].sum())} student / {int(mask_BU.sum())} teacher "
        f"tokens; W={W}, d={d}, V={V} ({time.perf_counter() - start:.0f} s to set up)",
        flush=True,
    )

    # what travels, per variant: (transports, K, dtype, bytes per teacher token, dense teacher);
    # shm and cuda_ipc carry the same bf16 logits: measured once, a row each
    variants = [
        (("shm", "cuda_ipc"), None, "bfloat16", 2 * W, ring_BUW),
        (("hidden",), None, "bfloat16", 2 * d, hidden_BUW),
    ]
    mass: dict[tuple[int, str], float] = {}
    # K = W: no truncation at all, the decode gives the logits themselves
    for k in [*ks, W]:
        dtypes = [("float32", torch.float32)] + (
            [("bfloat16", torch.bfloat16)] if k == BF16_K else []
        )
        for name, dtype in dtypes:
            targets = encode_topk(zt_BUW, k, logprobs_dtype=dtype)
            dense_BUW = decode_topk(targets, W)
            variants.append((("topk",), k, name, topk_bytes_per_token(k, dtype), dense_BUW))
            kept_BU = targets.logprobs_NK.float().exp().sum(-1)
            mass[(k, name)] = float(kept_BU[mask_BU].mean())

    common = {
        "date": dt.date.today().isoformat(),
        "commit": _common.commit(),
        "device": _common.cpu_name(),
        "teacher": TEACHER,
        "student": f"{args.student}:{args.student_model}",
        "texts": B,
        "teacher_tokens": int(mask_BU.sum()),
        "student_tokens": int(batch["token_mask"].sum()),
        "W": W,
    }
    rows = []
    for mode in modes:
        config = CrossTokenizerLossConfig(
            projection=(projection["indices"], projection["likelihoods"]),
            ce_weight=0.0,
            **MODE_SETTINGS[mode],
        )
        loss_fn = CrossTokenizerLoss(config)
        ref_loss, ref_grad = kd_loss_and_grad(loss_fn, zs_BTV, zt_BUW, batch)
        rows.append({
            **common, "transport": "logits fp32", "K": None, "dtype": "float32", "mode": mode,
            "bytes_per_teacher_token": 4 * W, "loss": ref_loss, "loss_rel_err": 0.0,
            "grad_rel_err": 0.0, "topk_mass": None,
        })  # fmt: skip
        for transports, k, dtype, nbytes, dense_BUW in variants:
            loss, grad = kd_loss_and_grad(loss_fn, zs_BTV, dense_BUW, batch)
            rows += [{
                **common, "transport": transport, "K": k, "dtype": dtype, "mode": mode,
                "bytes_per_teacher_token": nbytes, "loss": loss,
                "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                "grad_rel_err": relative(grad, ref_grad),
                "topk_mass": mass.get((k, dtype)),
            } for transport in transports]  # fmt: skip
        print(f"[{mode}] done at {time.perf_counter() - start:.0f} s", flush=True)

    cols = ["mode", "transport", "K", "dtype", "bytes_per_teacher_token", "topk_mass"]
    _common.print_table(rows, [*cols, "loss", "loss_rel_err", "grad_rel_err"])
    if not args.no_write:
        _common.append_rows(JSONL, rows)
        previous = MARKDOWN.read_text(encoding="utf-8") if MARKDOWN.exists() else ""
        text = markdown(rows, time.perf_counter() - start) + earlier(previous)
        MARKDOWN.write_text(text, encoding="utf-8")
        print(f"wrote {JSONL} and {MARKDOWN}")
    return 0


def _pct(value: float | None) -> str:
    if value is None:
        return ""
    return "0" if value == 0 else f"{100 * value:.3g}%" if value >= 0.995 else f"{100 * value:.2g}%"


def markdown(rows: list[dict], seconds: float) -> str:
    """The results file: the current figures, the command, one table per question."""
    first = rows[0]
    by = {(r["mode"], r["transport"], r["K"], r["dtype"]): r for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    ks = sorted({r["K"] for r in rows if r["transport"] == "topk"})

    def err(mode: str, transport: str, k: int | None, dtype: str, key: str) -> str:
        r = by.get((mode, transport, k, dtype))
        return _pct(r[key]) if r else ""

    k64 = {m: by.get((m, "topk", 64, "float32")) for m in modes}
    W = first["W"]
    pkl_full = by.get(("pkl", "topk", W, "float32"))
    pkl_all = by.get(("pkl-all", "topk", 64, "float32"))
    ring = by.get(("gold", "shm", None, "bfloat16"))
    notes = []
    if pkl_full is not None:
        notes.append(
            "At K = W the decoded targets are the teacher's logits (the log-probs plus the "
            "log-partition sent with them), so P-KL at its default `vocab_topk` (8192 of "
            f"{W:,} columns, picked by the largest logit over the positions) picks the "
            f"reference's columns: off by {_pct(pkl_full['grad_rel_err'])} in its gradient."
        )
    if pkl_all is not None:
        pkl_64 = k64.get("pkl")
        notes.append(
            (
                "Below K = W it ranks columns whose values outside the top K are one value per "
                "position (the rest spread evenly), so it still picks other columns than the "
                f"reference: off by {_pct(pkl_64['grad_rel_err'])} in its gradient at K = 64. "
                if pkl_64 is not None
                else ""
            )
            + "With every column (`trainer.loss.vocab_topk: null`, rows `pkl-all`) P-KL is off "
            f"by {_pct(pkl_all['grad_rel_err'])} in its gradient at K = 64."
        )
    if ring is not None:
        notes.append(
            f"For scale: bf16 logits in a ring slot are off by {_pct(ring['grad_rel_err'])} "
            "(gold's gradient)."
        )
    lines = [
        "# Top-K teacher targets (`teacher.transport: topk`): loss error and bytes per token",
        "",
        f"**Current figures** (commit {first['commit']}, {first['date']}, {first['device']}; "
        f"teacher {first['teacher']}, W = {first['W']:,}; student {first['student']}; "
        f"{first['texts']} demo-corpus texts, {first['teacher_tokens']:,} teacher tokens; "
        f"{seconds:.0f} s wall on a machine shared with other jobs): at K = 64 (the default, fp32 log-probs, "
        f"{topk_bytes_per_token(64)} bytes per teacher token against "
        f"{2 * first['W']:,} for bf16 logits in a ring slot) the loss is off by "
        + ", ".join(f"{_pct(r['loss_rel_err'])} ({MODES.get(m, m)})" for m, r in k64.items() if r)
        + " and the gradient w.r.t. the student logits by "
        + ", ".join(f"{_pct(r['grad_rel_err'])}" for r in k64.values() if r)
        + f". Command: `{COMMAND}`.",
        "",
        *([" ".join(notes), ""] if notes else []),
        "Reference: the full fp32 teacher logits. `topk`: the targets decoded as the trainer "
        "decodes them (the logits at the top K ids, the rest mass spread evenly over the other "
        "ids). `shm` / `cuda_ipc`: "
        "bf16 logits in a ring slot; `hidden`: bf16 hidden states through the teacher's output "
        "layer (each at the default `teacher.logits_dtype`). Errors: `|L - L_ref| / |L_ref|` "
        "of the KD term and `||g - g_ref|| / ||g_ref||` of its gradient w.r.t. the student "
        "logits, at the loss defaults (temperature 1, P-KL's `vocab_topk` 8192, gold's "
        "`uncommon_topk` 8192). Mass: the teacher probability the top K hold, averaged over "
        "the teacher tokens. The student logits come from `--student-model` (`qwen3:tiny`: "
        "the qwen3 tokenizer, the tiny preset with random weights, a student at the start of "
        "distillation; one closer to the teacher has a smaller gradient, so a larger relative "
        "error). Rows: [teachers_topk.jsonl](teachers_topk.jsonl).",
        "",
        "| transport | K | log-probs | bytes / teacher token | mass | "
        + " | ".join(f"{MODES.get(m, m)} loss err | {MODES.get(m, m)} grad err" for m in modes)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(modes),
    ]
    plan = [("shm", None, "bfloat16"), ("cuda_ipc", None, "bfloat16"), ("hidden", None, "bfloat16")]
    plan += [("topk", k, "float32") for k in ks if k != BF16_K]
    plan += [("topk", BF16_K, "float32"), ("topk", BF16_K, "bfloat16")]
    plan.sort(key=lambda p: (p[0] == "topk", p[1] or 0, p[2] == "bfloat16"))
    for transport, k, dtype in plan:
        r = by.get((modes[0], transport, k, dtype))
        if r is None:
            continue
        cells = [
            transport,
            "" if k is None else str(k),
            dtype
            if transport == "topk"
            else f"(logits {dtype})"
            if transport != "hidden"
            else f"(hidden {dtype})",
            f"{r['bytes_per_teacher_token']:,}",
            _pct(r["topk_mass"]),
        ]
        for m in modes:
            cells += [
                err(m, transport, k, dtype, "loss_rel_err"),
                err(m, transport, k, dtype, "grad_rel_err"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def earlier(previous: str) -> str:
    """The ``## Earlier`` section of the results file: the figures ``previous`` (the file as it
    was) held as current, headed by their commit and date, above the earlier ones it kept."""
    current, _, older = previous.partition("\n## Earlier\n")
    body = current.split("\n", 1)[1].strip() if current.startswith("# ") else current.strip()
    if not body:
        return ""
    found = re.search(r"\(commit (\w+), ([\d-]+)", body)
    heading = f"### Commit {found[1]}, {found[2]}" if found else "### Earlier figures"
    body = body.replace("**Current figures**", "**Figures**", 1)
    return "\n## Earlier\n\n" + heading + "\n\n" + body + "\n" + older.rstrip("\n") + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
