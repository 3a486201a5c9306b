"""Benchmark: a claim's jagged fields -> the trainer's padded micro-batches.

Input: the decoded reply of one claim of N collated samples (jagged columns viewing the received
frames, what ``QueueClient.claim`` returns; the socket round trip is not timed). Output: the N
samples sorted by teacher length and cut into padded micro-batches of ``--micro-batch`` samples,
the trainer's path (``services/trainer/samples.py``): row views of the columns (no copy), each
row copied once into its rectangle (``columns_to_samples`` + ``pad_samples``). The comparison
with re-concatenated columns and with a TensorDict path is in
benchmarks/results/wire_claim_pad.md.

Usage:  python benchmarks/wire/bench_claim_pad.py [--claims 8 32] [--threads 1] [--quick]
Rows are appended to benchmarks/results/wire_claim_pad.jsonl.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.data import sample as schema  # noqa: E402
from xtoken_core.data_plane.codec import columns_to_samples  # noqa: E402
from xtoken_core.wire import WireLimits, decode_message, encode_message  # noqa: E402

RESULTS = _common.RESULTS_DIR / "wire_claim_pad.jsonl"
LIMITS = WireLimits(max_frames=1 << 20)
PADS = {"student_pad_id": 151_643, "teacher_pad_id": 2}


def _sample(g: torch.Generator, t: int) -> dict[str, torch.Tensor]:
    """A collated sample of t student tokens (teacher 1.1 t, 0.9 t chunks), random contents."""
    u, c = int(t * 1.1), int(t * 0.9)

    def mask(n: int) -> torch.Tensor:
        return torch.rand(n, generator=g) > 0.3

    return {
        "input_ids": torch.randint(0, 151_000, (t,), generator=g),
        "input_lengths": torch.tensor(t),
        "token_mask": torch.ones(t, dtype=torch.bool),
        "sample_mask": torch.tensor(1.0),
        "teacher_input_ids": torch.randint(0, 128_000, (u,), generator=g),
        "teacher_input_lengths": torch.tensor(u),
        "teacher_token_mask": torch.ones(u, dtype=torch.bool),
        "alignment_pair_valid": mask(c),
        "alignment_pair_is_correct": mask(c),
        "alignment_student_exact_partition_mask": mask(t),
        "alignment_teacher_exact_partition_mask": mask(u),
        "alignment_student_chunk_id": torch.randint(-1, c, (t,), generator=g).sort().values,
        "alignment_teacher_chunk_id": torch.randint(-1, c, (u,), generator=g).sort().values,
        "alignment_num_chunks": torch.tensor(c),
    }


def claim_reply(n: int, max_len: int, seed: int = 0) -> tuple[list[str], dict]:
    """Keys and decoded fields of a claim of n samples of max_len/2..max_len student tokens."""
    from services.collator.worker import samples_to_put_fields

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 2, max_len + 1, (n,), generator=g).tolist()
    keys = [f"k{i}" for i in range(n)]
    fields = samples_to_put_fields([_sample(g, t) for t in lengths])
    frames = encode_message(
        "put", {"partition": "p", "keys": keys, "fields": fields}, limits=LIMITS
    )
    frames = [bytes(f) for f in frames]  # received frames: read-only buffers
    return keys, decode_message(frames, limits=LIMITS, jagged="column").body["fields"]


def rows_arm(keys: list[str], fields: dict, mb: int) -> list[dict]:
    """The trainer's path: row views, sorted, each micro-batch padded once."""
    rows = columns_to_samples(fields)
    fresh = sorted(zip(keys, rows), key=lambda kr: -int(kr[1]["teacher_input_lengths"]))
    return [
        schema.pad_samples([r for _, r in fresh[i : i + mb]], **PADS)
        for i in range(0, len(fresh), mb)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, nargs="+", default=[8, 32], help="samples a claim")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=2048, help="longest student sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="one small claim, few reps")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    claims, reps = ([8], 5) if args.quick else (args.claims, args.reps)
    device = f"cpu ({_common.cpu_name()}, {torch.get_num_threads()} torch threads)"
    load = [round(x, 2) for x in os.getloadavg()]
    commit = _common.commit()
    rows = []
    print(f"{'N':>4} {'mb':>3} {'rows ms':>10} {'per micro-batch ms':>19}")
    for n in claims:
        keys, fields = claim_reply(n, args.max_len)
        rows_arm(keys, fields, args.micro_batch)  # warm-up
        ms = _common.cpu_median_ms(
            lambda keys=keys, fields=fields: rows_arm(keys, fields, args.micro_batch), reps
        )
        per_mb = ms / -(-n // args.micro_batch)
        rows.append(
            {
                "commit": commit,
                "device": device,
                "load_1_5_15": load,
                "shape": {"claim": n, "micro_batch": args.micro_batch, "max_len": args.max_len},
                "rows_ms": round(ms, 3),
                "per_micro_batch_ms": round(per_mb, 3),
            }
        )
        print(f"{n:>4} {args.micro_batch:>3} {ms:>10.3f} {per_mb:>19.3f}")
    print(f"load average at the start: {load}")
    if not args.quick:
        _common.append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
