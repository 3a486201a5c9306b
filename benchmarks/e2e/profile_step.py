"""Where a bare distillation step spends its time: the teacher forward and the student step's
phases (default and eager), the host's time outside the phases, and the top GPU kernels.

Usage (GPU)::

    python benchmarks/e2e/profile_step.py --shape 1x4096 --mode pkl --top 25
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402


def _teacher_ms(teacher, batch, device, n: int = 5) -> float:
    times = []
    for _ in range(n + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            teacher(input_ids=batch["teacher_input_ids"].to(device), use_cache=False)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1x4096")
    p.add_argument("--mode", default="pkl")
    p.add_argument("--variants", nargs="+", default=["default", "eager"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    bp.add_model_args(p)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    B, T = (int(x) for x in args.shape.split("x"))
    student_dir, teacher_dir = bp.save_models(args, work)
    projection = bp.build_projection(args, work)
    corpus = bp.long_corpus(work / f"corpus_{T}.jsonl", chars=8 * T, count=B * 8)
    batches = bp.collated(args, B, T, corpus, 4)
    device = torch.device(args.device)
    for variant in args.variants:
        eager = variant == "eager"
        worker = bp._bare_student(args, args.mode, B, T, student_dir, projection, eager)
        teacher = bp._bare_teacher(args, teacher_dir, eager)
        t_ms = _teacher_ms(teacher, batches[0], device)
        for i in range(3):
            bp._bare_step(worker, teacher, batches[i % 4], args.mode)
        torch.cuda.synchronize()
        phases, walls = [], []
        for i in range(args.steps):
            logits = None
            if args.mode != "ce":
                with torch.inference_mode():
                    ids = batches[i % 4]["teacher_input_ids"].to(device)
                    logits = teacher(input_ids=ids, use_cache=False).logits
                logits = logits.clone()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            from services.trainer.step import MicroBatch

            mb = MicroBatch(keys=[], batch=batches[i % 4], teacher_logits=lambda x=logits: x)
            result = worker.run([mb])
            torch.cuda.synchronize()
            walls.append(1000 * (time.perf_counter() - t1))
            phases.append(result.times)
        split = {k: round(1000 * statistics.median(p[k] for p in phases), 2) for k in phases[0]}
        wall = statistics.median(walls)
        print(
            f"{variant}: teacher fwd {t_ms:.1f} ms | student step wall {wall:.1f} ms, phases "
            f"{split} (sum {sum(split.values()):.1f}, outside the phases "
            f"{wall - sum(split.values()):.1f})"
        )
        if variant == "default" and args.top:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for i in range(2):
                    bp._bare_step(worker, teacher, batches[i % 4], args.mode)
                torch.cuda.synchronize()
            print(
                prof.key_averages().table(
                    sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60
                )
            )
        del worker, teacher
        bp._free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
