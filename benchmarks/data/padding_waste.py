"""Padding's share of the tokens when the demo corpus is collated into micro-batches of B x T
(each micro-batch right-padded to its longest row), student and teacher side: one text per row,
and packed (``pack``: whole documents fill rows of T tokens per side, packed within each
put of ``--windows`` texts), with each row's fill and the valid chunks each layout keeps. CPU
only; no model.

For each shape the same ``--texts`` texts (the demo corpus from its start, cut at T tokens per
side, qwen3 student / mistral teacher) are laid out one per row, and packed at every window; the
rows go into micro-batches of B in put order (the feed sorts only within a step, by teacher
length, which the waste of full rows does not depend on).

Usage::

    python benchmarks/data/padding_waste.py --shapes 4x2048 1x4096 --windows 16 64 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS_DIR, append_rows, commit, cpu_name  # noqa: E402


def _micro_batches(rows: list[dict], B: int, pad_kwargs: dict) -> list[dict]:
    from xtoken_core.data.sample import pad_samples

    return [pad_samples(rows[i : i + B], **pad_kwargs) for i in range(0, len(rows), B)]


def _measure(batches: list[dict], T: int) -> dict:
    """Per side: padding's share of the padded tokens, and real tokens per row of T."""
    rows = sum(b["input_ids"].shape[0] for b in batches)
    out = {"rows": rows, "micro_batches": len(batches)}
    for side, ids, lengths in (
        ("student", "input_ids", "input_lengths"),
        ("teacher", "teacher_input_ids", "teacher_input_lengths"),
    ):
        real = sum(int(b[lengths].sum()) for b in batches)
        padded = sum(b[ids].numel() for b in batches)
        out[f"{side}_waste"] = 1 - real / padded
        out[f"{side}_fill"] = real / (rows * T)
        out[f"{side}_tokens"] = real
    out["valid_chunks"] = sum(int(b["alignment_pair_valid"].sum()) for b in batches)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4x2048", "1x4096"])
    p.add_argument("--texts", type=int, default=512, help="texts of the demo corpus per shape")
    p.add_argument(
        "--windows", nargs="+", type=int, default=[16, 64, 256], help="texts per put, packed"
    )
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument(
        "--results",
        default=str(RESULTS_DIR / "data_padding_waste.jsonl"),
        help="rows appended here",
    )
    args = p.parse_args()
    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.data.corpus import build_demo_corpus, iter_texts
    from xtoken_core.tokenizers import load_tokenizer

    texts = [t for _, t in iter_texts(str(build_demo_corpus().train_path))][: args.texts]
    student = load_tokenizer(args.student_tokenizer)
    teacher = load_tokenizer(args.teacher_tokenizer)
    stamp = {"commit": commit(), "device": cpu_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"{len(texts)} demo-corpus texts, {args.student_tokenizer} / {args.teacher_tokenizer}")
    print(
        f"{'shape':>7} {'layout':>14} {'rows':>5} {'mbs':>4} {'waste':>6} {'fill':>6} "
        f"{'t waste':>7} {'t fill':>6} {'tokens':>7} {'chunks kept':>11}"
    )
    out = []
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))

        def collator(pack: bool, T: int = T) -> CrossTokenizerCollator:
            return CrossTokenizerCollator(
                student_tokenizer=student,
                teacher_tokenizer=teacher,
                aligner=TokenAligner(),
                ctx_length_student=T,
                ctx_length_teacher=T,
                pack=pack,
            )

        plain = collator(False)
        layouts = {"one text/row": plain.collate_samples(texts)}
        packer = collator(True)
        for w in args.windows:
            layouts[f"packed, w={w}"] = [
                row
                for i in range(0, len(texts), w)
                for row in packer.collate_samples(texts[i : i + w])
            ]
        base = None
        for layout, rows in layouts.items():
            m = _measure(_micro_batches(rows, B, plain.pad_kwargs()), T)
            base = base or m
            kept = m["valid_chunks"] / base["valid_chunks"]
            print(
                f"{shape:>7} {layout:>14} {m['rows']:>5} {m['micro_batches']:>4} "
                f"{m['student_waste']:>6.3f} {m['student_fill']:>6.3f} "
                f"{m['teacher_waste']:>7.3f} {m['teacher_fill']:>6.3f} "
                f"{m['student_tokens']:>7} {kept:>11.4f}"
            )
            out.append({**stamp, "shape": shape, "layout": layout, "texts": len(texts), **m,
                        "chunks_kept": kept})  # fmt: skip
    append_rows(args.results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
