"""Benchmark: bytes per teacher token of the teacher cache's shards, codec by codec, and the
loss error of targets read back from a shard against the full teacher logits.

The real SmolLM2-135M teacher reads texts of the demo corpus. Storage: its top-K targets (K = 32
and 64) of ``--texts`` texts of ``--ctx`` tokens are written as real shards
(``xtoken_core.cache.writer``) with each lever on or off: the ids as the ``topk`` transport sends
them (int32) or in the vocab's width (uint16 for SmolLM2's 49,152 ids), plain or sorted and
delta-coded per position; the log-probs in fp32, bf16, u8 or u4 (steps below each position's
top-1); the per-position floats (lp_max, lp_scale, rest, lse) in fp32 or fp16; Parquet without compression or with zstd. Bytes per teacher token are the shard file's bytes
(keys, teacher ids, lengths and Parquet's own pages included) over its teacher tokens. Quality:
as ``benchmarks/teachers/bench_topk.py``, the KD loss and its gradient w.r.t. the student
logits (a student of another tokenizer, qwen3) from the targets as read back from a shard and
decoded as the trainer decodes them, against the full fp32 logits, on ``--loss-texts`` texts of
``--loss-ctx`` tokens (P-KL over every teacher column, as the ``topk`` transport needs; gold;
relaxed gold).

Prints one table, appends its rows to benchmarks/results/teacher_cache.jsonl and rewrites the
storage section of benchmarks/results/teacher_cache.md.

    python benchmarks/cache/bench_cache_format.py                  # 16 texts of 1024 tokens, CPU
    python benchmarks/cache/bench_cache_format.py --texts 4 --ctx 256 --no-write    # a quick look

Legend: B texts, T student tokens, U teacher tokens, V student vocab, W teacher vocab, K ids kept
per teacher token.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.align import TokenAligner  # noqa: E402
from xtoken_core.cache.format import Codec  # noqa: E402
from xtoken_core.cache.manifest import FORMAT_NAME, update_manifest, write_json_atomic  # noqa: E402
from xtoken_core.cache.reader import CacheReader  # noqa: E402
from xtoken_core.cache.writer import ShardWriter  # noqa: E402
from xtoken_core.data.collator import CrossTokenizerCollator  # noqa: E402
from xtoken_core.data.corpus import build_demo_corpus, read_texts  # noqa: E402
from xtoken_core.data.projection_build import build_projection  # noqa: E402
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig  # noqa: E402
from xtoken_core.models import load_model, model_vocab_size, split_lm_head  # noqa: E402
from xtoken_core.tokenizers import load_tokenizer  # noqa: E402
from xtoken_core.wire.topk import TopK, decode_topk, encode_topk, topk_bytes_per_token  # noqa: E402

JSONL = _common.RESULTS_DIR / "teacher_cache.jsonl"
MARKDOWN = _common.RESULTS_DIR / "teacher_cache.md"
TEACHER = "smollm2"
KS = (32, 64)
# (label, ids codec, log-prob codec, per-position floats, compression, ids as int32): each lever
# added in turn, then the levers tried on top of the default
LEVERS = (
    (
        "int32 ids, fp32 log-probs (the topk transport's payload), no compression",
        "plain",
        "fp32",
        "fp32",
        "none",
        True,
    ),
    ("+ ids in the vocab's width (uint16)", "plain", "fp32", "fp32", "none", False),
    ("+ zstd", "plain", "fp32", "fp32", "zstd", False),
    ("+ ids sorted, delta-coded", "delta", "fp32", "fp32", "zstd", False),
    ("+ log-probs bf16", "delta", "bf16", "fp32", "zstd", False),
    ("+ log-probs u8 (default)", "delta", "u8", "fp32", "zstd", False),
    ("default, lp_max/lp_scale/rest/lse fp16", "delta", "u8", "fp16", "zstd", False),
    ("default, log-probs u4", "delta", "u4", "fp32", "zstd", False),
    ("default, log-probs u4, floats fp16", "delta", "u4", "fp16", "zstd", False),
)
# (log-prob codec, per-position floats) of the loss error
LOSS_CODECS = (
    ("fp32", "fp32"),
    ("bf16", "fp32"),
    ("u8", "fp32"),
    ("u8", "fp16"),
    ("u4", "fp32"),
    ("u4", "fp16"),
)
MODE_SETTINGS = {
    "pkl-all": {"mode": "pkl", "vocab_topk": None},
    "gold": {"mode": "gold"},
    "xtoken": {"mode": "xtoken"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=16, help="demo-corpus texts for the bytes")
    p.add_argument("--ctx", type=int, default=1024, help="teacher tokens per text for the bytes")
    p.add_argument("--loss-texts", type=int, default=4, help="texts for the loss error")
    p.add_argument("--loss-ctx", type=int, default=128, help="tokens per text for the loss error")
    p.add_argument("--student", default="qwen3", help="student tokenizer")
    p.add_argument("--student-model", default="tiny", help="student model spec")
    p.add_argument("--no-loss", action="store_true", help="storage only, no loss error")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` in float64."""
    return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def shard_round_trip(
    targets: TopK,
    ids_BU: torch.Tensor,
    lengths: list[int],
    codec: Codec,
    compression: str,
    W: int,
    int32_ids: bool,
) -> tuple[int, list]:
    """Write the targets of B rows as one shard, read them back; returns the file's bytes and
    the rows read."""
    # ids as int32, the transport's own dtype: stored as for a vocab past 65,536 ids
    width = (1 << 17) if int32_ids else W
    with tempfile.TemporaryDirectory() as d:
        write_json_atomic(Path(d) / "manifest.json", {
            "format": FORMAT_NAME, "format_version": 1, "codec": codec.as_dict(),
            "k": targets.k, "width": width, "shards": [], "builders": {},
        })  # fmt: skip
        writer = ShardWriter(d, codec, width, targets.k, (0, 1), compression=compression)
        ids, lps, rest, lse = (t.numpy() for t in targets)
        for b, L in enumerate(lengths):
            writer.add(f"t{b}", ids_BU[b, :L].numpy(), ids[b, :L], lps[b, :L], rest[b, :L],
                       lse[b, :L])  # fmt: skip
        entry = writer.flush()
        update_manifest(d, lambda m: m["shards"].append(entry))
        reader = CacheReader(d)
        return entry["bytes"], [reader.get(f"t{b}") for b in range(len(lengths))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    start = time.perf_counter()
    corpus = build_demo_corpus()
    teacher_tok = load_tokenizer(TEACHER)
    teacher = load_model(TEACHER).eval()
    W = model_vocab_size(teacher)
    backbone, lm_head = split_lm_head(teacher)

    # storage: real shards of --texts texts of --ctx tokens
    texts = read_texts(corpus.train_path, args.texts)
    rows_ids = [x.truncated(args.ctx).ids for x in teacher_tok.encode_batch(texts, True)]
    lengths = [len(r) for r in rows_ids]
    U = max(lengths)
    ids_BU = torch.zeros((len(texts), U), dtype=torch.int64)
    for b, r in enumerate(rows_ids):
        ids_BU[b, : len(r)] = torch.as_tensor(r)
    mask_BU = torch.arange(U)[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        zt_BUW = lm_head(backbone(ids_BU, mask_BU.long())).float()
    tokens = sum(lengths)
    print(
        f"{len(texts)} texts, {tokens} teacher tokens, W={W} ({time.perf_counter() - start:.0f} s)"
    )
    common = {
        "date": dt.date.today().isoformat(), "commit": _common.commit(),
        "device": _common.cpu_name(), "teacher": TEACHER, "student": None,
        "shape": f"{len(texts)}x{args.ctx}", "mode": "storage",
    }  # fmt: skip
    rows = []
    for k in KS:
        targets = encode_topk(zt_BUW, k)
        mass = float(targets.logprobs_NK.exp().sum(-1)[mask_BU].mean())
        for label, ids_codec, lp_codec, scalars, compression, int32_ids in LEVERS:
            codec = Codec(ids_codec, lp_codec, scalars)
            nbytes, _ = shard_round_trip(targets, ids_BU, lengths, codec, compression, W, int32_ids)
            rows.append({
                **common, "k": k, "lever": label, "ids": "int32" if int32_ids else ids_codec,
                "logprobs": lp_codec, "scalars": scalars, "compression": compression,
                "bytes_per_teacher_token": round(nbytes / tokens, 1),
                "payload_bytes_per_teacher_token": topk_bytes_per_token(k), "topk_mass": mass,
            })  # fmt: skip
    if not args.no_loss:
        rows += loss_rows(args, corpus, teacher_tok, backbone, lm_head, W, common, start)
    cols = ["mode", "k", "ids", "logprobs", "scalars", "compression", "bytes_per_teacher_token",
            "loss_rel_err", "grad_rel_err"]  # fmt: skip
    _common.print_table(rows, cols)
    if not args.no_write:
        _common.append_rows(JSONL, rows)
        print(f"wrote {JSONL}")
    return 0


def loss_rows(args, corpus, teacher_tok, backbone, lm_head, W, common, start) -> list[dict]:
    """The loss from targets read back from a shard against the full logits."""
    rows = []
    student_tok = load_tokenizer(args.student)
    projection = build_projection(student_tok, teacher_tok, 8)
    V = int(projection["indices"].shape[0])
    collator = CrossTokenizerCollator(
        student_tokenizer=student_tok, teacher_tokenizer=teacher_tok, aligner=TokenAligner(),
        ctx_length_student=args.loss_ctx, ctx_length_teacher=args.loss_ctx,
    )  # fmt: skip
    batch = collator(read_texts(corpus.train_path, args.loss_texts))
    student = load_model(args.student_model, vocab_size=V, seed=0).eval()
    lengths_q = batch["teacher_input_lengths"].tolist()
    with torch.no_grad():
        zq_BUW = lm_head(
            backbone(batch["teacher_input_ids"], batch["teacher_token_mask"].long())
        ).float()
        zs_BTV = student(batch["input_ids"], attention_mask=batch["token_mask"].long()).logits
        zs_BTV = zs_BTV[..., :V].float()
    for mode, settings in MODE_SETTINGS.items():
        loss_fn = CrossTokenizerLoss(CrossTokenizerLossConfig(
            projection=(projection["indices"], projection["likelihoods"]), ce_weight=0.0,
            **settings,
        ))  # fmt: skip

        def loss_grad(zt: torch.Tensor, loss_fn=loss_fn) -> tuple[float, torch.Tensor]:
            z = zs_BTV.detach().requires_grad_()
            loss, _ = loss_fn(z, zt, batch)
            (g,) = torch.autograd.grad(loss, z)
            return float(loss.detach()), g

        ref_loss, ref_grad = loss_grad(zq_BUW)
        for k in KS:
            targets = encode_topk(zq_BUW, k)
            for lp_codec, scalars in LOSS_CODECS:
                _, got = shard_round_trip(
                    targets,
                    batch["teacher_input_ids"],
                    lengths_q,
                    Codec("delta", lp_codec, scalars),
                    "zstd",
                    W,
                    False,
                )
                shape = (len(lengths_q), zq_BUW.shape[1], k)
                dense = decode_topk(_stack(got, shape), W)
                loss, grad = loss_grad(dense)
                rows.append({
                    **common, "mode": mode, "student": f"{args.student}:{args.student_model}",
                    "shape": f"{len(lengths_q)}x{args.loss_ctx}", "k": k,
                    "ids": "delta", "logprobs": lp_codec, "scalars": scalars,
                    "compression": "zstd",
                    "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                    "grad_rel_err": relative(grad, ref_grad), "quality_delta": loss - ref_loss,
                })  # fmt: skip
        print(f"[{mode}] done at {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _stack(rows: list, shape: tuple[int, int, int]) -> TopK:
    """Rows read back as padded ``[B, U, K]`` targets (padding: id 0, log-prob 0)."""
    B, U, K = shape
    ids = np.zeros((B, U, K), np.int32)
    lps = np.zeros((B, U, K), np.float32)
    rest = np.zeros((B, U), np.float32)
    lse = np.zeros((B, U), np.float32)
    for b, r in enumerate(rows):
        L = len(r.teacher_ids_U)
        ids[b, :L], lps[b, :L], rest[b, :L], lse[b, :L] = r.ids_UK, r.logprobs_UK, r.rest_U, r.lse_U
    return TopK(*(torch.from_numpy(a) for a in (ids, lps, rest, lse)))


if __name__ == "__main__":
    sys.exit(main())
