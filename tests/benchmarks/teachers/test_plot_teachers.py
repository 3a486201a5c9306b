"""The teachers' plot: its figures from rows, and the PNG from the committed rows."""

from __future__ import annotations

import pytest

from benchmarks.teachers import plot_teachers as plot


def _row(**kw) -> dict:
    row = {
        "commit": "c1", "tag": "", "rate": "step_starts", "error": None, "teacher": "qwen2.5-7b",
        "gpus": 1, "layout": "coloc", "transport": "cuda_ipc", "top_k": None, "grad_accum": 1,
        "teachers": 1, "forward_rows": None, "ahead_steps": 1, "tokens_per_s": 100.0,
        "mfu_e2e": 0.5,
    }  # fmt: skip
    return {**row, **kw}


def test_scaling_divides_each_multi_gpu_run_by_the_one_gpu_mean_of_its_grad_accum():
    rows = [
        _row(tokens_per_s=100.0),
        _row(tokens_per_s=120.0),
        _row(grad_accum=4, tokens_per_s=125.0),
        _row(gpus=4, tokens_per_s=385.0),
        _row(gpus=2, layout="dedicated", tokens_per_s=198.0),
        _row(gpus=4, grad_accum=4, tokens_per_s=475.0),
        _row(gpus=4, grad_accum=8, tokens_per_s=500.0),  # no one-GPU row at 8: not on the panel
        _row(transport="topk", top_k=64, tokens_per_s=50.0),  # not a ring: not the baseline
    ]
    base, more = plot.scaling(rows)
    assert base == {1: 110.0, 4: 125.0}
    assert more == [(2, "dedicated", 1, 1.8), (4, "coloc", 1, 3.5), (4, "coloc", 4, 3.8)]


def test_scaling_without_a_one_gpu_row_says_so():
    with pytest.raises(ValueError, match="no one-GPU 7B rows"):
        plot.scaling([_row(gpus=4)])


def test_topk_is_compared_with_the_rings_of_its_own_commit_and_host_load():
    rows = [
        _row(tokens_per_s=100.0),
        _row(transport="topk", top_k=64, tokens_per_s=95.0),
        _row(transport="topk", top_k=64, ahead_steps=2, tokens_per_s=88.0),
        _row(commit="c2", tokens_per_s=200.0),
        _row(commit="c2", transport="topk", top_k=32, tokens_per_s=190.0),
        _row(commit="c3", transport="topk", top_k=32, tokens_per_s=1.0),  # no ring: left out
    ]
    assert plot.topk_ratios(rows) == {(32, 1): [0.95], (64, 1): [0.95], (64, 2): [0.88]}


def test_the_big_teacher_panel_marks_record_time_rates():
    rows = [
        _row(teacher="qwen2.5-32b", layout="coloc-tp2", gpus=4, grad_accum=4, mfu_e2e=0.38),
        _row(teacher="qwen2.5-32b", layout="coloc-tp4", gpus=4, grad_accum=4, mfu_e2e=0.26,
             rate="record_times"),
        _row(teacher="qwen2.5-32b", layout="coloc-tp2", gpus=2, grad_accum=4, mfu_e2e=0.39,
             forward_rows=2),  # a lever's row: not on the panel
    ]  # fmt: skip
    assert plot.big_teacher(rows) == [
        ("coloc-tp2\n4 GPUs", 0.38, False),
        ("coloc-tp4\n4 GPUs\n(record-time)", 0.26, True),
    ]


def test_the_png_draws_from_the_committed_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows_path = plot.RESULTS / "teachers.jsonl"
    rows = plot.read_rows(rows_path)
    assert all(not r.get("error") for r in rows)
    assert plot.main(["--rows", str(rows_path), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the rows hold the figures the results file opens with
    text = (plot.RESULTS / "teachers.md").read_text()
    mfu = max(m for label, m, late in plot.big_teacher(rows) if "4 GPUs" in label and not late)
    assert f"MFU {mfu:.3f}" in text
    _, more = plot.scaling(plot.timed(rows))
    best = max(x for g, lay, _, x in more if (g, lay) == (4, "coloc"))
    assert f"{best:.2f}x" in text
