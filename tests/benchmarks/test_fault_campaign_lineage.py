"""The fault campaign's lineage checker (benchmarks/faults/lineage.py): the final student's
history from keys logs across restarts, and the campaign's plan drawn from a run's seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.faults import campaign, lineage  # noqa: E402


def _rec(rank: int, step: int, *keys: str) -> dict:
    return {"event": "trained", "rank": rank, "step": step, "epoch": 0, "keys": list(keys)}


def _write_run(run_dir: Path, records: list[dict], final_step: int | None) -> None:
    (run_dir / "keys").mkdir(parents=True)
    for rank in sorted({r["rank"] for r in records}):
        lines = [json.dumps(r) for r in records if r["rank"] == rank]
        (run_dir / "keys" / f"trainer.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    if final_step is not None:
        (run_dir / "summary.json").write_text(json.dumps({"step": final_step, "stopped": False}))


def test_a_run_without_restart_keeps_every_step():
    records = [_rec(0, 1, "a", "b"), _rec(0, 2, "c"), _rec(1, 1, "d"), _rec(1, 2, "e")]
    assert lineage.final_history(records) == {0: {1: ["a", "b"], 2: ["c"]}, 1: {1: ["d"], 2: ["e"]}}


def test_a_restart_from_a_checkpoint_drops_the_steps_past_it_that_the_first_launch_trained():
    # launch 1 trained steps 1-3, checkpoint at 2; launch 2 resumes at 3 with other samples
    records = [_rec(0, 1, "a"), _rec(0, 2, "b"), _rec(0, 3, "c"), _rec(0, 3, "c"), _rec(0, 4, "d")]
    assert lineage.final_history(records) == {0: {1: ["a"], 2: ["b"], 3: ["c"], 4: ["d"]}}
    t = lineage.tally(["a", "b", "c", "d"], ["a", "b", "c", "d"])
    assert t.ok


def test_a_restart_before_the_first_checkpoint_starts_the_history_again():
    records = [_rec(0, 1, "a"), _rec(0, 2, "b"), _rec(0, 1, "b"), _rec(0, 2, "c")]
    history = lineage.final_history(records)
    assert history == {0: {1: ["b"], 2: ["c"]}}
    t = lineage.tally([k for s in history[0].values() for k in s], ["a", "b", "c"])
    assert t.missing == ["a"] and not t.twice  # "a" was only in a rolled-back step


def test_a_relaunch_that_logs_no_step_is_cut_at_the_step_the_run_ended_on(tmp_path):
    # launch 1 logged step 3 after the checkpoint of step 2; its relaunch resumed at 2 and found
    # no data: the final student holds steps 1-2 only, so "c" was never trained into it
    _write_run(tmp_path, [_rec(0, 1, "a"), _rec(0, 2, "b"), _rec(0, 3, "c")], final_step=2)
    result = lineage.check_lineage(tmp_path, ["a", "b", "c"])
    assert result.tally.missing == ["c"] and result.rolled_back == 1 and not result.ok


def test_tally_counts_missing_twice_and_keys_of_no_corpus():
    t = lineage.tally(["a", "a", "b", "zz"], ["a", "b", "c"])
    assert (t.missing, t.twice, t.extra) == (["c"], ["a"], ["zz"])
    assert not t.ok


def test_on_policy_samples_of_corpus_texts_are_neither_missing_nor_extra_but_count_twice():
    trained = ["a", "b", "p0:a", "p0:b", "p1:a", "p1:a"]
    t = lineage.tally(trained, ["a", "b"], on_policy=True)
    assert t.missing == [] and t.extra == [] and t.twice == ["p1:a"] and t.on_policy == 3
    assert lineage.tally(trained, ["a", "b"]).extra == ["p0:a", "p0:b", "p1:a"]


def test_check_lineage_reads_every_rank_and_reports_a_step_a_rank_lacks(tmp_path):
    records = [_rec(0, 1, "a"), _rec(0, 2, "b"), _rec(1, 1, "c"), _rec(1, 3, "d")]
    _write_run(tmp_path, records, final_step=3)
    result = lineage.check_lineage(tmp_path, ["a", "b", "c", "d"])
    assert result.tally.ok and result.steps == {0: 2, 1: 2}
    assert result.gaps == ["1:2"] and not result.ok


def test_a_torn_last_line_of_a_killed_rank_is_skipped(tmp_path):
    _write_run(tmp_path, [_rec(0, 1, "a")], final_step=1)
    with open(tmp_path / "keys" / "trainer.rank0.jsonl", "a") as fh:
        fh.write('{"event": "trained", "rank": 0, "step": 2, "ke')
    assert lineage.check_lineage(tmp_path, ["a"]).ok


def test_a_runs_seed_decides_its_victim_and_moment():
    seeds = campaign.run_seeds(7, 40)
    assert seeds == campaign.run_seeds(7, 40) and len(set(seeds)) == 40
    plans = [campaign.plan_run(i, s) for i, s in enumerate(seeds)]
    assert plans == [campaign.plan_run(i, s) for i, s in enumerate(seeds)]
    assert {p.victim for p in plans} == set(campaign.VICTIMS)
    for p in plans:
        assert 0 <= p.delay_s <= 1
        if p.victim == "collator":
            assert p.unit == "sample" and 0 <= p.at <= campaign.TEXTS - 16 and p.delay_s <= 0.25
        else:
            steps = campaign.ON_POLICY_STEPS if p.victim == "rollout0" else campaign.TINY_STEPS
            assert p.unit == "step" and 0 <= p.at < steps
    only = [campaign.plan_run(i, s, ("queue",)) for i, s in enumerate(seeds)]
    assert {p.victim for p in only} == {"queue"}


def test_the_report_names_the_command_and_each_run_that_was_not_ok(tmp_path):
    from benchmarks.faults.report import write_report

    info = {"commit": "abc1234", "tree": "clean", "machine": "cpu", "date": "2026-01-01",
            "jobs": 1, "command": "python benchmarks/faults/campaign.py --runs 2 --seed 3"}  # fmt: skip
    ok = {"run": 0, "seed": 11, "victim": "queue", "moment": "step 2 +0.10s", "landed": True,
          "at_step": 2, "checkpoint": 2, "outcome": "ok", "exit": 0, "missing": 0, "twice": 0,
          "rolled_back": 0, "wall_s": 80.0, **info}  # fmt: skip
    lost = {**ok, "run": 1, "seed": 12, "victim": "trainer1", "moment": "step 1 +0.50s",
            "at_step": 1, "checkpoint": None, "outcome": "8 missing", "missing": 8}  # fmt: skip
    path = tmp_path / "fault_campaign.md"
    write_report(path, [ok, lost])
    text = path.read_text()
    assert text.startswith(
        "# Random-fault campaign\n\n**2 runs, 2 kills landed: 1 ok; texts lost in 1 runs"
    )
    assert info["command"] in text and "`abc1234`" in text
    assert "trainer1 (step 1 +0.50s, before the first checkpoint: 8 missing)" in text
    assert "| 1 | 12 | trainer1 | step 1 +0.50s | step 1, ckpt - | 8 missing | 8 | 0 |" in text
