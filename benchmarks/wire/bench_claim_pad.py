"""Benchmark: a claim's jagged fields -> the trainer's padded micro-batches, two ways.

Input: the decoded reply of one claim of N collated samples (jagged columns viewing the received
frames, what ``QueueClient.claim`` returns; the socket round trip, the same for every arm, is not
timed). Output: the N samples sorted by teacher length and cut into padded micro-batches of
``--micro-batch`` samples. Arms, bitwise equal (checked before timing):

* ``rows``: the trainer's path (``services/trainer/samples.py``): row views of the columns (no
  copy), each row copied once into its rectangle (``columns_to_samples`` + ``pad_samples``).
* ``materialize``: the TensorDict path: the claim as a TensorDict (what ``claim(...,
  as_tensordict=True)`` builds: nested tensors over the same buffers), its rows put in teacher
  order once (one gather per field), each micro-batch a slice padded by ``materialize`` with the
  schema's pad values.
* ``materialize_once``: the whole claim padded by one ``materialize``, each micro-batch its rows
  of those rectangles cut to the micro-batch's widths (made contiguous, as ``pad_samples``'s).

Usage:  python benchmarks/wire/bench_claim_pad.py [--claims 8 32] [--threads 1] [--quick]
Rows are appended to benchmarks/results/wire_claim_pad.jsonl; the figures and their reading are
in benchmarks/results/wire_claim_pad.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.data import sample as schema  # noqa: E402
from xtoken_core.data_plane.codec import (  # noqa: E402
    columns_to_samples,
    materialize,
    samples_to_columns,
)
from xtoken_core.data_plane.njt import is_njt, njt_parts  # noqa: E402
from xtoken_core.data_plane.tensordict_io import fields_to_tensordict  # noqa: E402
from xtoken_core.wire import JaggedColumn, WireLimits, decode_message, encode_message  # noqa: E402

RESULTS = _common.RESULTS_DIR / "wire_claim_pad.jsonl"
LIMITS = WireLimits(max_frames=1 << 20)
PADS = {"student_pad_id": 151_643, "teacher_pad_id": 2}
PAD_VALUES = schema.pad_values(**PADS)  # the schema's pad value of every field


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
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 2, max_len + 1, (n,), generator=g).tolist()
    keys = [f"k{i}" for i in range(n)]
    fields = samples_to_columns([_sample(g, t) for t in lengths])
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


def _teacher_order(td) -> torch.Tensor:
    """Rows by teacher length, longest first (stable: ties keep the claim order)."""
    return torch.argsort(-td.get("teacher_input_lengths"), stable=True)


def materialize_arm(keys: list[str], fields: dict, mb: int) -> list[dict]:
    """The claim as a TensorDict, its rows in teacher order, each micro-batch a slice padded by
    materialize."""
    td = fields_to_tensordict(fields, keys)
    order = _teacher_order(td)
    picked = order.tolist()
    columns: dict = {}
    for name in td.keys():
        leaf = td.get(name)
        if is_njt(leaf):
            values, offsets = njt_parts(leaf)
            lengths = offsets.diff()
            rows = values.split(lengths.tolist())
            sorted_offsets = torch.zeros(len(picked) + 1, dtype=torch.int64)
            torch.cumsum(lengths[order], 0, out=sorted_offsets[1:])
            columns[name] = (torch.cat([rows[i] for i in picked]), sorted_offsets)
        else:
            columns[name] = leaf.index_select(0, order)
    out = []
    for a in range(0, len(picked), mb):
        b = min(a + mb, len(picked))
        micro: dict = {}
        for name, col in columns.items():
            if isinstance(col, tuple):
                values, offsets = col
                start, end = int(offsets[a]), int(offsets[b])
                micro[name] = JaggedColumn(values[start:end], offsets[a : b + 1] - start)
            else:
                micro[name] = col[a:b]
        out.append(materialize(micro, "padded", PAD_VALUES))
    return out


def materialize_once_arm(keys: list[str], fields: dict, mb: int) -> list[dict]:
    """The claim as a TensorDict padded by one materialize; each micro-batch its rows of those
    rectangles, cut to its own widths."""
    td = fields_to_tensordict(fields, keys)
    padded = materialize(td, "padded", PAD_VALUES)
    order = _teacher_order(td)
    lengths = {axis: td.get(field) for axis, field in schema.length_fields(1).items()}
    out = []
    for a in range(0, len(order), mb):
        idx = order[a : a + mb]
        widths = {axis: int(n[idx].max()) for axis, n in lengths.items()}
        micro = {}
        for spec in schema.sample_fields(1):
            rect = padded[spec.name].index_select(0, idx)
            if spec.axis != schema.SAMPLE:
                rect = rect[:, : widths[spec.axis]].contiguous()
            micro[spec.name] = rect
        out.append(micro)
    return out


ARMS = {"rows": rows_arm, "materialize": materialize_arm, "materialize_once": materialize_once_arm}


def _same(got: list[dict], want: list[dict], arm: str) -> None:
    assert len(got) == len(want), arm
    for x, y in zip(got, want, strict=True):
        for name in y:
            same = x[name].dtype == y[name].dtype and torch.equal(x[name], y[name])
            assert same, f"{arm}: field {name} differs from the rows arm"


def _interleaved_medians(keys: list[str], fields: dict, mb: int, reps: int) -> dict[str, float]:
    """Median ms of each arm over ``reps`` rounds, the arms taking turns within a round (so that
    a load change on a shared machine hits every arm alike)."""
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(reps):
        for arm, fn in ARMS.items():
            start = time.perf_counter()
            fn(keys, fields, mb)
            samples[arm].append((time.perf_counter() - start) * 1e3)
    return {arm: statistics.median(ms) for arm, ms in samples.items()}


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
    print(
        f"{'N':>4} {'mb':>3} {'rows ms':>9} {'materialize ms':>15} {'once ms':>9} "
        f"{'materialize/rows':>17} {'once/rows':>10}"
    )
    for n in claims:
        keys, fields = claim_reply(n, args.max_len)
        want = rows_arm(keys, fields, args.micro_batch)
        for arm, fn in ARMS.items():
            _same(fn(keys, fields, args.micro_batch), want, arm)  # also the warm-up
        ms = _interleaved_medians(keys, fields, args.micro_batch, reps)
        row = {
            "commit": commit,
            "device": device,
            "load_1_5_15": load,
            "shape": {"claim": n, "micro_batch": args.micro_batch, "max_len": args.max_len},
            "rows_ms": round(ms["rows"], 3),
            "materialize_ms": round(ms["materialize"], 3),
            "materialize_once_ms": round(ms["materialize_once"], 3),
            "materialize_over_rows": round(ms["materialize"] / ms["rows"], 2),
            "materialize_once_over_rows": round(ms["materialize_once"] / ms["rows"], 2),
        }
        rows.append(row)
        print(
            f"{n:>4} {args.micro_batch:>3} {ms['rows']:>9.3f} {ms['materialize']:>15.3f} "
            f"{ms['materialize_once']:>9.3f} {row['materialize_over_rows']:>17.2f} "
            f"{row['materialize_once_over_rows']:>10.2f}"
        )
    print(f"load average at the start: {load}")
    if not args.quick:
        _common.append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
