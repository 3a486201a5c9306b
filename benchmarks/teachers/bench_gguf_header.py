"""Benchmark: a GGUF teacher's header read by xtoken's reader against the ``gguf`` package's
``GGUFReader``, side by side in one process: the vocab of each bundled GGUF preset, and the
pre-flight of a run whose teacher is ``gguf:PATH`` with top-K targets (it reads the vocab twice).

Writes ``benchmarks/results/teachers_gguf_header.jsonl`` (one row a run) and
``teachers_gguf_header.md`` (current figures first):

    python benchmarks/teachers/bench_gguf_header.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import _common  # noqa: E402

from xtoken_core.models import gguf as model_gguf  # noqa: E402
from xtoken_core.tokenizers.gguf_parts import SPLIT_GGUFS, assembled_gguf, parts_installed  # noqa: E402

ROWS = _common.RESULTS_DIR / "teachers_gguf_header.jsonl"
REPORT = _common.RESULTS_DIR / "teachers_gguf_header.md"
COMMAND = "python benchmarks/teachers/bench_gguf_header.py"
PRESETS = {"qwen2.5-coder-0.5b": "qwen3", "gemma3-270m": "gemma3"}


def package_vocab_size(path: str | Path) -> int:
    """The baseline: the same vocab through ``gguf.GGUFReader`` (every array decoded)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.vocab_size")
    if field is not None:
        return int(field.contents())
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _preflight_config(gguf: Path, tokenizer: str, work: Path) -> Path:
    """A run config whose teacher is ``gguf:PATH`` sending top-K targets (the demo corpus)."""
    cfg = {
        "run_dir": str(work / "run"),
        "student_tokenizer": "smollm2",
        "teacher_tokenizer": tokenizer,
        "teacher": {"model": f"gguf:{gguf}", "device": "cpu", "transport": "topk", "top_k": 32},
        "trainer": {
            "student": {"model": "smollm2"},
            "compute": {"device": "cpu"},
            "schedule": {"max_steps": 1},
            "loss": {"mode": "pkl", "vocab_topk": None},
        },
    }
    path = work / f"{tokenizer}.json"
    path.write_text(json.dumps(cfg))
    return path


def bench(name: str, repeat: int) -> dict:
    from services.supervise.config import load_run_config
    from services.supervise.preflight import preflight

    path = assembled_gguf(name)
    ours_s, ours = _timed(lambda: model_gguf.gguf_vocab_size(path), repeat)
    theirs_s, theirs = _timed(lambda: package_vocab_size(path), repeat)
    if ours != theirs:
        raise SystemExit(f"{name}: vocab {ours} != the package's {theirs}")
    with tempfile.TemporaryDirectory() as tmp:
        config = load_run_config(_preflight_config(path, PRESETS[name], Path(tmp)))
        preflight(config)  # the projection is built and cached once, outside the timing
        pre_s, _ = _timed(lambda: preflight(config), repeat)
        with mock.patch.object(model_gguf, "gguf_vocab_size", package_vocab_size):
            base_s, _ = _timed(lambda: preflight(config), repeat)
    return {
        "preset": name,
        "vocab": ours,
        "read_s": round(ours_s, 4),
        "package_read_s": round(theirs_s, 3),
        "read_ratio": round(theirs_s / ours_s, 1),
        "preflight_s": round(pre_s, 2),
        "package_preflight_s": round(base_s, 2),
        "preflight_ratio": round(pre_s / base_s, 2),
    }


def write_report(rows: list[dict]) -> str:
    last = {r["preset"]: r for r in rows}
    figures = "; ".join(
        f"{p}: the vocab in {r['read_s'] * 1000:.0f} ms against {r['package_read_s']:.2f} s "
        f"({r['read_ratio']:.0f}x); the run's pre-flight "
        f"{r['package_preflight_s'] - r['preflight_s']:.1f} s shorter "
        f"({r['preflight_s']:.2f} s against {r['package_preflight_s']:.2f} s)"
        for p, r in last.items()
    )
    r0 = next(iter(last.values()))
    lines = [
        "# A GGUF teacher's header: xtoken's reader against the gguf package's",
        "",
        f"**Current figures** (commit {r0['commit']}, {r0['date']}, {r0['device']}, median of "
        f"{r0['repeat']} each, side by side in one process): {figures}. Command: `{COMMAND}`. "
        "Rows: [teachers_gguf_header.jsonl](teachers_gguf_header.jsonl).",
        "",
        "A run whose teacher is `gguf:PATH` reads the file's vocab in its pre-flight, before any "
        "process starts (`services/supervise/preflight.py`: the vocab check, and again the top-K "
        "check of a `topk` transport). `gguf.GGUFReader` decodes every item of every array when "
        "it opens a file (the 150-260 k tokens and merges), xtoken's reader "
        "(`xtoken_core/tokenizers/gguf_header.py`) steps over them with their lengths alone. The "
        "baseline pre-flight is the same code with the package's reader put back in. Both "
        "pre-flights are timed warm (the tokenizers loaded and the projection built by a first "
        "call in the process): what is left is the GGUF reads and the checks; a cold `xtoken run` "
        "adds its imports and tokenizer loads (a few seconds) to both.",
        "",
        "| date | commit | device | preset | vocab | read ms | package read s | x | "
        "pre-flight s | with the package s | saved s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['date']} | {r['commit']} | {r['device']} | {r['preset']} | {r['vocab']:,} | "
            f"{r['read_s'] * 1000:.1f} | {r['package_read_s']:.2f} | {r['read_ratio']:.0f} | "
            f"{r['preflight_s']:.2f} | {r['package_preflight_s']:.2f} | "
            f"{r['package_preflight_s'] - r['preflight_s']:.1f} |"
        )
    REPORT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return "\n".join(lines[-len(rows) - 2 :])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="rewrite the report from the rows")
    args = parser.parse_args()
    if args.report:
        print(write_report([json.loads(x) for x in ROWS.read_text().splitlines()]))
        return 0
    names = [n for n in PRESETS if parts_installed(SPLIT_GGUFS[n])]
    if not names:
        print('needs the GGUF part packages: pip install "xtoken[models]"', file=sys.stderr)
        return 2
    common = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _common.commit(),
        "device": _common.cpu_name(),
        "repeat": args.repeat,
    }
    new = [{**common, **bench(n, args.repeat)} for n in names]
    old = [json.loads(x) for x in ROWS.read_text().splitlines()] if ROWS.exists() else []
    with ROWS.open("a", encoding="utf-8") as f:
        for r in new:
            f.write(json.dumps(r) + "\n")
    print(write_report(old + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
