"""Benchmark: wire encode+decode of a put batch (jagged, zero copy) and its padding.

Compares, for a batch of N samples with jagged per-token fields:
  * jagged   one values + one offsets frame per field (the xtoken wire)
  * per-row  one tensor per sample per field (what a naive encoder would send: N frames/field)
  * copy     the jagged message decoded with copy=True (what zero copy saves)
and times the codec's padding of the rows (pad_rows) against torch.nested.to_padded_tensor.

Usage:  python benchmarks/wire/bench_wire.py [--quick]
Rows are appended to benchmarks/results/wire_codec.jsonl.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from xtoken_core.data_plane.codec import pad_rows  # noqa: E402
from xtoken_core.wire import JaggedColumn, WireLimits, decode_message, encode_message  # noqa: E402

RESULTS = _common.RESULTS_DIR / "wire_codec.jsonl"
LIMITS = WireLimits(max_frames=1 << 20)


def _batch(n: int, mean_len: int, seed: int = 0) -> dict[str, JaggedColumn]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2, (n,), generator=g).tolist()
    return {
        "input_ids": JaggedColumn.from_rows([torch.randint(0, 150_000, (k,)) for k in lengths]),
        "chunk_id": JaggedColumn.from_rows([torch.arange(k) for k in lengths]),
        "token_mask": JaggedColumn.from_rows([torch.ones(k, dtype=torch.bool) for k in lengths]),
        "weights": JaggedColumn.from_rows([torch.randn(k, 4).bfloat16() for k in lengths]),
    }


def _roundtrip(body, copy=False):
    frames = encode_message("put", body, limits=LIMITS)
    decode_message(frames, limits=LIMITS, copy=copy)
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few reps")
    args = parser.parse_args()
    shapes = [(64, 256), (256, 1024)] if args.quick else [(64, 256), (256, 1024), (1024, 2048)]
    reps = 3 if args.quick else 10
    device = f"cpu ({_common.cpu_name()}, {torch.get_num_threads()} threads)"
    commit = _common.commit()
    rows = []
    print(
        f"{'N':>6} {'L':>6} {'MB':>7} {'frames':>7} {'jagged ms':>10} {'GB/s':>6} "
        f"{'per-row ms':>11} {'x':>6} {'copy ms':>8} {'x':>5} {'pad ms':>7} {'to_padded ms':>13}"
    )
    for n, mean_len in shapes:
        cols = _batch(n, mean_len)
        keys = [f"k{i}" for i in range(n)]
        body = {"partition": "p", "keys": keys, "fields": cols}
        per_row = {
            "partition": "p",
            "keys": keys,
            "fields": {name: c.rows() for name, c in cols.items()},
        }
        frames = _roundtrip(body)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        t_jagged = _common.cpu_median_ms(lambda body=body: _roundtrip(body), reps)
        t_rows = _common.cpu_median_ms(lambda per_row=per_row: _roundtrip(per_row), reps)
        t_copy = _common.cpu_median_ms(lambda body=body: _roundtrip(body, copy=True), reps)
        nested = {name: c.to_nested() for name, c in cols.items()}

        def pad(cols=cols):
            for c in cols.values():
                pad_rows(c.rows(), 0)

        t_pad = _common.cpu_median_ms(pad, reps)

        def to_padded(nested=nested):
            for nt in nested.values():
                torch.nested.to_padded_tensor(nt, 0)

        t_to_padded = _common.cpu_median_ms(to_padded, reps)
        row = {
            "commit": commit,
            "device": device,
            "shape": {"N": n, "mean_len": mean_len, "fields": len(cols)},
            "message_mb": round(nbytes / 1e6, 3),
            "frames": len(frames),
            "jagged_roundtrip_ms": round(t_jagged, 3),
            "jagged_gb_per_s": round(nbytes / t_jagged / 1e6, 2),
            "per_row_roundtrip_ms": round(t_rows, 3),
            "per_row_over_jagged": round(t_rows / t_jagged, 2),
            "copy_roundtrip_ms": round(t_copy, 3),
            "copy_over_zero_copy": round(t_copy / t_jagged, 2),
            "pad_rows_ms": round(t_pad, 3),
            "to_padded_tensor_ms": round(t_to_padded, 3),
        }
        rows.append(row)
        print(
            f"{n:>6} {mean_len:>6} {row['message_mb']:>7} {len(frames):>7} {t_jagged:>10.3f} "
            f"{row['jagged_gb_per_s']:>6} {t_rows:>11.3f} {row['per_row_over_jagged']:>6} "
            f"{t_copy:>8.3f} {row['copy_over_zero_copy']:>5} {t_pad:>7.3f} {t_to_padded:>13.3f}"
        )
    _common.append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
