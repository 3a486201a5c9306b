"""Padding's share of the student tokens when the demo corpus is collated into micro-batches
(each micro-batch right-padded to its longest row), per B x T: what packing documents into rows
would win back. CPU only; no model.

Usage::

    python benchmarks/data/padding_waste.py --shapes 4x2048 1x4096 8x512 --batches 50
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import bench_pipeline as bp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4x2048", "1x4096"])
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    args = p.parse_args()
    from xtoken_core.data.corpus import build_demo_corpus

    corpus = Path(build_demo_corpus().train_path)
    print(f"{'shape':>7} {'waste':>6} {'mean row':>8} {'rows at T':>9} {'tokens / context':>16}")
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        batches = bp.collated(args, B, T, corpus, args.batches)
        real = sum(int(b["input_lengths"].sum()) for b in batches)
        padded = sum(b["input_ids"].numel() for b in batches)
        full = sum(int((b["input_lengths"] == T).sum()) for b in batches)
        rows = B * len(batches)
        print(
            f"{shape:>7} {1 - real / padded:>6.3f} {real / rows:>8.0f} {full:>4}/{rows:<4} "
            f"{real / (rows * T):>16.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
