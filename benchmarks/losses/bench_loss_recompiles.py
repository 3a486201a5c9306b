"""Does the loss compile Triton kernels again as the data varies from batch to batch?

A training run meets a new batch every step: other text lengths, chunk counts, pair counts. A
kernel that Triton specializes on such a value (an int argument that happens to be 1 or a
multiple of 16, a constexpr derived from it) is compiled again for each new class of values,
and a compile costs 0.1-1 s, in the step that meets it. This script feeds the loss (forward +
backward, as the trainer calls it) ``--batches`` distinct real batches (demo-corpus texts,
collated with the real tokenizers) with an empty Triton cache, and reports per call the wall
time and the kernels compiled during it (Triton's ``jit_post_compile_hook``).

Usage (GPU)::

    python benchmarks/losses/bench_loss_recompiles.py --shapes 1x4096 4x2048 --modes pkl gold xtoken
    # a young model: gold's rows all go to its reference for 4 calls, then not
    python benchmarks/losses/bench_loss_recompiles.py --shapes 4x2048 --modes gold --flat-calls 4

Logits are random (the loss's cost does not depend on the model); student vocab 151,936
(Qwen3), teacher 32,768 (Mistral), the projection built from the two tokenizers.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# an empty cache, before Triton is imported: every compile shows (unless --keep-cache)
if "--keep-cache" not in sys.argv:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="xtoken_triton_cache_")

import torch  # noqa: E402

from benchmarks._common import RESULTS_DIR, append_rows, commit, device_name  # noqa: E402
from benchmarks.e2e.bench_pipeline import build_projection, collated, long_corpus  # noqa: E402


class CompileCounter:
    """Counts Triton compiles (kernel name and specialization) through Triton's runtime hook."""

    def __init__(self) -> None:
        import triton

        self.knobs = triton.knobs.runtime
        self.events: list[tuple[str, str]] = []
        self._prev = self.knobs.jit_post_compile_hook
        self.knobs.jit_post_compile_hook = self._hook

    def _hook(self, *args, **kwargs) -> bool:
        name = getattr(kwargs.get("fn"), "name", "?")
        self.events.append((str(name), str(kwargs.get("repr", ""))))
        return False

    def take(self) -> list[tuple[str, str]]:
        out, self.events = self.events, []
        return out


class SpecializationSpy:
    """Records, per kernel and argument, every specialization Triton's binder gave it (what a
    new compile was keyed on), through the launch path of ``LazyJit``."""

    def __init__(self) -> None:
        from triton.runtime import driver

        from xtoken_core.kernels import _utils

        self.seen: dict = collections.defaultdict(lambda: collections.defaultdict(set))
        original = _utils.LazyJit.__getitem__
        seen = self.seen

        def getitem(lazy, grid):
            jitted, launcher = lazy.jitted(), original(lazy, grid)

            def launch(*a, **kw):
                binder = jitted.device_caches[driver.active.get_current_device()][4]
                _, spec, _ = binder(*a, **kw)
                for param, value in zip(jitted.params, spec):
                    seen[lazy.__name__][param.name].add(str(value))
                for name, value in kw.items():
                    seen[lazy.__name__][name].add(repr(value))
                return launcher(*a, **kw)

            return launch

        _utils.LazyJit.__getitem__ = getitem

    def varying(self) -> dict:
        """``{kernel: {argument: sorted specializations}}`` for arguments seen with several."""
        return {
            k: {a: sorted(v) for a, v in args.items() if len(v) > 1}
            for k, args in self.seen.items()
            if any(len(v) > 1 for v in args.values())
        }


def run(args, mode: str, B: int, T: int, corpus: Path, projection: str, counter) -> dict:
    from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig

    device = torch.device(args.device)
    loss_fn = CrossTokenizerLoss(
        CrossTokenizerLossConfig(
            projection=projection,
            mode=mode,
            teacher_vocab_size=args.teacher_vocab,
        )
    )
    batches = collated(args, B, T, corpus, args.batches)
    g = torch.Generator(device=device).manual_seed(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, compiles, names, log = [], [], collections.Counter(), []
    for call, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        Ts, Tt = batch["input_ids"].shape[1], batch["teacher_input_ids"].shape[1]
        z_s = torch.randn(B, Ts, args.student_vocab, device=device, generator=g)
        if call < args.flat_calls:  # a young model's nearly flat rows
            z_s.mul_(0.01)
        z_s = z_s.to(torch.bfloat16).requires_grad_(True)
        z_t = torch.randn(B, Tt, args.teacher_vocab, device=device, generator=g)
        z_t = z_t.to(torch.bfloat16)
        sync()
        t0 = time.perf_counter()
        counts = loss_fn.count_valid([batch])
        loss, _ = loss_fn(z_s, z_t, batch, **counts)
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        events = counter.take()
        compiles.append(len(events))
        names.update(n for n, _ in events)
        log.extend({"call": call, "kernel": n, "specialization": r} for n, r in events)
        del z_s, z_t, loss
    steady = times[args.first :]
    late = compiles[args.first :]
    return {
        "mode": mode,
        "shape": f"{B}x{T}",
        "batches": len(times),
        "compiles_first": sum(compiles[: args.first]),
        "compiles_later": sum(late),
        "calls_compiling_later": sum(1 for c in late if c),
        "median_ms": 1000 * statistics.median(steady),
        "max_ms": 1000 * max(steady),
        "ms_per_call": [round(1000 * t, 2) for t in times],
        "compiles_per_call": compiles,
        "kernels_compiled": dict(names),
    }, log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x4096", "4x2048"])
    p.add_argument("--modes", nargs="+", default=["pkl", "gold", "xtoken"])
    p.add_argument("--batches", type=int, default=16, help="distinct batches per mode and shape")
    p.add_argument("--first", type=int, default=3, help="calls counted as warm-up")
    p.add_argument("--student-tokenizer", default="qwen3")
    p.add_argument("--teacher-tokenizer", default="mistral")
    p.add_argument("--student-vocab", type=int, default=151936)
    p.add_argument("--teacher-vocab", type=int, default=32768)
    p.add_argument("--device", default="cuda")
    p.add_argument("--keep-cache", action="store_true", help="use Triton's usual cache dir")
    p.add_argument(
        "--flat-calls",
        type=int,
        default=0,
        help="the first calls' student logits scaled by 0.01 (a young model's flat rows, which "
        "gold sends to its top-k reference): kernels first needed by later calls show",
    )
    p.add_argument("--tag", default="")
    p.add_argument("--work", default="/tmp/xtoken_bench_recompiles")
    p.add_argument("--results", default=str(RESULTS_DIR / "losses_recompiles.jsonl"))
    p.add_argument(
        "--why", action="store_true", help="print the arguments whose specialization varied"
    )
    p.add_argument("--log", default=None, help="every compile (call, kernel, signature) as JSONL")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XTOKEN_CACHE", str(work / "cache"))
    projection = build_projection(args, work)
    counter = CompileCounter()
    spy = SpecializationSpy() if args.why else None
    rows = []
    print(
        f"{'shape':>7} {'mode':>7} {'batches':>7} {'compiles 1st':>12} {'later':>6} "
        f"{'calls':>6} {'median ms':>9} {'max ms':>8}"
    )
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        corpus = long_corpus(work / f"corpus_{T}.jsonl", chars=8 * T, count=B * args.batches)
        for mode in args.modes:
            r, log = run(args, mode, B, T, corpus, projection, counter)
            rows.append(r)
            if args.log:
                append_rows(args.log, [{"shape": shape, "mode": mode, **e} for e in log])
            print(
                f"{r['shape']:>7} {mode:>7} {r['batches']:>7} {r['compiles_first']:>12} "
                f"{r['compiles_later']:>6} {r['calls_compiling_later']:>6} "
                f"{r['median_ms']:>9.2f} {r['max_ms']:>8.2f}"
            )
            print(f"        per call ms: {r['ms_per_call']}")
            print(f"        compiles:    {r['compiles_per_call']}  {r['kernels_compiled']}")
            if spy is not None:
                for kernel, varying in spy.varying().items():
                    print(f"        varies: {kernel} {varying}")
                spy.seen.clear()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    stamp = {
        "commit": commit(),
        "device": device_name() if args.device == "cuda" else "cpu",
        "tag": args.tag,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    append_rows(args.results, [{**stamp, **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
