"""Benchmark: forward throughput of a tensor-parallel teacher group (``teacher.tensor_parallel``)
for a preset, at TP = 1, 2, 4 on one node's GPUs, bf16.

Each rank builds its shards of the preset on its own GPU as the teacher does
(``services/teacher/shards.py``: meta device, then each rank's shards drawn; TP = 1 builds the
whole model the same way, without DTensors), then times the teacher's forward: the backbone and
the output layer into a logits buffer of its vocab columns ``[B, U, W / k]`` (what a rank writes
into its slice of a ring slot), under ``torch.inference_mode``.

Figures per run: tokens/s (B x U tokens per forward over the median forward time), the peak GPU
memory of the busiest rank, and teacher TFLOP/s and MFU from a causal FLOP count:
``2 x tokens x (linear parameters, output layer included) + 2 x B x layers x U^2 x (heads x
head_dim)`` (QK^T and AV, half of the square: causal), MFU against the dense bf16 peak of the
GPUs in use (H100 / H200: 989.4 TFLOP/s each; ``--peak-tflops`` otherwise).

One launcher command runs every TP size that the node's GPUs allow, each under torchrun::

    python benchmarks/teachers/bench_tp_teacher.py --preset qwen2.5-7b --tp 1,2,4 \\
        --shape 1x4096 --out benchmarks/results/teachers_tp.jsonl
    python benchmarks/teachers/bench_tp_teacher.py --preset qwen2.5-32b --tp 2,4 --shape 4x2048 \\
        --out benchmarks/results/teachers_tp.jsonl

or one size directly: ``torchrun --nproc-per-node 4 benchmarks/teachers/bench_tp_teacher.py
--preset qwen2.5-32b --shape 1x4096 --out rows.jsonl``. A size that runs out of memory is a row
with ``error: out of memory``. Prints one table; appends its rows (JSONL) to ``--out``.

Legend: B rows, U tokens per row, W vocab, d hidden size, k ranks of the group.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks._common import commit  # noqa: E402

# Dense bf16 peak of one GPU, TFLOP/s, by a substring of its name.
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
COLUMNS = [
    "teacher", "teacher_tp", "shape", "tokens_per_s", "forward_ms", "peak_mem_gib",
    "teacher_tflops", "mfu", "error",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b", help="a model preset (xtoken_core.models)")
    p.add_argument("--vocab", type=int, default=152_064, help="the preset's vocab (Qwen: 152064)")
    p.add_argument("--shape", default="1x4096", help="B x U of one forward, e.g. 1x4096, 4x2048")
    p.add_argument("--tp", default="1,2,4", help="launcher: the TP sizes to run (comma list)")
    p.add_argument("--iters", type=int, default=10, help="timed forwards")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards first")
    p.add_argument("--compile", action="store_true", help="compile the decoder layers (teacher)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak of one GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", default=None, help="rank 0 appends the top CUDA operators of 3 forwards here"
    )
    p.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    return p.parse_args(argv)


def causal_flops(config, rows: int, tokens: int) -> float:
    """Forward FLOPs of ``rows`` x ``tokens`` through a decoder LM (see the module docstring)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    attn = d * heads * head_dim * 2 + d * kv * head_dim * 2  # q, o; k, v
    mlp = 3 * d * config.intermediate_size
    linear = layers * (attn + mlp) + d * config.vocab_size  # the output layer
    return 2.0 * rows * tokens * linear + 2.0 * rows * layers * tokens**2 * heads * head_dim


def run_rank(args: argparse.Namespace) -> None:
    """One rank (torchrun's environment, or alone for TP = 1): build, time, rank 0 writes."""
    import torch
    import torch.distributed as dist

    from services.teacher.compile import RegionalCompile
    from services.teacher.shards import build_sharded_model, column_bounds, model_config
    from xtoken_core.models.heads import split_lm_head

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    B, U = (int(x) for x in args.shape.lower().split("x"))
    config, _ = model_config(args.preset, args.vocab)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl", device_id=device)
        mesh = init_device_mesh("cuda", (world,))
    row = {
        "date": dt.date.today().isoformat(), "commit": commit(), "device": torch.cuda.get_device_name(device),
        "gpus": world, "teacher": args.preset, "teacher_tp": world, "shape": f"{B}x{U}",
        "dtype": "bfloat16", "compile": args.compile, "iters": args.iters,
    }  # fmt: skip
    error = None
    try:
        model = build_sharded_model(
            args.preset, mesh, vocab_size=args.vocab, dtype=torch.bfloat16, device=device,
            seed=args.seed,
        )  # fmt: skip
        backbone, head = split_lm_head(model)
        lo, hi = column_bounds(args.vocab, world, rank)
        logits_BUW = torch.empty((B, U, hi - lo), dtype=torch.bfloat16, device=device)
        compiled = RegionalCompile(model, args.compile)
        g = torch.Generator(device="cpu").manual_seed(1)
        ids_BU = torch.randint(0, args.vocab, (B, U), generator=g).to(device)

        def forward() -> None:
            def run():
                logits_BUW.copy_(head(backbone(ids_BU)))

            compiled.run(run)

        for _ in range(args.warmup):
            forward()
        torch.cuda.synchronize(device)
        if mesh is not None:
            dist.barrier()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            forward()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        if args.profile:
            _profile(forward, args.profile, rank, world)
    except torch.cuda.OutOfMemoryError:
        error, seconds = "out of memory", float("nan")
    flags = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / 2**30, seconds, float(error is not None)],
        device=device,
    )
    if mesh is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    peak_gib, seconds, failed = flags.tolist()
    if rank == 0:
        if failed:
            row.update(
                error=error or "out of memory on another rank", peak_mem_gib=round(peak_gib, 2)
            )
        else:
            flops = causal_flops(config, B, U)
            peak = args.peak_tflops or next(
                (v for k, v in PEAK_TFLOPS.items() if k in row["device"]), None
            )
            tflops = flops / seconds / 1e12
            row.update(
                tokens_per_s=round(B * U / seconds, 1), forward_ms=round(seconds * 1e3, 2),
                peak_mem_gib=round(peak_gib, 2), teacher_tflops=round(tflops, 1),
                mfu=None if peak is None else round(tflops / (peak * world), 4),
                flops_per_forward=flops,
            )  # fmt: skip
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        _print([row])
    if mesh is not None:
        dist.destroy_process_group()


def _profile(forward, path: str, rank: int, world: int) -> None:
    """Three forwards under torch.profiler; rank 0 writes the operators by CUDA time."""
    import torch

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(3):
            forward()
        torch.cuda.synchronize()
    if rank == 0:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"tp {world}\n{table}\n")


def _print(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in COLUMNS))


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run each TP size of ``--tp`` that the visible GPUs allow under torchrun, then print the
    rows they appended."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("bench_tp_teacher: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    out = Path(args.out)
    before = out.read_text(encoding="utf-8").count("\n") if out.exists() else 0
    for tp in (int(x) for x in args.tp.split(",")):
        if tp > gpus:
            print(f"bench_tp_teacher: skipping TP={tp}: {gpus} GPU(s) visible", file=sys.stderr)
            continue
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(tp), __file__, *argv,
        ]  # fmt: skip
        env = {**os.environ, "XTOKEN_BENCH_RANK": "1"}
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code != 0:
            print(f"bench_tp_teacher: TP={tp} exited {code}", file=sys.stderr)
    if out.exists():
        lines = out.read_text(encoding="utf-8").splitlines()[before:]
        print()
        _print([json.loads(line) for line in lines if line.strip()])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Launcher (no torchrun environment) or one rank (under torchrun)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "LOCAL_RANK" in os.environ or os.environ.get("XTOKEN_BENCH_RANK"):
        run_rank(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
