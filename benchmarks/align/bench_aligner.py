"""Benchmark: TokenAligner throughput per tokenizer pair on demo-corpus texts at ctx 2048.

For each pair: the texts are tokenized by both tokenizers and cut to the context length, then
* aligner-only: ``TokenAligner.align_tokenized`` per sample (median ms/sample over rounds);
* tokenize+align: ``encode_batch`` on both sides, truncation and alignment (ms/sample);
* tokens/s counts the student and the teacher tokens of a sample.
Prints one table and appends its rows to benchmarks/results/align_aligner.jsonl.

    python benchmarks/align/bench_aligner.py                       # default pairs, 64 samples
    python benchmarks/align/bench_aligner.py --pairs qwen3:mistral --no-append
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.align import TokenAligner  # noqa: E402
from xtoken_core.data.corpus import build_demo_corpus, iter_texts  # noqa: E402
from xtoken_core.tokenizers import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "align_aligner.jsonl"
DEFAULT_PAIRS = (
    "qwen3:mistral",
    "qwen3:deepseek",
    "qwen3:llama3",
    "deepseek:mistral",
    "llama3:mistral",
    "deepseek:llama3",
)


def device_name() -> str:
    """``"<N>-core CPU <model>"`` of this machine (cores usable by this process)."""
    return f"{_common.usable_cores()}-core CPU {_common.cpu_model(fallback='unknown')}"


def run_fields() -> dict:
    """Fields every row of a run carries: commit, device, date and the 1-minute load average."""
    return {
        "commit": _common.commit(),
        "device": device_name(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def long_texts(num: int, min_chars: int) -> list[str]:
    """``num`` texts of at least ``min_chars`` characters: consecutive demo-corpus texts joined.

    Args:
        num: how many texts.
        min_chars: minimum length of each.

    Returns:
        The texts (from the cached demo corpus, built on first use).
    """
    corpus = build_demo_corpus()
    out: list[str] = []
    parts: list[str] = []
    size = 0
    for _, text in iter_texts(corpus.train_path):
        parts.append(text)
        size += len(text) + 2
        if size >= min_chars:
            out.append("\n\n".join(parts))
            parts, size = [], 0
            if len(out) == num:
                break
    if len(out) < num:
        raise ValueError(f"the demo corpus holds only {len(out)} texts of {min_chars} chars")
    return out


def bench_pair(pair: str, texts: list[str], ctx: int, rounds: int) -> dict:
    """Time aligner-only and tokenize+align for one ``student:teacher`` pair."""
    s_name, t_name = pair.split(":")
    student_tok, teacher_tok = load_tokenizer(s_name), load_tokenizer(t_name)
    aligner = TokenAligner()

    def tokenize():
        students = [x.truncated(ctx) for x in student_tok.encode_batch(texts)]
        teachers = [x.truncated(ctx) for x in teacher_tok.encode_batch(texts)]
        return students, teachers

    students, teachers = tokenize()
    tokens = [len(s) + len(t) for s, t in zip(students, teachers)]
    per_sample_ms = []
    for _ in range(rounds):
        for s, t in zip(students, teachers):
            t0 = time.perf_counter()
            aligner.align_tokenized(s, t)
            per_sample_ms.append((time.perf_counter() - t0) * 1e3)
    align_ms = statistics.median(per_sample_ms)

    tok_ms, both_ms = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ss, tt = tokenize()
        t1 = time.perf_counter()
        for s, t in zip(ss, tt):
            aligner.align_tokenized(s, t)
        t2 = time.perf_counter()
        tok_ms.append((t1 - t0) * 1e3 / len(texts))
        both_ms.append((t2 - t0) * 1e3 / len(texts))
    tokenize_ms, tok_align_ms = statistics.median(tok_ms), statistics.median(both_ms)
    mean_tokens = float(np.mean(tokens))
    return {
        "bench": "aligner",
        "student": s_name,
        "teacher": t_name,
        "ctx": ctx,
        "samples": len(texts),
        "chars_per_text": round(float(np.mean([len(t) for t in texts])), 1),
        "student_tokens": round(float(np.mean([len(s) for s in students])), 1),
        "teacher_tokens": round(float(np.mean([len(t) for t in teachers])), 1),
        "align_ms_median": round(align_ms, 4),
        "align_ms_p90": round(float(np.percentile(per_sample_ms, 90)), 4),
        "align_tokens_per_s": round(mean_tokens / align_ms * 1e3),
        "tokenize_ms": round(tokenize_ms, 3),
        "tokenize_align_ms": round(tok_align_ms, 3),
        "tokenize_align_tokens_per_s": round(mean_tokens / tok_align_ms * 1e3),
        "align_over_tokenize": round(align_ms / tokenize_ms, 4),
    }


COLUMNS = (
    ("student", "student"),
    ("teacher", "teacher"),
    ("T", "student_tokens"),
    ("U", "teacher_tokens"),
    ("align ms", "align_ms_median"),
    ("align p90", "align_ms_p90"),
    ("align tok/s", "align_tokens_per_s"),
    ("tok ms", "tokenize_ms"),
    ("tok+align ms", "tokenize_align_ms"),
    ("tok+align tok/s", "tokenize_align_tokens_per_s"),
    ("align/tok", "align_over_tokenize"),
)


def main() -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), help="student:teacher")
    parser.add_argument("--ctx", type=int, default=2048, help="context length of both sides")
    parser.add_argument("--samples", type=int, default=64, help="texts per pair")
    parser.add_argument("--min-chars", type=int, default=12_000, help="characters per text")
    parser.add_argument("--rounds", type=int, default=5, help="timed repetitions")
    parser.add_argument("--no-append", action="store_true", help="do not write the results file")
    args = parser.parse_args()

    texts = long_texts(args.samples, args.min_chars)
    common = run_fields()
    rows = [{**bench_pair(p, texts, args.ctx, args.rounds), **common} for p in args.pairs]
    for r in rows:  # other processes on the machine skew the figures: keep the load beside them
        r["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(
        f"TokenAligner, {args.samples} demo texts, ctx {args.ctx}, {common['device']} "
        f"(load {common['load_average_1m']} -> {rows[-1]['load_average_1m_end']})"
    )
    _common.print_cells([h for h, _ in COLUMNS], [[str(r[k]) for _, k in COLUMNS] for r in rows])
    if not args.no_append:
        _common.append_rows(RESULTS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
