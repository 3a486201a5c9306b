"""`xtoken collate-stats`: collate a corpus with two real tokenizers and print alignment statistics."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options on its subcommand parser."""
    # the defaults are tokenizers every install ships (xtoken's own dependencies)
    parser.add_argument("--student", default="qwen3", help="student tokenizer (default qwen3)")
    parser.add_argument(
        "--teacher", default="deepseek", help="teacher tokenizer (default deepseek)"
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="a .jsonl/.txt/.parquet corpus; default: the demo corpus built from the stdlib",
    )
    parser.add_argument(
        "--corpus-dir",
        default=None,
        help="where the demo corpus is built / cached (default ~/.cache/xtoken/demo)",
    )
    parser.add_argument(
        "--split", choices=("train", "heldout"), default="train", help="demo corpus split"
    )
    parser.add_argument("--limit", type=int, default=256, help="texts to collate (default 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per batch (default 32)")
    parser.add_argument("--ctx-student", type=int, default=512, help="student context length")
    parser.add_argument("--ctx-teacher", type=int, default=512, help="teacher context length")
    parser.add_argument("--div-student", type=int, default=1, help="pad T to a multiple of this")
    parser.add_argument("--div-teacher", type=int, default=1, help="pad U to a multiple of this")
    parser.add_argument("--json", action="store_true", help="print the statistics as one JSON line")


class _Totals:
    """Running alignment statistics over collated batches (sums over samples)."""

    def __init__(self) -> None:
        self.samples = 0
        self.empty = 0
        self.tokens = [0, 0]
        self.truncated = [0, 0]
        self.one_sided = [0, 0]
        self.exact = [0, 0]
        self.bytes_untruncated = [0, 0]
        self.tokens_untruncated = [0, 0]
        self.chunks = 0
        self.valid = 0
        self.correct = 0
        self.one_to_one = 0
        self.padded_slots = [0, 0]

    def add(self, texts: list[str], batch: dict, ctx: tuple[int, int]) -> None:
        import torch

        self.samples += len(texts)
        self.empty += int((batch["sample_mask"] == 0).sum())
        sides = (
            ("input_lengths", "token_mask", "alignment_student_chunk_id", "student"),
            (
                "teacher_input_lengths",
                "teacher_token_mask",
                "alignment_teacher_chunk_id",
                "teacher",
            ),
        )
        counts = []
        for side, (len_key, mask_key, chunk_key, name) in enumerate(sides):
            lengths_B = batch[len_key]
            mask_BX = batch[mask_key]
            chunk_BX = batch[chunk_key]
            self.tokens[side] += int(lengths_B.sum())
            self.padded_slots[side] += mask_BX.numel()
            self.truncated[side] += int((lengths_B >= ctx[side]).sum())
            self.one_sided[side] += int(((chunk_BX < 0) & mask_BX).sum())
            self.exact[side] += int(batch[f"alignment_{name}_exact_partition_mask"].sum())
            for text, length in zip(texts, lengths_B.tolist()):
                if length < ctx[side]:
                    self.bytes_untruncated[side] += len(text.encode("utf-8"))
                    self.tokens_untruncated[side] += length
            # Tokens per chunk, per sample: [B, C].
            num_c = batch["alignment_pair_valid"].shape[1]
            per_chunk_BC = torch.zeros(chunk_BX.shape[0], num_c + 1, dtype=torch.int64)
            per_chunk_BC.scatter_add_(1, (chunk_BX.clamp(min=-1) + 1), torch.ones_like(chunk_BX))
            counts.append(per_chunk_BC[:, 1:])
        num_chunks_B = batch["alignment_num_chunks"]
        slot_BC = torch.arange(counts[0].shape[1]).unsqueeze(0) < num_chunks_B.unsqueeze(1)
        self.chunks += int(num_chunks_B.sum())
        self.valid += int((batch["alignment_pair_valid"] & slot_BC).sum())
        self.correct += int((batch["alignment_pair_is_correct"] & slot_BC).sum())
        self.one_to_one += int(((counts[0] == 1) & (counts[1] == 1) & slot_BC).sum())

    def report(self, seconds: float) -> dict:
        def frac(a: int, b: int) -> float:
            return round(a / b, 4) if b else 0.0

        return {
            "samples": self.samples,
            "empty_samples": self.empty,
            "student_tokens": self.tokens[0],
            "teacher_tokens": self.tokens[1],
            "student_samples_at_ctx": self.truncated[0],
            "teacher_samples_at_ctx": self.truncated[1],
            "chunks": self.chunks,
            "chunks_per_sample": frac(self.chunks, self.samples),
            "one_to_one_chunk_fraction": frac(self.one_to_one, self.chunks),
            "valid_pair_fraction": frac(self.valid, self.chunks),
            "correct_pair_fraction": frac(self.correct, self.chunks),
            "student_exact_token_fraction": frac(self.exact[0], self.tokens[0]),
            "teacher_exact_token_fraction": frac(self.exact[1], self.tokens[1]),
            "student_one_sided_tokens": self.one_sided[0],
            "teacher_one_sided_tokens": self.one_sided[1],
            "student_bytes_per_token": frac(self.bytes_untruncated[0], self.tokens_untruncated[0]),
            "teacher_bytes_per_token": frac(self.bytes_untruncated[1], self.tokens_untruncated[1]),
            "student_padding_fraction": frac(
                self.padded_slots[0] - self.tokens[0], self.padded_slots[0]
            ),
            "teacher_padding_fraction": frac(
                self.padded_slots[1] - self.tokens[1], self.padded_slots[1]
            ),
            "collate_seconds": round(seconds, 3),
            "samples_per_second": round(self.samples / seconds, 1) if seconds > 0 else 0.0,
        }


def _print_table(stats: dict, header: str) -> None:
    print(header)
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        print(f"  {key:<{width}}  {value}")


def run(args: argparse.Namespace) -> int:
    """Collate ``--limit`` texts of the demo corpus (or ``--corpus``) and print statistics.

    Returns:
        0 on success, 2 on a bad option (message on stderr).
    """
    import itertools

    from xtoken_core.align import TokenAligner
    from xtoken_core.data.collator import CrossTokenizerCollator
    from xtoken_core.data.corpus import build_demo_corpus, iter_texts
    from xtoken_core.tokenizers import load_tokenizer

    if args.limit < 1 or args.batch_size < 1:
        print(
            f"xtoken collate-stats: --limit and --batch-size must be >= 1 "
            f"(got {args.limit}, {args.batch_size})",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        student = load_tokenizer(args.student)
    except ValueError as exc:
        print(f"xtoken collate-stats: --student: {exc}", file=sys.stderr)
        return 2
    try:
        teacher = load_tokenizer(args.teacher)
    except ValueError as exc:
        print(f"xtoken collate-stats: --teacher: {exc}", file=sys.stderr)
        return 2
    try:
        collator = CrossTokenizerCollator(
            student_tokenizer=student,
            teacher_tokenizer=teacher,
            aligner=TokenAligner(),
            ctx_length_student=args.ctx_student,
            ctx_length_teacher=args.ctx_teacher,
            make_seq_div_by_student=args.div_student,
            make_seq_div_by_teacher=args.div_teacher,
        )
    except ValueError as exc:
        print(f"xtoken collate-stats: {exc}", file=sys.stderr)
        return 2
    if args.corpus:
        corpus_path = args.corpus
    else:
        corpus = build_demo_corpus(args.corpus_dir)
        corpus_path = corpus.train_path if args.split == "train" else corpus.heldout_path
    setup_seconds = time.perf_counter() - start
    logger.info(
        "[demo] corpus %s, student %s, teacher %s (set-up %.2fs)",
        corpus_path,
        student,
        teacher,
        setup_seconds,
    )

    texts = [text for _, text in itertools.islice(iter_texts(corpus_path), args.limit)]
    totals = _Totals()
    ctx = (args.ctx_student, args.ctx_teacher)
    collate_seconds = 0.0
    for i in range(0, len(texts), args.batch_size):
        chunk = texts[i : i + args.batch_size]
        t0 = time.perf_counter()
        batch = collator(chunk)
        collate_seconds += time.perf_counter() - t0
        totals.add(chunk, batch, ctx)
    stats = {"student": args.student, "teacher": args.teacher, **totals.report(collate_seconds)}
    if args.json:
        print(json.dumps(stats))
    else:
        _print_table(
            stats,
            f"xtoken collate-stats: {stats['samples']} texts from {corpus_path}, "
            f"batch {args.batch_size}, ctx {args.ctx_student}/{args.ctx_teacher}",
        )
    return 0
