"""The healing report's arithmetic (benchmarks/quality/heal_stats.py): t-intervals, gap closed,
paired differences and the bars."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal_stats  # noqa: E402


def test_t_interval_of_paired_differences_uses_the_t_quantile_of_n_minus_one():
    d = heal_stats.t_interval([-0.10, -0.12, -0.08])
    half = 4.303 * 0.02 / math.sqrt(3)
    assert d["mean"] == pytest.approx(-0.10)
    assert d["lo"] == pytest.approx(-0.10 - half, abs=1e-4)
    assert d["hi"] == pytest.approx(-0.10 + half, abs=1e-4)
    assert heal_stats.t_critical(1) == pytest.approx(12.706, abs=1e-3)
    assert heal_stats.t_critical(10) == pytest.approx(2.228, abs=1e-3)
    one = heal_stats.t_interval([-0.1])
    assert one["lo"] is None and one["hi"] is None


@pytest.mark.skipif(importlib.util.find_spec("scipy") is not None, reason="scipy has every df")
def test_t_table_without_scipy_stops_at_df_10_and_names_scipy():
    with pytest.raises(ValueError, match="scipy"):
        heal_stats.t_critical(11)


def test_gap_closed_is_the_share_of_ce_to_parent_kd():
    assert heal_stats.gap_closed(2.0, 1.8, 1.6) == pytest.approx(0.5)
    assert heal_stats.gap_closed(2.0, 1.5, 1.6) == pytest.approx(1.25)
    assert heal_stats.gap_closed(2.0, 2.1, 1.6) == pytest.approx(-0.25)
    assert heal_stats.gap_closed(2.0, 1.8, 2.0) is None  # the parent's KD gained nothing


def _row(arm, seed, heldout, fresh):
    def split(b):
        cat = {"code": {"bits_per_byte": b, "bytes": 1}}
        return {
            "bits_per_byte": b,
            "accuracy": 0.5,
            "per_category": cat,
            "nextline": {"exact_match": 0.25},
        }

    return {
        "kind": "student",
        "arm": arm,
        "seed": seed,
        "heldout": split(heldout),
        "fresh": split(fresh),
    }


def _rows():
    rows = []
    for arm, base in (("ce", 2.0), ("pkl@smollm2", 1.6), ("xtoken@q", 1.75), ("gold@q", 1.99)):
        for seed, jitter in enumerate((0.0, 0.01, -0.01)):
            rows.append(_row(arm, seed, base + jitter, base + 0.5 + jitter))
    rows.append({"kind": "teacher", "arm": "q", "heldout": {"bits_per_byte": 1.0}})
    return rows


def test_summary_pairs_seeds_and_measures_the_gap_on_both_splits():
    s = heal_stats.summarize_heal(_rows(), "pkl@smollm2")
    x = s["arms"]["xtoken@q"]
    for split in heal_stats.SPLITS:
        assert x[split]["diff"]["values"] == pytest.approx([-0.25, -0.25, -0.25])
        assert x[split]["gap_closed"] == pytest.approx(0.625)
        assert x[split]["nextline"] == 0.25
    assert s["ce_sd"]["ce"]["heldout"] == pytest.approx(0.01)
    assert "diff" not in s["arms"]["ce"]["heldout"]


def test_bars_need_every_seed_beyond_twice_the_seed_sd_and_half_the_gap():
    s = heal_stats.summarize_heal(_rows(), "pkl@smollm2")
    bars = heal_stats.bars(s, ["xtoken@q", "gold@q"], ["pkl@smollm2", "xtoken@q", "gold@q"])
    met = {name.split(" ")[0]: ok for name, _, ok in bars}
    assert met["pkl@smollm2"] is True and met["xtoken@q"] is True
    assert met["gold@q"] is False  # -0.01 per seed is within 2 x 0.01
    assert met["best"] is True and "xtoken@q" in bars[-1][1]
    gold = heal_stats.bars(s, [], [], {"xtoken": "gold@q", "trl": {"heldout": 1.9, "fresh": 2.6}})
    assert gold[-1][2] is False


def test_an_arm_on_fewer_seeds_than_ce_is_not_judged_nor_the_best():
    # a validation sweep runs one seed: "every seed" and the best arm need CE's seeds
    rows = _rows() + [_row("pkl@q:kl_weight=0.5", 0, 1.5, 2.0)]
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    bars = heal_stats.bars(s, ["xtoken@q", "pkl@q:kl_weight=0.5"], ["pkl@q:kl_weight=0.5"])
    assert bars[0][2] is None and "1 seed, CE 3 (a sweep row" in bars[0][1]
    assert "xtoken@q" in bars[-1][1]


def test_gap_bar_says_when_the_parent_kd_left_no_gap():
    rows = [r for r in _rows() if r.get("arm") != "pkl@smollm2"]
    rows += [_row("pkl@smollm2", s, 2.1, 2.6) for s in range(3)]
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    name, figs, met = heal_stats.bars(s, ["xtoken@q"], ["xtoken@q"])[-1]
    assert "no gap" in figs and met is None


def test_rated_continuations_are_paired_with_ce_per_seed():
    rows = _rows()
    for r in rows:
        if r.get("kind") == "student":
            rated = {"ce": 3.0, "xtoken@q": 2.5}.get(r["arm"])
            if rated is not None:
                r["heldout"]["continuation"] = {"bits_per_byte": rated + r["seed"] / 10,
                                                "scorer": "q"}  # fmt: skip
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    c = s["arms"]["xtoken@q"]["heldout"]["continuation"]
    assert c["mean"] == pytest.approx(2.6) and c["diff"]["values"] == pytest.approx([-0.5] * 3)
    assert "continuation" not in s["arms"]["gold@q"]["heldout"]
    assert "continuation" not in s["arms"]["xtoken@q"]["fresh"]


def test_the_report_tables_the_rated_continuations_beside_ce(tmp_path):
    from benchmarks.quality.heal_report import report_heal

    names = {"xtoken@q": "xtoken@qwen2.5-coder-0.5b", "gold@q": "gold@smollm2"}  # real teachers
    rows = []
    for r in _rows():
        if r.get("kind") != "student":
            continue
        r.update(mode="heal", parent_arm="pkl@smollm2", student_tokenizer="smollm2")
        r["arm"] = names.get(r["arm"], r["arm"])
        for split in heal_stats.SPLITS:
            rated = 3.0 if r["arm"] == "ce" else 2.0
            r[split]["continuation"] = {"bits_per_byte": rated, "scorer": "qwen2.5-coder-0.5b"}
        rows.append(r)
    md = report_heal(rows, tmp_path)
    assert "own continuations, rated by a teacher" in md
    line = next(
        x
        for x in md.splitlines()
        if x.startswith("| xtoken@qwen2.5-coder-0.5b | qwen2.5-coder-0.5b | 2.0000")
    )
    assert "-1.0000" in line


def test_the_report_tables_the_validation_split_per_seed_beside_ce():
    from benchmarks.quality.heal_report import validation_section

    rows = []
    for r in _rows():
        if r.get("kind") == "student":
            end = {"ce": 0.9, "pkl@smollm2": 0.88}.get(r["arm"], 0.95) + r["seed"] / 100
            r["val_curve"] = [{"step": 0, "bits_per_byte": 2.0}, {"step": 9, "bits_per_byte": end}]
            rows.append(r)
    md = validation_section(rows, ["ce", "pkl@smollm2", "gold@q"])
    assert "| ce | 3 | s0 0.9000, s1 0.9100, s2 0.9200 | - |" in md
    assert "| pkl@smollm2 | 3 | s0 0.8800, s1 0.8900, s2 0.9000 | -0.0200 |" in md
    assert validation_section([r for r in rows if False], ["ce"]) == []
    # a KD arm at its own learning rate against CE at that rate; CE at another rate against ce
    for r in list(rows):
        if r["arm"] in ("ce", "gold@q"):
            arm = {"ce": "ce:lr=0.001", "gold@q": "gold@q:lr=0.001"}[r["arm"]]
            end = r["val_curve"][-1]["bits_per_byte"] - 0.05
            rows.append({**r, "arm": arm, "val_curve": [{"step": 9, "bits_per_byte": end}]})
    md = validation_section(rows, ["ce", "gold@q", "ce:lr=0.001", "gold@q:lr=0.001"])
    assert "| ce:lr=0.001 | 3 | s0 0.8500, s1 0.8600, s2 0.8700 | -0.0500 |" in md
    assert (
        "| gold@q:lr=0.001 | 3 | s0 0.9000, s1 0.9100, s2 0.9200 | +0.0500 (vs ce:lr=0.001) |" in md
    )


def test_gap_bar_is_judged_on_the_splits_where_the_parent_kd_left_a_gap():
    # the parent's KD beats CE on fresh only: the best arm is judged there, held-out is named
    rows = [r for r in _rows() if r.get("arm") != "pkl@smollm2"]
    rows += [_row("pkl@smollm2", s, 2.1 + j, 2.1 + j) for s, j in enumerate((0.0, 0.01, -0.01))]
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    name, figs, met = heal_stats.bars(s, ["xtoken@q", "gold@q"], ["xtoken@q"])[-1]
    # fresh: CE 2.5, parent 2.1, xtoken 2.25 -> 62.5% of the gap (printed 63%)
    assert figs.startswith("xtoken@q (parent pkl@smollm2): fresh 63%")
    assert "heldout: the parent's KD" in figs
    assert met is True


def test_ce_at_another_learning_rate_is_a_row_of_the_report_and_no_kd_arm(tmp_path):
    from benchmarks.quality.heal_report import report_heal

    rows = []
    for r in _rows():
        if r.get("kind") != "student" or r["arm"] not in ("ce", "pkl@smollm2"):
            continue
        r.update(mode="heal", parent_arm="pkl@smollm2", student_tokenizer="smollm2")
        rows.append(r)
    rows += [
        {**_row("ce:lr=0.001", 0, 1.95, 2.45), "mode": "heal", "parent_arm": "pkl@smollm2"},
    ]
    md = report_heal(rows, tmp_path)
    assert any(x.startswith("| ce:lr=0.001 | 1 |") for x in md.splitlines())
    assert "ce:lr=0.001 beats CE" not in md  # not judged as a KD arm


def test_an_arm_names_its_settings_apart_from_what_it_is():
    assert heal_stats.split_settings("gold@q:kl_weight=0.5,lr=0.001") == (
        "gold@q",
        frozenset({"kl_weight=0.5", "lr=0.001"}),
    )
    assert heal_stats.split_settings("pkl@q:on_policy=0.5,kl_weight=0.5") == (
        "pkl@q:on_policy=0.5",
        frozenset({"kl_weight=0.5"}),
    )
    assert heal_stats.split_settings("ce:lr=0.001") == ("ce", frozenset({"lr=0.001"}))
    refs = heal_stats.references(
        ["ce", "ce:lr=0.001", "pkl@smollm2", "pkl@smollm2:kl_weight=0.5",
         "gold@q:lr=0.001,kl_weight=0.5", "gold@q:kl_weight=0.5", "gold@q:temperature=2"],
        "pkl@smollm2",
    )  # fmt: skip
    assert refs["gold@q:lr=0.001,kl_weight=0.5"] == {"ce": "ce:lr=0.001", "parent": None}
    assert refs["gold@q:kl_weight=0.5"] == {"ce": "ce", "parent": "pkl@smollm2:kl_weight=0.5"}
    assert refs["gold@q:temperature=2"] == {"ce": "ce", "parent": None}
    assert refs["ce:lr=0.001"]["ce"] == "ce:lr=0.001"


def _at(rows, suffix, shift):
    """Copies of ``rows``' students as arms with ``suffix`` settings, ``shift`` bits/byte lower."""
    out = []
    for r in rows:
        if r.get("kind") == "student":
            head, colon, extra = r["arm"].partition(":")
            arm = f"{r['arm']},{suffix}" if colon else f"{head}:{suffix}"
            out.append(_row(arm, r["seed"], r["heldout"]["bits_per_byte"] - shift,
                            r["fresh"]["bits_per_byte"] - shift))  # fmt: skip
    return out


def test_an_arm_at_its_own_learning_rate_is_paired_with_ce_at_that_rate():
    # at lr=0.001 everything is 0.3 lower: against CE at 0.001 the differences are the same,
    # against the call's CE they would be 0.3 better
    rows = _rows() + _at(_rows(), "lr=0.001", 0.3)
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    x = s["arms"]["xtoken@q:lr=0.001"]["heldout"]
    assert s["refs"]["xtoken@q:lr=0.001"] == {"ce": "ce:lr=0.001", "parent": "pkl@smollm2:lr=0.001"}
    assert x["diff"]["values"] == pytest.approx([-0.25] * 3)
    assert x["gap_closed"] == pytest.approx(0.625)
    assert "diff" not in s["arms"]["ce:lr=0.001"]["heldout"]
    bars = heal_stats.bars(s, ["xtoken@q:lr=0.001"], ["gold@q:lr=0.001", "xtoken@q:lr=0.001"])
    assert bars[0][0].startswith("gold@q:lr=0.001 beats CE at lr=0.001") and bars[0][2] is False
    assert bars[1][2] is True and "vs -0.0200" in bars[1][1]  # CE at 0.001's spread
    assert "parent pkl@smollm2:lr=0.001" in bars[-1][1]


def test_a_kd_arm_without_ce_at_its_rate_or_on_one_seed_is_not_judged():
    rows = _rows() + [_row("xtoken@q:lr=0.002", s, 1.5, 2.0) for s in range(3)]
    rows += [_row("ce:lr=0.0001", 0, 2.2, 2.7), _row("xtoken@q:lr=0.0001", 0, 2.1, 2.6)]
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    bars = heal_stats.bars(s, [], ["xtoken@q:lr=0.002", "xtoken@q:lr=0.0001"])
    assert bars[0][2] is None and "no CE rows at its learning rate" in bars[0][1]
    assert bars[1][2] is None and "1 seed, CE 1 (a sweep row" in bars[1][1]
    # an arm asked for but never scored: no rows, and no best arm from it
    none = heal_stats.bars(s, ["gold@q:lr=0.002"], ["gold@q:lr=0.002"])
    assert none[0][1] == "no rows" and none[-1] == (
        "best cross-tokenizer arm closes >= 50% of the gap",
        "no rows",
        None,
    )


def test_the_gap_bar_prefers_an_arm_judged_on_both_splits():
    # weight 1: the parent leaves a gap on fresh only, where xtoken closes 62.5%; at weight 0.5
    # it leaves one on both splits and xtoken closes 55% on each: that arm is the best
    rows = [r for r in _rows() if r.get("arm") not in ("pkl@smollm2", "gold@q")]
    rows += [_row("pkl@smollm2", s, 2.1, 2.1) for s in range(3)]
    rows += [_row("pkl@smollm2:kl_weight=0.5", s, 1.6, 2.1) for s in range(3)]
    rows += [_row("xtoken@q:kl_weight=0.5", s, 1.78, 2.28) for s in range(3)]
    s = heal_stats.summarize_heal(rows, "pkl@smollm2")
    name, figs, met = heal_stats.bars(s, ["xtoken@q", "xtoken@q:kl_weight=0.5"], [])[-1]
    assert figs.startswith("xtoken@q:kl_weight=0.5 (parent pkl@smollm2:kl_weight=0.5): heldout 55%")
    assert "fresh 55%" in figs and met is True
