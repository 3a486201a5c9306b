"""The plot scripts of the TRL GOLD comparison and the 2-GPU scaling run draw a PNG from the
committed results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip(
    "matplotlib", reason="matplotlib is not installed: ./scripts/setup.sh test bench installs it"
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _module(rel: str):
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trl_gold_plot_writes_a_png_from_the_rows_and_the_printed_figures(tmp_path):
    mod = _module("benchmarks/peers/plot_trl_gold.py")
    path = mod.main(["--out-dir", str(tmp_path)])
    assert path == tmp_path / "peers_trl_gold.png"
    _assert_png(path)


def test_trl_gold_bars_take_each_call_from_its_source():
    mod = _module("benchmarks/peers/plot_trl_gold.py")
    rows = [json.loads(ln) for ln in (RESULTS / "peers_trl_gold.jsonl").read_text().splitlines()]
    bars = {(b.T, b.series): b for b in mod.bars(rows, (RESULTS / "peers_trl_gold.md").read_text())}
    printed = {k for k, b in bars.items() if b.printed}
    # the first call's figures were only printed: TRL at both T, xtoken without act. checkpointing
    assert printed == {
        (2048, "trl_printed"),
        (4096, "trl_printed"),
        (2048, "gold"),
        (2048, "pkl"),
        (4096, "gold"),
    }
    assert bars[(2048, "trl_printed")].tokens_per_s == 375  # "375 / 379": 379 is the JSONL row's
    assert bars[(2048, "trl_rows")].tokens_per_s == pytest.approx(379.2, abs=0.1)
    assert all(b.x_trl is not None for k, b in bars.items() if not k[1].startswith("trl"))


def test_scaling_plot_writes_a_png_from_the_tagged_rows(tmp_path):
    mod = _module("benchmarks/e2e/plot_scaling.py")
    path = mod.main(["--out-dir", str(tmp_path)])
    assert path == tmp_path / "scaling_2gpu.png"
    _assert_png(path)


def test_scaling_rows_are_one_and_two_ranks_at_the_same_global_batch():
    mod = _module("benchmarks/e2e/plot_scaling.py")
    rows = [json.loads(ln) for ln in (RESULTS / "e2e_pipeline.jsonl").read_text().splitlines()]
    by_ranks = mod.pick(rows)
    assert {n: r["trainers"] * r["grad_accum"] for n, r in by_ranks.items()} == {1: 2, 2: 2}
    assert all(len(r["pipeline"]["losses"]) > 1 for r in by_ranks.values())


def test_the_ordered_one_and_two_rank_rows_have_the_same_per_step_losses():
    """The committed two-GPU curves: 2 ranks x 1 micro-batch train the samples of 1 rank x 2 in
    every step (``data.ordered``), so each step's loss agrees within bf16 rounding."""
    mod = _module("benchmarks/e2e/plot_scaling.py")
    rows = [json.loads(ln) for ln in (RESULTS / "e2e_pipeline.jsonl").read_text().splitlines()]
    by_ranks = mod.pick(rows)
    assert all(r["ordered"] for r in by_ranks.values())
    one, two = (by_ranks[n]["pipeline"]["losses"] for n in (1, 2))
    assert len(one) == len(two) >= 50
    assert two == pytest.approx(one, rel=4e-3)  # bf16: 8 bits of mantissa
