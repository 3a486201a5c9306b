"""The scaled healing experiment (benchmarks/quality/scale*.py): arm specs, the grid's extension
until the best learning rate is interior, the held-out splits read only by the final scoring,
the lanes, the report's bars on rows made up here, refusals of bad settings, and (slow) the CPU
smoke end to end through real ``xtoken run`` processes."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import scale, scale_arms, scale_grid, scale_report  # noqa: E402
from benchmarks.quality.scale_grid import GridSpec, RunKey  # noqa: E402
from benchmarks.quality.scale_lanes import (  # noqa: E402
    TIMED_OUT,
    Job,
    Lanes,
    ran_out_of_gpu_memory,
)

ROWS = scale.ROWS_FILE

Q, G = "qwen2.5-coder-0.5b", "gemma3-270m"

# --------------------------------------------------------------------------- arm specs


def test_arm_specs_name_teachers_variants_and_family():
    two = scale_arms.parse_scale_arm(f"pkl@{Q}+{G}")
    assert two.teachers == (Q, G) and two.family == f"pkl@{Q}+{G}"
    top = scale_arms.parse_scale_arm(f"gold@{Q}:topk=32,kl_weight=0.5")
    assert (top.topk, top.family, top.pinned) == (32, f"gold@{Q}", {"kl_weight": 0.5})
    assert scale_arms.parse_scale_arm(f"pkl@{Q}:cache").cache == scale_arms.DEFAULT_CACHE_K
    on = scale_arms.parse_scale_arm(f"pkl@{Q}:on_policy=0.25,start=0.4")
    assert (on.on_policy, on.start, on.family) == (0.25, 0.4, f"pkl@{Q}")
    ce = scale_arms.parse_scale_arm("ce:lr=0.001")
    assert ce.is_ce and ce.family == "ce" and ce.pinned == {"lr": 0.001}
    assert [scale_arms.parse_scale_arm(a).spec for a in scale_arms.SCALE_ARMS] == list(
        scale_arms.SCALE_ARMS
    )


def test_twins_are_the_online_top_k_of_a_cache_and_the_plain_arm_of_a_variant():
    specs = list(scale_arms.SCALE_ARMS)
    twin = lambda s: scale_arms.twin_of(scale_arms.parse_scale_arm(s), specs)  # noqa: E731
    assert twin(f"pkl@{Q}:cache=64") == f"pkl@{Q}:topk=64"
    assert twin(f"pkl@{Q}:topk=32") == f"pkl@{Q}"
    assert twin(f"pkl@{Q}:on_policy=0.5") == f"pkl@{Q}"
    assert twin(f"pkl@{Q}") is None and twin("ce") is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("kd@smollm2", "not one of"),
        ("pkl@llama9", "not one of"),
        (f"pkl@{Q}+smollm2+{Q}", "share a tokenizer"),
        (f"pkl@{Q}:topk=0", "whole number >= 1"),
        (f"pkl@{Q}:topk=32,cache", "not both"),
        (f"pkl@{Q}:start=0.5", "on_policy arm"),
        (f"pkl@{Q}:on_policy=1", "no off-policy start"),
        (f"pkl@{Q}:on_policy=0.5,cache", "one teacher off-policy"),
        (f"pkl@{Q}+{G}:on_policy=0.5", "one teacher"),
        ("ce:topk=4", "no teacher"),
        (f"pkl@{Q}+", "empty teacher"),
    ],
)
def test_a_bad_arm_spec_is_refused_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        scale_arms.parse_scale_arm(bad)


def test_the_token_budget_becomes_steps_and_a_budget_below_one_step_is_refused():
    assert scale_arms.steps_for(20_000_000, 16, 400.0) == 3125
    assert scale_arms.steps_for(6400, 16, 400.0) == 1
    with pytest.raises(ValueError, match="below one step.*--tokens 6400"):
        scale_arms.steps_for(6399, 16, 400.0)


# --------------------------------------------------------------------------- the grid


def test_the_learning_rate_grid_extends_until_the_best_is_interior():
    spec = GridSpec(lrs=(1e-3, 2e-3), max_extend=2)
    choice = scale_grid.choose_lr({}, spec)
    assert choice.pending == [1e-3, 2e-3] and choice.chosen is None
    # best at the top: one step up
    assert scale_grid.choose_lr({1e-3: 3.0, 2e-3: 2.9}, spec).pending == [4e-3]
    # the step up is worse: 2e-3 is interior
    done = scale_grid.choose_lr({1e-3: 3.0, 2e-3: 2.9, 4e-3: 2.95}, spec)
    assert (done.pending, done.chosen, done.interior) == ([], 2e-3, True)
    # best at the bottom twice: two steps down, then no more (max_extend), not interior
    r = {1e-3: 2.0, 2e-3: 2.9, 5e-4: 1.9, 2.5e-4: 1.8}
    edge = scale_grid.choose_lr(r, spec)
    assert (edge.pending, edge.chosen, edge.interior) == ([], 2.5e-4, False)
    # a failed run is never chosen, and counts as worse (a rate that diverged brackets the best)
    assert scale_grid.choose_lr({1e-3: 2.0, 2e-3: None}, spec).pending == [5e-4]
    failed_below = scale_grid.choose_lr({1e-3: None, 2e-3: 2.9, 4e-3: 3.0}, spec)
    assert (failed_below.chosen, failed_below.interior) == (2e-3, True)


def _fill(plan, results, score):
    for key in plan.pending:
        results[key] = score(key)


def test_kd_families_choose_kl_and_temperature_first_then_every_arm_its_rate_then_finals():
    arms = [scale_arms.parse_scale_arm(s) for s in ("ce", f"pkl@{Q}", f"pkl@{Q}:topk=32")]
    spec = GridSpec(lrs=(5e-4, 1e-3, 2e-3), kl_weights=(0.5, 1.0), temperatures=(1.0,))
    results: dict = {}
    first = scale_grid.plan(arms, results, spec, rerun_arm="ce")
    assert all(k.phase == "grid" for k in first.pending)
    kd = [k for k in first.pending if k.arm != "ce"]
    assert {(k.arm, k.lr, k.kl_weight) for k in kd} == {
        (f"pkl@{Q}", 1e-3, 0.5),
        (f"pkl@{Q}", 1e-3, 1.0),
    }
    assert {k.lr for k in first.pending if k.arm == "ce"} == {5e-4, 1e-3, 2e-3}

    # a made-up landscape: best lr 1e-3 for every arm, KL weight 0.5 better
    def score(k: RunKey) -> float:
        return 1.0 + abs(k.lr - 1e-3) * 100 + (0.1 if k.kl_weight == 1.0 else 0.0)

    for _ in range(6):
        p = scale_grid.plan(arms, results, spec, rerun_arm="ce")
        assert not p.stalled
        _fill(p, results, score)
    p = scale_grid.plan(arms, results, spec, rerun_arm="ce")
    assert p.pending == [] and p.interior == {a.spec: True for a in arms}
    assert p.chosen[f"pkl@{Q}:topk=32"] == scale_arms.Setting(1e-3, 0.5, 1.0)
    finals = {(k.arm, k.seed) for k, _ in results.items() if k.phase == "final"}
    assert finals == {(a.spec, s) for a in arms for s in spec.seeds}
    assert [k for k in results if k.phase == "rerun"] == [
        RunKey("rerun", "ce", 0, 1e-3, None, None)
    ]
    # the variant's rate was searched at its family's chosen KL weight, the family's mid-rate
    # run at that weight served both grids
    assert all(k.kl_weight == 0.5 for k in results if k.arm.endswith("topk=32"))


def test_a_final_run_waits_for_its_arm_choice_and_a_failed_grid_step_stalls_the_arm():
    arms = [scale_arms.parse_scale_arm("ce")]
    spec = GridSpec(lrs=(1e-3, 2e-3), max_extend=0, seeds=(0, 1))
    results = {RunKey("grid", "ce", 0, 1e-3, None, None): 2.0}
    assert [k.phase for k in scale_grid.plan(arms, results, spec).pending] == ["grid"]
    results[RunKey("grid", "ce", 0, 2e-3, None, None)] = None
    p = scale_grid.plan(arms, results, spec)
    assert [(k.phase, k.seed) for k in p.pending] == [("final", 0), ("final", 1)]
    assert p.interior == {"ce": False}
    results[RunKey("grid", "ce", 0, 1e-3, None, None)] = None
    assert scale_grid.plan(arms, results, spec).stalled == ["ce"]


# --------------------------------------------------------------------------- held-out read once


def test_only_the_final_scoring_names_the_held_out_and_fresh_splits():
    names = re.compile(r"heldout\.jsonl|fresh\.jsonl")
    readers = [
        p.name
        for p in sorted((ROOT / "benchmarks" / "quality").glob("scale*.py"))
        if names.search(p.read_text())
    ]
    assert readers == ["scale_final.py"]
    src = (ROOT / "benchmarks" / "quality" / "scale_score.py").read_text()
    gate = src.index('if spec["phase"] != "grid":')
    assert gate < src.index("from benchmarks.quality import scale_final")  # imported past it


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        device="cuda", work=tmp_path, corpus=tmp_path / "split", student_tokenizer="smollm2",
        ctx=512, batch=16, limit=None, steps=2000, epochs=4, eval_every=100, eval_texts=64,
        tokens=20_000_000, grid_steps=2000, grid_tokens=20_000_000,
        lr=None, warmup=100, temperature=1.0, kl_weight=1.0, aliases={}, rollouts=None,
        rollout_batch=None, kv_cache=None, max_staleness=None, phase="all",
    )  # fmt: skip


def test_no_run_config_of_any_arm_points_at_the_held_out_or_fresh_split(tmp_path):
    from services.supervise.config import run_config_from_dict

    args = _args(tmp_path)
    projections = {t: tmp_path / f"{t}.pt" for t in ("smollm2", "qwen3", "gemma3")}
    caches = {(Q, 64): tmp_path / "cache"}
    for spec in scale_arms.SCALE_ARMS:
        arm = scale_arms.parse_scale_arm(spec)
        if arm.peer:
            continue  # TRL's worker: its texts are checked by the test of its job
        setting = scale_arms.Setting(1e-3, None if arm.is_ce else 0.5, None if arm.is_ce else 1.0)
        cfgs = scale_arms.run_configs(
            arm, 1, setting, args, tmp_path / "student", projections, tmp_path / "run", caches
        )
        if arm.cache:
            cfgs.append(scale_arms.cache_build_config(arm, args, tmp_path / "student", projections))
        text = json.dumps(cfgs)
        assert "heldout.jsonl" not in text and "fresh.jsonl" not in text
        assert cfgs[-1 - bool(arm.cache)]["trainer"]["optim"]["lr"] == 1e-3
        for cfg in cfgs:
            run_config_from_dict(cfg)  # the run accepts it as it is
        # every off-policy stage is deterministic on an ordered feed; an on-policy one cannot be
        for cfg in cfgs[: len(cfgs) - bool(arm.cache)]:
            det = cfg["trainer"]["compute"]["deterministic"]
            assert det == (cfg["data"].get("on_policy_fraction", 0) == 0) == cfg["data"]["ordered"]


def test_arm_variants_set_their_transport_cache_second_teacher_and_off_policy_start(tmp_path):
    args = _args(tmp_path)
    projections = {t: tmp_path / f"{t}.pt" for t in ("smollm2", "qwen3", "gemma3")}
    caches = {(Q, 64): tmp_path / "cache"}

    def cfgs(spec):
        arm = scale_arms.parse_scale_arm(spec)
        s = scale_arms.Setting(1e-3, 0.5, 2.0)
        return scale_arms.run_configs(
            arm, 0, s, args, tmp_path, projections, tmp_path / "r", caches
        )

    (top,) = cfgs(f"pkl@{Q}:topk=32")
    assert top["teacher"]["transport"] == "topk" and top["teacher"]["top_k"] == 32
    assert top["trainer"]["loss"]["kl_weight"] == 0.5 and top["trainer"]["loss"]["temperature"] == 2
    (cached,) = cfgs(f"pkl@{Q}:cache")
    assert cached["data"]["teacher_cache"] == str(tmp_path / "cache")
    # P-KL over every column in every P-KL arm: the top-K arms differ from their twin in targets
    (plain,) = cfgs(f"pkl@{Q}")
    assert [c["trainer"]["loss"]["vocab_topk"] for c in (top, cached, plain)] == [None] * 3
    (gold,) = cfgs(f"gold@{Q}:topk=32")
    assert "vocab_topk" not in gold["trainer"]["loss"]
    (two,) = cfgs(f"pkl@{Q}+{G}")
    assert two["teacher"]["weight"] == 0.5 and two["extra_teachers"][0]["tokenizer"] == "gemma3"
    assert two["extra_teachers"][0]["projection"] == str(tmp_path / "gemma3.pt")
    # the off-policy start is the run's first quarter: one optimizer, one schedule
    (on,) = cfgs(f"pkl@{Q}:on_policy=0.25,start=0.25")
    assert on["trainer"]["schedule"]["max_steps"] == 2000
    assert on["trainer"]["on_policy"]["start_step"] == 500
    assert on["trainer"]["student"]["model"] == str(tmp_path)
    assert on["data"]["on_policy_fraction"] == 0.25


def test_the_grid_scoring_reads_the_validation_split_alone(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.quality import scale_score
    from xtoken_core.tokenizers import load_tokenizer

    corpus = tmp_path / "split"
    corpus.mkdir()
    text = "def f(x):\n    return x + 1\n" * 4
    (corpus / "val.jsonl").write_text(json.dumps({"text": text, "source": "a.py"}) + "\n")
    vocab = load_tokenizer("smollm2").vocab_size
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2)
    )  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    spec = {
        "phase": "grid",
        "model": str(tmp_path / "model"),
        "student_tokenizer": "smollm2",
        "corpus": str(corpus),
        "ctx": 32,
        "device": "cpu",
    }
    out = scale_score.score_run(spec)  # no heldout.jsonl nor fresh.jsonl exists
    assert set(out) == {"validation", "weights_sha256"} and out["validation"]["bits_per_byte"] > 0
    assert out["weights_sha256"] == scale_score.weights_sha256(tmp_path / "model")


# --------------------------------------------------------------------------- lanes


def test_lanes_run_one_job_per_lane_in_order_stop_at_a_failure_and_at_the_timeout(tmp_path):
    py = sys.executable
    mark = tmp_path / "marks"
    mark.mkdir()
    jobs = [
        Job("ok", [[py, "-c", f"open('{mark}/a','w')"], [py, "-c", f"open('{mark}/b','w')"]], tmp_path / "l1"),
        Job("fails", [[py, "-c", "raise SystemExit(3)"], [py, "-c", f"open('{mark}/c','w')"]], tmp_path / "l2"),
        Job("slow", [[py, "-c", "import time; time.sleep(30)"]], tmp_path / "l3"),
    ]  # fmt: skip
    done, asked = {}, []

    def next_jobs(n):
        asked.append(n)
        ready = [j for j in jobs if j.key not in done][:n]
        return ready

    Lanes([None, None], timeout_s=2.5, cwd=tmp_path).run(
        next_jobs, lambda job, code, wall, lane: done.setdefault(job.key, (code, wall)), 0.1
    )
    assert done["ok"][0] == 0 and done["fails"][0] == 3 and done["slow"][0] == TIMED_OUT
    assert done["slow"][1] < 25
    # each command that ended has its wall seconds; the stopped one too
    assert [len(j.command_s) for j in jobs] == [2, 1, 1]
    assert 2.0 < jobs[2].command_s[0] < 25
    assert sorted(p.name for p in mark.iterdir()) == ["a", "b"]  # c never ran
    assert max(asked) <= 2  # never more than the free lanes


def _timed_job(key, tmp_path, sleep_s, exclusive=False, slots=1):
    """A job that writes its start and end times to ``<key>.times``."""
    out = tmp_path / f"{key}.times"
    code = (
        f"import time; f = open({str(out)!r}, 'w'); f.write(repr(time.time()) + ' '); "
        f"time.sleep({sleep_s}); f.write(repr(time.time()))"
    )
    return Job(
        key, [[sys.executable, "-c", code]], tmp_path / f"{key}.log", exclusive=exclusive,
        slots=slots,
    )  # fmt: skip


def _each_once(jobs):
    """``next_jobs`` of Lanes that gives each job once, in order."""
    given = []

    def next_jobs(n):
        ready = [j for j in jobs if j.key not in given][:n]
        given.extend(j.key for j in ready)
        return ready

    return next_jobs


def _times(tmp_path, key):
    start, end = (tmp_path / f"{key}.times").read_text().split()
    return float(start), float(end)


def test_an_exclusive_job_waits_for_its_gpu_to_empty_and_nothing_starts_beside_it(tmp_path):
    jobs = [
        _timed_job("a", tmp_path, 1.0),
        _timed_job("alone", tmp_path, 1.0, exclusive=True),
        _timed_job("b", tmp_path, 0.2),
        _timed_job("other_gpu", tmp_path, 0.2),
    ]
    next_jobs, done = _each_once(jobs), []

    # two lanes share GPU 0, one lane is GPU 1
    Lanes(["0", "0", "1"], 60.0, tmp_path).run(
        next_jobs, lambda job, code, wall, lane: done.append((job.key, code, lane)), 0.05
    )
    # the exclusive job took the empty GPU; the others shared GPU 0, none beside it
    assert sorted(done) == [("a", 0, "0"), ("alone", 0, "1"), ("b", 0, "0"), ("other_gpu", 0, "0")]


def test_an_exclusive_job_on_a_shared_gpu_starts_once_the_runs_there_end(tmp_path):
    jobs = [
        _timed_job("a", tmp_path, 1.0),
        _timed_job("alone", tmp_path, 0.5, exclusive=True),
        _timed_job("b", tmp_path, 0.2),
    ]
    next_jobs, done = _each_once(jobs), []

    Lanes(["0", "0"], 60.0, tmp_path).run(
        next_jobs, lambda job, code, wall, lane: done.append(job.key), 0.05
    )
    assert sorted(done) == ["a", "alone", "b"]
    a, alone, b = (_times(tmp_path, k) for k in ("a", "alone", "b"))
    assert alone[0] >= a[1]  # it waited for a to end
    assert b[0] >= alone[1]  # and b, given after it, waited for it


def test_a_job_of_two_slots_waits_for_two_and_holds_its_gpu_until_they_are_free(tmp_path):
    jobs = [
        _timed_job("a", tmp_path, 0.5),
        _timed_job("b", tmp_path, 1.5),
        _timed_job("big", tmp_path, 0.6, slots=2),
        _timed_job("c", tmp_path, 0.2),
    ]
    next_jobs, done = _each_once(jobs), []

    Lanes(["0", "0", "0"], 60.0, tmp_path).run(
        next_jobs, lambda job, code, wall, lane: done.append((job.key, code)), 0.05
    )
    assert sorted(done) == [("a", 0), ("b", 0), ("big", 0), ("c", 0)]
    a, b, big, c = (_times(tmp_path, k) for k in ("a", "b", "big", "c"))
    assert a[1] <= big[0] < b[1]  # two of three slots free once a ended, b still running
    assert c[0] >= min(big[1], b[1])  # c, given after it, took no slot it waited for
    # never more than three slots' worth at once: b, big (2) or b, c, or big, c
    for t in (big[0] + 0.01, c[0] + 0.01):
        running = [k for k, (s0, s1) in zip("a b big c".split(), (a, b, big, c)) if s0 <= t < s1]
        assert sum(2 if k == "big" else 1 for k in running) <= 3, running


def test_staggered_lanes_start_one_job_per_gpu_per_stagger_and_each_gpu_on_its_own(tmp_path):
    jobs = [_timed_job(f"j{i}", tmp_path, 1.0) for i in range(5)]
    next_jobs, done = _each_once(jobs), []

    Lanes(["0", "0", "0", "1", "1"], 60.0, tmp_path, stagger_s=0.5).run(
        next_jobs, lambda job, code, wall, lane: done.append((job.key, lane)), 0.05
    )
    assert len(done) == 5
    starts: dict[str, list[float]] = {}
    for key, lane in done:
        starts.setdefault(lane, []).append(_times(tmp_path, key)[0])
    assert sorted(len(v) for v in starts.values()) == [2, 3]
    for lane, ts in starts.items():  # one start a stagger on each GPU
        ts.sort()
        assert all(b - a >= 0.45 for a, b in zip(ts, ts[1:])), (lane, ts)
    first = sorted(min(ts) for ts in starts.values())
    assert first[1] - first[0] < 0.4  # the GPUs do not wait for each other
    with pytest.raises(ValueError, match="--stagger-s -1: must be >= 0 seconds"):
        Lanes(["0"], 60.0, tmp_path, stagger_s=-1)


def test_a_job_that_ran_out_of_gpu_memory_is_given_again_when_on_done_asks(tmp_path):
    flag = tmp_path / "failed_once"
    code = (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(flag)!r})\n"
        "if not p.exists():\n"
        "    p.write_text('x')\n"
        # (in pieces: the log's first line is the command itself)
        "    print('torch.OutOfMemory' + 'Error: CUDA out of' + ' memory. Tried to allocate')\n"
        "    sys.exit(1)\n"
        "print('trained')\n"
    )
    job = Job("run", [[sys.executable, "-c", code]], tmp_path / "run.log")
    ends = []

    def next_jobs(n):
        return [] if ends and ends[-1][1] == 0 else [job]

    def on_done(j, code, wall, lane):
        oom = ran_out_of_gpu_memory(j)
        ends.append((j.exclusive, code, oom))
        if code and oom and not j.exclusive:
            j.exclusive, j.command_s = True, []
            return True
        return False

    Lanes(["0", "0"], 60.0, tmp_path).run(next_jobs, on_done, 0.05)
    # the second run reads only its own part of the log: no out-of-memory line there
    assert ends == [(False, 1, True), (True, 0, False)]
    assert "trained" in (tmp_path / "run.log").read_text()


def test_a_run_out_of_gpu_memory_beside_others_is_run_again_alone_without_a_row(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.args.gpus, exp.args.runs_per_gpu = [0], 3
    exp.in_flight, exp.busy, exp.results, exp.out = set(), {}, {}, tmp_path
    exp.rows_path = tmp_path / "rows.jsonl"
    key = RunKey("grid", f"pkl@{Q}", 0, 5e-4, 0.5, 1.0)
    exp.row = lambda *a: {"phase": "grid", "arm": key.arm, "seed": 0, "lr": 5e-4, "exit": 1,
                          "validation_bpb": None, "heldout_bpb": None, "fresh_bpb": None}  # fmt: skip
    log = tmp_path / "run.log"
    log.write_text("an earlier call: torch.OutOfMemoryError\n")
    job = Job(key, [["true"]], log, log_start=log.stat().st_size)
    with open(log, "a") as f:
        f.write("xtoken run: trainer0 exited with code 1\n")
    assert exp.on_done(job, 1, 10.0, "0") is False  # failed otherwise: its row
    assert len(exp.rows_path.read_text().splitlines()) == 1
    with open(log, "a") as f:
        f.write("services.trainer.startup.StartupOutOfMemory: a student step does not fit\n")
    assert exp.on_done(job, 1, 10.0, "0") is True  # out of memory beside others: again
    assert key in exp.alone and len(exp.rows_path.read_text().splitlines()) == 1
    job.exclusive = True  # alone it fails again: now a row says so
    assert exp.on_done(job, 1, 10.0, "0") is False
    assert len(exp.rows_path.read_text().splitlines()) == 2
    exp.args.runs_per_gpu, job.exclusive = 1, False  # it had its GPU to itself: no retry
    assert exp.on_done(job, 1, 10.0, "0") is False
    exp.args.runs_per_gpu, job.slots = 3, 3  # its slots were all of its GPU's: no retry
    assert exp.on_done(job, 1, 10.0, "0") is False
    job.slots = 2  # two of three: it had company, so it runs again alone
    assert exp.on_done(job, 1, 10.0, "0") is True


def test_a_sigterm_to_the_lanes_process_stops_its_running_jobs_too(tmp_path):
    pidfile, log = tmp_path / "job.pid", tmp_path / "job.log"
    job = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = (
        "import signal, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "from benchmarks.quality.scale import _exit_on_sigterm\n"
        "from benchmarks.quality.scale_lanes import Job, Lanes\n"
        "signal.signal(signal.SIGTERM, _exit_on_sigterm)\n"
        f"job = Job('slow', [[sys.executable, '-c', {job!r}]], Path({str(log)!r}))\n"
        f"Lanes([None], 300.0, Path({str(tmp_path)!r})).run(lambda n: [job], print, 0.1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    with pytest.raises(ProcessLookupError):  # stopped and reaped with its lanes
        os.kill(int(pidfile.read_text()), 0)


# --------------------------------------------------------------------------- report bars


def _row(arm, seed, held, fresh, teachers=(), family=None, **extra):
    return {
        "mode": "scale", "phase": "final", "arm": arm, "seed": seed, "teachers": list(teachers),
        "family": family or arm, "student_tokenizer": "smollm2", "lr": 1e-3, "kl_weight": 0.5,
        "temperature": 1.0, "tokens": 1000, "deterministic": True, "device": "cpu",
        "commit": "abc", "validation_bpb": held, "heldout_bpb": held, "fresh_bpb": fresh,
        "next_line_em": 0.1, "completion_teacher_bpb": extra.pop("rated", None),
        "val_curve": extra.pop("curve", []), "twin": None, "on_policy": 0.0, **extra,
    }  # fmt: skip


def _rows():
    rows = []
    noise = (0.001, -0.001, 0.0)
    for s, e in enumerate(noise):
        curve = [{"step": 100, "bits_per_byte": 1.5}, {"step": 300, "bits_per_byte": 1.0 + e},
                 {"step": 400, "bits_per_byte": 1.0 + e}]  # fmt: skip
        rows += [
            _row("ce", s, 1.00 + e, 1.50 + e, curve=curve, rated=2.0 + e),
            _row("pkl@smollm2", s, 0.90 + e, 1.40 + e, ["smollm2"]),
            _row(f"pkl@{Q}", s, 0.94 + e, 1.44 + e, [Q], rated=1.9 + e),
            _row(f"pkl@{G}", s, 0.96 + e, 1.46 + e, [G]),
            _row(f"pkl@{Q}+{G}", s, 0.93 + e, 1.43 + e, [Q, G]),
            _row(f"pkl@{Q}:topk=64", s, 0.941 + e, 1.441 + e, [Q], f"pkl@{Q}", twin=f"pkl@{Q}"),
            _row(
                f"pkl@{Q}:cache=64", s, 0.99 + e, 1.49 + e, [Q], f"pkl@{Q}", twin=f"pkl@{Q}:topk=64"
            ),  # fmt: skip
            _row(
                f"pkl@{Q}:on_policy=0.5",
                s,
                0.945 + e,
                1.445 + e,
                [Q],
                f"pkl@{Q}",
                twin=f"pkl@{Q}",
                on_policy=0.5,
                rated=1.7 + e,
            ),  # fmt: skip
        ]
    rows.append({**rows[0], "phase": "rerun", "exit": 0, "bitwise_equal": True})
    return rows


def test_the_report_checks_each_bar_on_made_up_rows():
    rows = _rows()
    summary = scale_report.summarize(rows)
    assert summary["ce"] == "ce" and summary["parent"] == "pkl@smollm2"
    met = {name: ok for name, _, ok in scale_report.bars(summary, rows)}
    assert met[f"pkl@{Q} beats tuned CE by > 3 CE seed sd on both splits"] is True
    # 0.04 of the parent's 0.10: 60% on both splits for the best arm (the two-teacher one: 70%)
    assert met["best cross-tokenizer arm closes >= 50% of the parent's gain on each split"] is True
    assert met[f"pkl@{Q}+{G} at least as good as the better single teacher"] is True
    assert met[f"pkl@{Q}:cache=64 within 2 seed sd of pkl@{Q}:topk=64"] is False  # 0.049 off
    on = next(k for k in met if k.startswith(f"pkl@{Q}:on_policy=0.5 rates better"))
    assert met[on] is True
    assert met["a rerun of one arm's config gives a bitwise-equal row"] is True
    assert met["CE converged: validation fell < 3 CE seed sd over its last quarter"] is True
    diff = summary["arms"][f"pkl@{Q}"]["diff"]["heldout"]
    assert diff["mean"] == pytest.approx(-0.06) and diff["n"] == 3
    # CE still falling fast over its last quarter: not converged
    for r in rows:
        if r["arm"] == "ce":
            r["val_curve"] = [{"step": s, "bits_per_byte": 2 - s / 400} for s in (100, 300, 400)]
    met = {name: ok for name, _, ok in scale_report.bars(scale_report.summarize(rows), rows)}
    assert met["CE converged: validation fell < 3 CE seed sd over its last quarter"] is False


def test_the_report_opens_with_the_table_and_says_when_it_has_no_plot(tmp_path):
    import importlib.util

    rows = _rows()
    for r in rows[:2]:
        r.update(resumed=True, wall_s=300.0, train_s=100.0)
    md = scale_report.write_report(rows, tmp_path)
    assert md.startswith("# ") and md.splitlines()[6].startswith("| arm | seeds | lr |")
    assert md.splitlines()[2].startswith(
        f"**Current figures: the best cross-tokenizer arm, pkl@{Q}+{G}, minus the tuned CE: "
        "held-out -0.0700 ["
    )
    assert f"| pkl@{Q} | 3 | 0.001 |" in md and "## Bars" in md
    finals = sum(1 for r in rows if r["phase"] == "final")
    assert f"| final | {finals} | 2 | 300 | 100 |" in md  # the runs' time and resumes
    assert (tmp_path / "quality_scale.md").read_text() == md
    if importlib.util.find_spec("matplotlib") is None:
        assert "No plot: matplotlib is not installed" in md
    else:
        assert (tmp_path / "quality_scale.png").stat().st_size > 1000


def test_a_report_of_grid_rows_alone_says_so_and_splits_a_runs_time():
    rows = []
    for arm, lr, bpb in (("ce", 1e-3, 0.73), ("ce", 5e-4, 0.75), (f"pkl@{Q}", 5e-4, 0.72)):
        rows.append(
            _row(arm, 0, None, None, [Q] if arm != "ce" else [], phase="grid", validation_bpb=bpb, lr=lr, tokens_budget=2000,
                 steps_budget=10, batch=16, ctx=512, command="python scale.py --gpus 0",
                 command_s=[200.0, 20.0], compile_s=80.0, train_s=50.0, wall_s=220.0,
                 curve=[{"step": 0, "bits_per_byte": 3.0}, {"step": 10, "bits_per_byte": bpb}])
        )  # fmt: skip
    rows.append({**rows[0], "command_s": [21.0]})  # scored again by a later call: not timed
    md = scale_report.markdown(rows)
    assert md.startswith("# Healing a pruned SmolLM2 at scale: every arm tuned alike, the grid")
    assert "Command: `python scale.py --gpus 0`." in md
    assert md.splitlines()[2] == (
        "**Current figures (the grid so far, seed 0, validation bits/byte, best of each): "
        f"CE 0.7300 (ce, lr 0.001); KD 0.7200 (pkl@{Q}, lr 0.0005).**"
    )
    assert "No final run is scored yet (3 grid settings scored so far)" in md
    assert "| grid | 4 | 0 | 220 | 50 | 200 | 80 | 20 | - / - |" in md
    rows[1]["peak_memory_mib"] = {"trainer": 2048.0, "teacher": None}
    rows[2]["peak_memory_mib"] = {"trainer": 1024.0, "teacher": 6144.0}
    assert "| 200 | 80 | 20 | 2.0 / 6.0 |" in scale_report.markdown(rows)
    assert "| ce | 1 | 2.0 | - | - | - |" in scale_report.markdown(rows)  # memory per arm
    rows[2]["peak_reserved_mib"] = {"trainer": 3072.0, "teacher": 7168.0}
    assert f"| pkl@{Q} | 1 | 1.0 | 3.0 | 6.0 | 7.0 |" in scale_report.markdown(rows)
    failed = {**rows[0], "exit": 1, "validation_bpb": None, "wall_s": 9.0, "command_s": [9.0]}
    assert "| grid | 5 (1 failed) | 0 | 220 | 50 |" in scale_report.markdown(rows + [failed])
    best = scale_report.plotted_curves(rows)
    assert sorted(best) == ["ce", f"pkl@{Q}"] and best["ce"][0]["lr"] == 1e-3
    assert "Start-up steps" not in md  # no row says where its start-up went
    caches = {"fx_graph": {"hit": 0, "miss": 2, "bypass": 0},
              "aot_autograd": {"hit": 1, "miss": 1, "bypass": 1}}  # fmt: skip
    rows[0]["start_up"] = [{"calls": [[512, 60.0], [512, 4.0], [256, 6.0]], "caches": caches}]
    rows[1]["start_up"] = [{"calls": [[512, 70.0], [512, 2.0]], "caches": caches}, None]
    assert (
        "Start-up steps of the grid runs (2 that say): the first call (the compile) 65 s, the "
        "other calls (other lengths' graphs, CUDA graph recordings) 6 s (medians); Inductor's "
        "on-disk caches: 2 hits, 6 misses, 2 bypassed."
    ) in scale_report.markdown(rows)
    rows[0]["start_up"][0]["phases"] = {"_compile.compile_inner": 50.0, "async_compile.wait": 30.0}
    rows[1]["start_up"][0]["phases"] = {"_compile.compile_inner": 40.0}
    assert (
        "2 bypassed; the compiler's largest phases (medians, nested): `_compile.compile_inner` "
        "45.0 s, `async_compile.wait` 15.0 s."
    ) in scale_report.markdown(rows)


def test_the_grid_table_shows_a_setting_once_and_the_report_says_whether_repeats_were_equal():
    base = {"phase": "grid", "arm": "ce", "seed": 0, "lr": 1e-3, "kl_weight": None,
            "temperature": None, "deterministic": True}  # fmt: skip
    rows = [
        {**base, "exit": 1, "validation_bpb": None, "weights_sha256": None},  # out of memory
        {**base, "exit": 0, "validation_bpb": 0.73, "weights_sha256": "aa"},
        {**base, "exit": 0, "validation_bpb": 0.73, "weights_sha256": "aa"},  # trained again
        {**base, "lr": 5e-4, "exit": 0, "validation_bpb": 0.75, "weights_sha256": "bb"},
        {**base, "lr": 5e-4, "exit": 0, "validation_bpb": 0.75, "weights_sha256": "cc"},
        {**base, "lr": 2e-3, "exit": 1, "validation_bpb": None, "weights_sha256": None},
    ]
    firsts = scale_report.first_rows(rows)
    assert [(r["lr"], r["exit"]) for r in firsts] == [(1e-3, 0), (5e-4, 0), (2e-3, 1)]
    assert firsts[0] is rows[1]  # the first scored row, not the failure before it
    assert scale_report.repeats(rows)[-1] == (
        "Trained more than once: 2 settings (ce), 4 trainings; bitwise-equal weights and "
        "validation figure for 1 of 2."
    )
    assert scale_report.repeats(rows[:2] + rows[3:4]) == []


# --------------------------------------------------------------------------- bad settings


def _refused(capsys, argv) -> str:
    assert scale.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_unknown_arm_is_refused_in_one_line_with_exit_2(tmp_path, capsys):
    line = _refused(capsys, ["--arms", "ce", "kd@smollm2", "--work", str(tmp_path)])
    assert "kd@smollm2" in line and "not one of" in line
    assert not any(tmp_path.iterdir())


def test_a_teacher_not_installed_is_refused_in_one_line_with_exit_2(tmp_path, capsys):
    line = _refused(
        capsys,
        ["--arms", f"pkl@{G}", "--model-alias", f"{G}=gguf:{tmp_path}/nope.gguf",
         "--work", str(tmp_path / "w")],
    )  # fmt: skip
    assert G in line and "nope.gguf" in line and "--model-alias" in line


def _tiny_split(tmp_path: Path) -> Path:
    """A split folder of one short text per part (no fresh commit)."""
    corpus = tmp_path / "split"
    corpus.mkdir()
    for name in ("train", "val", "heldout", "fresh"):
        rec = {"text": "def f():\n    return 1\n" * 20, "source": "a.py"}
        (corpus / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
    (corpus / "split.json").write_text("{}")
    return corpus


def test_a_budget_below_one_step_is_refused_in_one_line_with_exit_2(tmp_path, capsys):
    corpus = _tiny_split(tmp_path)
    line = _refused(
        capsys,
        ["--arms", "ce", "--tokens", "100", "--corpus", str(corpus), "--work", str(tmp_path / "w")],
    )
    assert "--tokens 100" in line and "below one step" in line


def test_plan_prints_the_runs_a_call_would_start_and_builds_nothing(tmp_path, capsys):
    corpus = _tiny_split(tmp_path)
    argv = ["--plan", "--arms", "ce", "--tokens", "100000", "--corpus", str(corpus),
            "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out")]  # fmt: skip
    assert scale.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("3 runs to start (3 grid")  # CE's rate grid; finals wait for it
    assert [line.split()[5] for line in lines[1:4]] == ["0.00025", "0.0005", "0.001"]
    assert not (tmp_path / "w" / "student").exists()  # no student, projection or teacher built
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- smoke


_FORTY_STEPS = """
import sys
sys.path.insert(0, {root!r})
from benchmarks.quality import heal, scale
smoke = heal._smoke_setup
def forty(args):
    smoke(args)
    args.steps = 40  # long enough to be stopped midway
heal._smoke_setup = forty
sys.exit(scale.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_when_asked_again_bitwise_equal_to_one_go(tmp_path):
    """scale.py SIGTERMed while its run is past a checkpoint, then called again: the run goes
    on from its checkpoint (its rows say resumed) and its weights equal a run trained in one
    go."""
    driver = tmp_path / "forty.py"
    driver.write_text(_FORTY_STEPS.format(root=str(ROOT)))
    args = ["--smoke", "--arms", "ce", "--seeds", "0", "--lrs", "1e-3", "--rerun-arm", "none"]
    args += ["--checkpoint-every", "5"]

    def call(work: Path, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(driver), *args, "--work", str(work)], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw,
        )  # fmt: skip

    def rows(work: Path) -> list[dict]:
        return [json.loads(x) for x in (work / "out" / ROWS).read_text().splitlines()]

    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    first = call(stopped)
    latest = stopped / "runs" / "ce_s0_lr0.001_kl-_t-" / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() >= "step_00000010"):
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM
    assert not (stopped / "out" / ROWS).exists()  # stopped before any row
    for work in (stopped, whole):
        proc = call(work)
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    again, once = rows(stopped), rows(whole)
    assert [(r["phase"], r["resumed"], r["steps"]) for r in again] == [
        ("grid", True, 40), ("final", True, 40)
    ]  # fmt: skip
    assert [r["resumed"] for r in once] == [False, False]
    assert [r["weights_sha256"] for r in again] == [r["weights_sha256"] for r in once]
    assert [r["validation_bpb"] for r in again] == [r["validation_bpb"] for r in once]


@pytest.mark.slow
def test_cpu_smoke_tunes_two_arms_runs_their_seeds_and_reruns_one_bitwise(tmp_path):
    """The grid's runs train one step (``--grid-tokens``), the final runs four, apart."""
    work = tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality" / "scale.py"), "--smoke"]
    cmd += ["--grid-tokens", "2"]
    done = subprocess.run(
        cmd + ["--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (work / "out" / "quality_scale.jsonl").read_text().splitlines()]
    grid = [r for r in rows if r["phase"] == "grid"]
    final = [r for r in rows if r["phase"] == "final"]
    assert sorted((r["arm"], r["lr"]) for r in grid) == [
        ("ce", 5e-4), ("ce", 1e-3), ("pkl@smollm2", 5e-4), ("pkl@smollm2", 1e-3)
    ]  # fmt: skip
    assert all(r["heldout_bpb"] is None and r["fresh_bpb"] is None for r in grid)
    assert {(r["steps"], r["steps_budget"]) for r in grid} == {(1, 1)}
    assert sorted(p.name for p in (work / "runs").iterdir() if p.name.endswith("_grid1")) == [
        "ce_s0_lr0.0005_kl-_t-_grid1",
        "ce_s0_lr0.001_kl-_t-_grid1",
        "pkl@smollm2_s0_lr0.0005_kl0.5_t1_grid1",
        "pkl@smollm2_s0_lr0.001_kl0.5_t1_grid1",
    ]  # the final runs of seed 0 trained in folders of their own
    assert sorted((r["arm"], r["seed"]) for r in final) == [
        ("ce", 0), ("ce", 1), ("pkl@smollm2", 0), ("pkl@smollm2", 1)
    ]  # fmt: skip
    for r in final:
        best = min((g for g in grid if g["arm"] == r["arm"]), key=lambda g: g["validation_bpb"])
        assert r["lr"] == best["lr"] and r["lr_interior"] is False  # two rates, no extension
        assert r["deterministic"] is True and r["steps"] == r["steps_budget"] == 4
        assert r["exit"] == 0
        assert 0 < r["heldout_bpb"] < 20 and 0 < r["fresh_bpb"] < 20
        assert 0 <= r["next_line_em"] <= 1 and r["val_curve"]
        assert r["completion"]["functions"] >= 1
        assert 0 < r["first_step_s"] <= r["train_s"] and "compile_s" in r and "start_up" in r
    seed0 = next(r for r in final if (r["arm"], r["seed"]) == ("ce", 0))
    (rerun,) = [r for r in rows if r["phase"] == "rerun"]
    assert rerun["bitwise_equal"] is True and rerun["weights_sha256"] == seed0["weights_sha256"]
    assert rerun["heldout_bpb"] == seed0["heldout_bpb"]

    again = subprocess.run(
        cmd + ["--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and "9 scored runs before" in again.stderr
    assert len((work / "out" / "quality_scale.jsonl").read_text().splitlines()) == len(rows)
    report = subprocess.run(
        cmd + ["--work", str(work), "--report"], cwd=ROOT, capture_output=True, text=True
    )
    assert report.returncode == 0
    md = (work / "out" / "quality_scale.md").read_text()
    assert "| ce | 2 |" in md and "## Bars" in md and "bitwise-equal row | ce s0: equal | yes" in md


def test_lanes_start_nothing_past_the_deadline_and_gpus_read_either_way(tmp_path):
    job = Job("late", [[sys.executable, "-c", "pass"]], tmp_path / "log")
    done = []
    Lanes([None], 60.0, tmp_path).run(
        lambda n: [job], lambda *a: done.append(a), deadline=time.monotonic() - 1
    )
    assert done == [] and not (tmp_path / "log").exists()
    assert scale.parse_args(["--gpus", "0,1,2,3"]).gpus == [0, 1, 2, 3]
    assert scale.parse_args(["--gpus", "0", "2"]).gpus == [0, 2]


def test_the_smoke_runs_two_seeds_and_two_rates_unless_told_otherwise(tmp_path):
    args = scale.parse_args(["--smoke", "--work", str(tmp_path)])
    args.work, args.aliases = tmp_path, {}
    scale.smoke_setup(args)
    assert (args.seeds, args.lrs, args.arms) == ([0, 1], [5e-4, 1e-3], ["ce", "pkl@smollm2"])
    assert args.device == "cpu" and args.max_extend == 0 and args.rerun_arm == "ce"
    args = scale.parse_args(["--smoke", "--seeds", "3", "--lrs", "0.01"])
    args.work, args.aliases = tmp_path, {}
    scale.smoke_setup(args)
    assert (args.seeds, args.lrs) == ([3], [0.01])


def _gemma_installed() -> bool:
    from xtoken_core.tokenizers.gguf_parts import get_split_gguf, parts_installed

    return parts_installed(get_split_gguf(G))


@pytest.mark.skipif(_gemma_installed(), reason="the gemma3-270m part packages are installed here")
def test_a_preset_teacher_whose_packages_are_missing_is_refused_with_the_pip_command(
    tmp_path, capsys
):
    line = _refused(capsys, ["--arms", "ce", f"pkl@{G}", "--work", str(tmp_path)])
    assert line.startswith(f"scale: teacher {G}") and "pip install" in line


def _bare_experiment(tmp_path: Path) -> scale.Experiment:
    """An experiment with its prepared values set by hand (no models, no split)."""
    exp = object.__new__(scale.Experiment)
    args = _args(tmp_path)
    args.gpus, args.val_limit, args.eval_limit, args.functions = None, None, None, 0
    args.nextline_lines, args.nextline_new_tokens, args.completion_new_tokens = 4, 8, 8
    exp.args, exp.work, exp.scorer, exp.caches = args, tmp_path, None, {}
    exp.alone, args.slots = set(), []
    exp.student_dir = tmp_path / "student"
    exp.projections = {t: tmp_path / f"{t}.pt" for t in ("smollm2", "qwen3", "gemma3")}
    return exp


def test_a_grid_only_call_starts_no_final_run_while_the_grid_has_runs_left(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.arms = [scale_arms.parse_scale_arm(s) for s in ("ce", f"pkl@{Q}")]
    exp.grid = GridSpec(lrs=(5e-4, 1e-3, 2e-3), kl_weights=(0.5,), temperatures=(1.0,),
                        seeds=(0, 1))  # fmt: skip
    exp.rerun, exp.caches_ready, exp.in_flight, exp.busy = None, set(), set(), {}
    exp.args.grid_steps = exp.args.steps
    exp.results = {RunKey("grid", "ce", 0, lr, None, None): v
                   for lr, v in ((5e-4, 0.75), (1e-3, 0.73), (2e-3, 0.76))}  # fmt: skip
    assert {k.phase for k in exp.plan().pending} == {"grid", "final"}  # CE's finals are ready
    exp.args.phase, exp.args.slots = "grid", [("pkl@*", 2)]
    jobs = exp.next_jobs(10)
    assert jobs and {j.key.phase for j in jobs} == {"grid"}
    assert all(j.key.arm == f"pkl@{Q}" and j.slots == 2 for j in jobs)
    exp.args.phase, exp.in_flight, exp.busy = "all", set(), {}
    assert "final" in {j.key.phase for j in exp.next_jobs(10)}


def test_the_plan_lists_the_runs_a_call_would_start_with_their_slots_and_the_choices(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.arms = [scale_arms.parse_scale_arm(s) for s in ("ce", f"pkl@{Q}")]
    exp.grid = GridSpec(lrs=(5e-4, 1e-3, 2e-3), kl_weights=(0.5,), temperatures=(1.0,),
                        seeds=(0, 1))  # fmt: skip
    exp.rerun = None
    exp.results = {RunKey("grid", "ce", 0, lr, None, None): v
                   for lr, v in ((5e-4, 0.75), (1e-3, 0.73), (2e-3, 0.76))}  # fmt: skip
    exp.args.phase, exp.args.slots = "grid", [("pkl@*", 2)]
    exp.rows_path = tmp_path / "rows.jsonl"
    exp.rows_path.write_text(json.dumps({"arm": f"pkl@{Q}", "peak_memory_mib": {
        "trainer": 23859.2, "teacher": 6348.8}, "peak_reserved_mib": {"trainer": 40960.0}}) + "\n")  # fmt: skip
    lines = exp.plan_lines()
    held = "2 final runs wait for a call without --phase grid"
    assert lines[0] == f"1 run to start (1 grid; {held}), in order:"  # the family's KL weight
    assert lines[1].split()[:13] == ["grid", f"pkl@{Q}", "seed", "0", "lr", "0.001", "KL", "w",
                                     "0.5", "T", "1", "slots", "2"]  # fmt: skip
    assert lines[1].endswith(
        "(GiB teacher alloc 6.2, trainer alloc 23.3, trainer reserved 40.0)"
    )  # what the arm's runs took so far: what its slots should cover
    assert lines[-1] == "chosen: ce lr 0.001 (interior)"
    exp.args.phase = "all"
    assert exp.plan_lines()[0] == "3 runs to start (1 grid, 2 final), in order:"
    assert "  final  ce" in "\n".join(exp.plan_lines())
    exp.arms.append(scale_arms.parse_scale_arm(f"pkl@{Q}:topk=64"))
    exp.results[RunKey("grid", f"pkl@{Q}", 0, 1e-3, 0.5, 1.0)] = 0.74  # the family's KL weight
    topk = [line for line in exp.plan_lines() if "topk=64" in line]
    assert topk and all(  # an arm without rows shows its family's
        line.endswith(
            f"(GiB teacher alloc 6.2, trainer alloc 23.3, trainer reserved 40.0 of pkl@{Q})"
        )
        for line in topk
    )


def test_an_on_policy_arm_trains_its_off_policy_start_and_its_on_policy_part_in_one_run(tmp_path):
    exp = _bare_experiment(tmp_path)
    keys = [RunKey("grid", f"pkl@{Q}:on_policy={f}", 0, 1e-3, 0.5, 1.0) for f in (0.25, 0.5)]
    cfgs = [exp.configs(k, scale_arms.parse_scale_arm(k.arm)) for k in keys]
    assert [len(c) for c in cfgs] == [1, 1] and cfgs[0][0]["run_dir"] != cfgs[1][0]["run_dir"]
    first = exp.run_job(keys[0], cfgs[0])
    steps = [c[2] if c[2] == "benchmarks.quality.scale_score" else c[3] for c in first.commands]
    assert steps == ["run", "benchmarks.quality.scale_score"]  # one run, then its score


def test_with_checkpoints_a_run_asked_again_goes_on_from_its_last_one_and_says_so(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.args.checkpoint_every = 50
    key = RunKey("final", f"pkl@{Q}", 0, 1e-3, 0.5, 1.0)
    (cfg,) = exp.configs(key, scale_arms.parse_scale_arm(key.arm))
    schedule = cfg["trainer"]["schedule"]
    assert schedule["checkpoint_every"] == 50 and schedule["final_checkpoint"] is True
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True)
    exp.run_job(key, [cfg])  # asked the first time: starts over
    assert not run_dir.exists()
    (run_dir / "checkpoints" / "step_50").mkdir(parents=True)  # stopped after step 50
    (run_dir / "checkpoints" / "latest").write_text("step_50")
    job = exp.run_job(key, [cfg])
    assert (run_dir / "checkpoints" / "step_50").is_dir()  # kept: xtoken run resumes it
    assert (run_dir / scale.RESUMED_MARK).exists()  # the row will say resumed
    assert [c[3] for c in job.commands[:1]] == ["run"]
    changed = copy.deepcopy(cfg)
    changed["trainer"]["optim"]["lr"] = 2e-3  # another config: starts over
    exp.run_job(key, [changed])
    assert not run_dir.exists()
    exp.args.checkpoint_every = 0
    (cfg,) = exp.configs(key, scale_arms.parse_scale_arm(key.arm))
    assert cfg["trainer"]["schedule"].get("checkpoint_every", 0) == 0


def test_compile_on_or_off_reaches_the_trainer_and_auto_leaves_its_default(tmp_path):
    exp = _bare_experiment(tmp_path)
    key = RunKey("grid", f"pkl@{Q}", 0, 1e-3, 0.5, 1.0)
    arm = scale_arms.parse_scale_arm(key.arm)
    got = {}
    for choice in ("auto", "on", "off"):
        exp.args.compile = choice
        (cfg,) = exp.configs(key, arm)
        got[choice] = cfg["trainer"]["compute"].get("compile")
    assert got == {"auto": None, "on": True, "off": False}
    assert scale.parse_args(["--compile", "off"]).compile == "off"


def test_a_length_multiple_and_ladder_reach_the_trainer_and_a_bad_multiple_is_refused(
    tmp_path, capsys
):
    exp = _bare_experiment(tmp_path)
    key = RunKey("grid", "ce", 0, 1e-3, None, None)
    arm = scale_arms.parse_scale_arm(key.arm)
    (cfg,) = exp.configs(key, arm)
    assert "length_multiple" not in cfg["trainer"]["compute"]  # the trainer's default
    exp.args.length_multiple, exp.args.warm_shortest = 64, 256
    (cfg,) = exp.configs(key, arm)
    assert cfg["trainer"]["compute"]["length_multiple"] == 64
    assert cfg["trainer"]["compute"]["warm_shortest"] == 256
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--length-multiple", "48", "--ctx", "512"])
    assert e.value.code == 2
    assert "--length-multiple 48: give a divisor of --ctx (512)" in capsys.readouterr().err


def test_grid_runs_train_the_grid_budget_apart_and_final_runs_the_full_one(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.args.grid_steps, exp.args.grid_tokens = 200, 2_000_000
    grid = RunKey("grid", f"pkl@{Q}", 0, 1e-3, 0.5, 1.0)
    final = grid._replace(phase="final")
    arm = scale_arms.parse_scale_arm(grid.arm)
    (g,), (f,) = exp.configs(grid, arm), exp.configs(final, arm)
    assert g["trainer"]["schedule"]["max_steps"] == 200
    assert f["trainer"]["schedule"]["max_steps"] == 2000
    assert g["run_dir"] != f["run_dir"] and g["run_dir"].endswith("_grid200")
    assert exp.budget(grid) == {"steps_budget": 200, "tokens_budget": 2_000_000}
    assert exp.budget(final) == {"steps_budget": 2000, "tokens_budget": 20_000_000}
    on = RunKey("grid", f"pkl@{Q}:on_policy=0.5", 0, 1e-3, 0.5, 1.0)
    (o,) = exp.configs(on, scale_arms.parse_scale_arm(on.arm))
    assert o["trainer"]["schedule"]["max_steps"] == 200
    assert o["trainer"]["on_policy"]["start_step"] == 100  # half the grid's budget
    assert "_grid200" in o["run_dir"]
    exp.args.grid_steps, exp.args.grid_tokens = 2000, 20_000_000  # one budget: one folder
    assert exp.configs(grid, arm)[0]["run_dir"] == exp.configs(final, arm)[0]["run_dir"]


def test_a_grid_budget_above_the_final_one_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--tokens", "1000000", "--grid-tokens", "2000000"])
    assert e.value.code == 2
    assert "--grid-tokens 2000000: give a budget > 0 and at most --tokens" in (
        capsys.readouterr().err
    )


def test_rows_of_another_budget_split_or_fresh_split_are_not_counted_as_runs_done(tmp_path):
    exp = _bare_experiment(tmp_path)
    exp.args.grid_steps, exp.args.grid_tokens = 200, 2_000_000
    exp.results, exp.rows_path = {}, tmp_path / "rows.jsonl"
    exp.meta = {"fresh_commit": "aaa", "split_sha256": "s1"}
    key = {"mode": "scale", "arm": "ce", "seed": 0, "lr": 1e-3, "validation_bpb": 1.0}
    key["fresh_commit"] = "aaa"
    rows = [
        {**key, "phase": "grid", "steps_budget": 200},  # this call's grid
        {**key, "phase": "grid", "steps_budget": 2000, "lr": 5e-4},  # another call's grid
        {**key, "phase": "final", "steps_budget": 2000},  # this call's final
        {**key, "phase": "final", "steps_budget": 200, "seed": 1},  # another budget's final
        {**key, "phase": "final", "steps_budget": 2000, "seed": 2, "fresh_commit": "bbb"},
        {**key, "phase": "grid", "steps_budget": 200, "seed": 3, "fresh_commit": "bbb"},
        {**key, "phase": "grid", "steps_budget": 200, "seed": 4, "split_sha256": "s2"},
        {**key, "phase": "grid", "steps_budget": 200, "seed": 5, "split_sha256": "s1"},
    ]  # seeds 2-3: scored on another fresh split (the grid reads none); seed 4: other texts
    exp.rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert exp.load_results() == 4
    assert sorted(exp.results) == sorted(
        [
            RunKey("grid", "ce", 0, 1e-3, None, None),
            RunKey("final", "ce", 0, 1e-3, None, None),
            RunKey("grid", "ce", 3, 1e-3, None, None),
            RunKey("grid", "ce", 5, 1e-3, None, None),
        ]
    )


def test_several_runs_share_each_gpu_spread_over_the_gpus_first():
    assert scale.gpu_lanes([0, 1], 2, None) == ["0", "1", "0", "1"]
    assert scale.gpu_lanes([1], 3, "4,6") == ["6", "6", "6"]
    with pytest.raises(ValueError, match="given twice"):
        scale.gpu_lanes([0, 0], 1, None)


def test_a_negative_checkpoint_period_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--checkpoint-every", "-5"])
    assert e.value.code == 2
    assert "--checkpoint-every -5: give 0 (none) or more steps" in capsys.readouterr().err


def test_a_negative_stagger_is_refused_with_exit_2(capsys):
    assert scale.parse_args(["--stagger-s", "40"]).stagger_s == 40.0
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--stagger-s", "-1"])
    assert e.value.code == 2
    assert "--stagger-s -1.0: give 0 or more seconds" in capsys.readouterr().err


def test_slot_patterns_give_large_arms_more_of_a_gpu_and_a_bad_one_is_refused_with_exit_2(
    capsys,
):
    args = scale.parse_args(["--slots", "pkl@gemma3*=3", "*@gemma3*=2", "pkl@qwen*=2"])
    assert args.slots == [("pkl@gemma3*", 3), ("*@gemma3*", 2), ("pkl@qwen*", 2)]
    assert scale.slots_of("pkl@gemma3-270m", args.slots) == 3  # the first match counts
    assert scale.slots_of("gold@gemma3-270m", args.slots) == 2
    assert scale.slots_of("pkl@qwen2.5-coder-0.5b+gemma3-270m", args.slots) == 2
    assert scale.slots_of("ce", args.slots) == 1
    assert scale.parse_args([]).slots == []
    for bad in ("pkl@gemma3*", "=2", "pkl@gemma3*=0", "pkl@gemma3*=two"):
        with pytest.raises(SystemExit) as e:
            scale.parse_args(["--slots", bad])
        assert e.value.code == 2
        assert f"--slots {bad}: give ARM=N" in capsys.readouterr().err


def test_runs_per_gpu_below_one_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--gpus", "0", "--runs-per-gpu", "0"])
    assert e.value.code == 2
    assert "--runs-per-gpu 0: give 1 or more" in capsys.readouterr().err


def test_the_work_folder_given_as_text_is_the_resolved_path_the_run_configs_join(tmp_path):
    work, out = str(tmp_path / "w"), str(tmp_path / "o")
    args = scale.parse_args(["--arms", "ce", "--work", work, "--out", out, "--seeds", "0"])
    args.lrs, args.kl_weight, args.temperature = [5e-4], 0.5, 1.0
    exp = scale.Experiment(args)
    assert exp.args.work == (tmp_path / "w").resolve() == exp.work


# --------------------------------------------------------------------------- TRL's GOLD arm


def test_the_trl_gold_arm_has_one_teacher_its_rate_alone_and_gold_as_twin():
    arm = scale_arms.parse_scale_arm(f"trl-gold@{Q}")
    assert arm.peer and not arm.tunes_kd and arm.teachers == (Q,)
    assert arm.family == f"trl-gold@{Q}" and arm.pinned == {}
    assert scale_arms.parse_scale_arm(f"trl-gold@{Q}:lr=0.001").pinned == {"lr": 1e-3}
    specs = ["ce", f"gold@{Q}:topk=32", f"gold@{Q}", f"trl-gold@{Q}"]
    assert scale_arms.twin_of(arm, specs) == f"gold@{Q}"
    assert scale_arms.twin_of(arm, ["ce"]) is None
    with pytest.raises(ValueError, match="takes only lr=VALUE"):
        scale_arms.parse_scale_arm(f"trl-gold@{Q}:kl_weight=0.5")
    with pytest.raises(ValueError, match="one teacher"):
        scale_arms.parse_scale_arm(f"trl-gold@{Q}+{G}")


def test_the_trl_gold_arm_is_tuned_on_the_rate_grid_alone():
    arms = [scale_arms.parse_scale_arm(s) for s in (f"pkl@{Q}", f"trl-gold@{Q}")]
    spec = GridSpec(lrs=(5e-4, 1e-3), kl_weights=(0.5, 1.0), temperatures=(1.0,))
    pending = scale_grid.plan(arms, {}, spec).pending
    trl = [k for k in pending if k.arm == f"trl-gold@{Q}"]
    assert {(k.lr, k.kl_weight, k.temperature) for k in trl} == {(5e-4, None, None),
                                                                (1e-3, None, None)}  # fmt: skip
    assert {k.kl_weight for k in pending if k.arm == f"pkl@{Q}"} == {0.5, 1.0}


def test_a_named_trl_arm_without_trl_is_refused_and_the_default_one_left_out(tmp_path):
    args = argparse.Namespace(arms=["ce", f"trl-gold@{Q}"], trl_python=str(tmp_path / "nopy"))
    with pytest.raises(ValueError, match=r"arm trl-gold@qwen2.5-coder-0.5b needs trl: "):
        scale.resolve_trl(args, defaulted=False)
    scale.resolve_trl(args, defaulted=True)
    assert args.arms == ["ce"] and args.trl is None
    plain = argparse.Namespace(arms=["ce"], trl_python=None)
    scale.resolve_trl(plain, defaulted=False)
    assert plain.trl is None


def test_a_trl_run_trains_the_seeds_train_texts_at_its_rate_into_its_own_folder(tmp_path):
    from benchmarks.quality import heal_peer

    split = tmp_path / "split"
    split.mkdir()
    for name in ("train", "heldout", "fresh", "val"):
        rows = [{"text": f"{name} text number {i}\n" * 3} for i in range(40)]
        (split / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    args = _args(tmp_path)
    args.corpus, args.steps, args.batch = split, 3, 4
    run = tmp_path / "runs" / "trl-gold_s1_lr0.002"
    argv = heal_peer.peer_job(args, 1, tmp_path / "student", tmp_path / "teacher", "qwen3",
                              "python3", work=run, lr=2e-3, device="cpu")  # fmt: skip
    assert argv[2:] == [str(run / "spec.json"), str(run / "result.json")]
    spec = json.loads((run / "spec.json").read_text())
    assert (spec["lr"], spec["device"], spec["steps"]) == (2e-3, "cpu", 3)
    assert spec["save"] == str(run / "final")  # where the scoring reads the student
    texts = [json.loads(x)["completion"] for x in (run / "data.jsonl").read_text().splitlines()]
    assert len(texts) == 12 and all(t.startswith("train text") for t in texts)


def test_trl_runs_train_a_budget_of_their_own_where_one_is_given(tmp_path, capsys):
    exp = _bare_experiment(tmp_path)
    exp.args.grid_steps, exp.args.grid_tokens = 200, 2_000_000
    trl = RunKey("grid", f"trl-gold@{Q}", 0, 1e-3, None, None)
    ce = RunKey("grid", "ce", 0, 1e-3, None, None)
    assert exp.budget(trl) == exp.budget(ce) == {"steps_budget": 200, "tokens_budget": 2_000_000}
    exp.args.peer_tokens, exp.args.peer_steps = 200_000, 20
    for phase in ("grid", "final"):
        assert exp.budget(trl._replace(phase=phase)) == {
            "steps_budget": 20,
            "tokens_budget": 200_000,
        }
        assert exp.args_of(trl._replace(phase=phase)).steps == 20
    assert exp.budget(ce) == {"steps_budget": 200, "tokens_budget": 2_000_000}
    with pytest.raises(SystemExit) as e:
        scale.parse_args(["--peer-tokens", "0"])
    assert e.value.code == 2
    assert "--peer-tokens 0: give a budget > 0 student tokens" in capsys.readouterr().err


def test_the_trl_gold_arm_is_in_the_table_but_judged_by_no_bar():
    rows = _rows()
    for seed in range(3):  # TRL's rows: worse than CE, which would miss a cross-tokenizer bar
        rows.append(_row(f"trl-gold@{Q}", seed, 1.2, 1.7, [Q], deterministic=False))
    summary = scale_report.summarize(rows)
    assert f"trl-gold@{Q}" in summary["arms"] and f"trl-gold@{Q}" not in summary["cross"]
    names = [name for name, _, _ in scale_report.bars(summary, rows)]
    assert not any("trl-gold" in name for name in names)
