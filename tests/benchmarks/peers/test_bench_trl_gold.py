"""The TRL GOLD peer benchmark end to end on the CPU (tiny models, TRL from .venv-bench)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"


def _has_trl() -> bool:
    if not BENCH_PY.is_file():
        return False
    probe = subprocess.run([str(BENCH_PY), "-c", "import trl, datasets"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(
    not _has_trl(), reason="needs .venv-bench with trl: ./scripts/setup.sh test peers"
)
def test_cpu_smoke_records_trl_refusal_and_both_trainers_figures(tmp_path):
    results = tmp_path / "peers.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "peers" / "bench_trl_gold.py"),
        "--device",
        "cpu",
        "--student",
        "tiny",
        "--teacher",
        "tiny",
        "--shapes",
        "64",
        "--modes",
        "xtoken",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--trl-steps",
        "2",
        "--trl-warmup",
        "1",
        "--quality-steps",
        "2",
        "--quality-T",
        "64",
        "--heldout-texts",
        "2",
        "--trl-python",
        str(BENCH_PY),
        "--results",
        str(results),
        "--work",
        str(tmp_path / "w"),
        "--no-xtoken-warm-run",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    speed = {(r["system"], r["mode"]): r for r in rows if r["part"] == "speed"}
    # Mistral's SentencePiece teacher: TRL's default byte-offset ULD refuses it, recorded as a row
    assert "NotImplementedError" in speed[("TRL GOLD", "uld extended")]["error"]
    assert speed[("TRL GOLD", "uld positional")]["tokens_per_s"] > 0
    assert speed[("xtoken", "xtoken")]["tokens_per_s"] > 0
    assert speed[("xtoken", "xtoken")]["speedup"] > 0
    quality = [r for r in rows if r["part"] == "quality" and not r.get("error")]
    assert {r["system"] for r in quality} == {"student before", "TRL GOLD", "xtoken"}
    assert all(math.isfinite(r["bits_per_byte"]) and r["bits_per_byte"] > 0 for r in quality)
    md = results.with_suffix(".md").read_text()
    assert "NeMo RL" in md and "| 64 | xtoken | xtoken |" in md


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, "0"), ("", "0"), ("2", "2"), ("3,1", "3"), (" GPU-ab12 ,GPU-cd34", "GPU-ab12")],
)
def test_memory_sampler_reads_the_gpu_cuda_visible_devices_names_first(visible, expected):
    """nvidia-smi ignores CUDA_VISIBLE_DEVICES: the sampler asks for the run's own GPU."""
    from benchmarks.peers.bench_trl_gold import visible_gpu

    assert visible_gpu(visible) == expected
