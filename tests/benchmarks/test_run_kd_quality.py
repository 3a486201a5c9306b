"""The KD quality script (benchmarks/quality/run_kd_quality.py): byte categories, split, bar, smoke."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality" / "run_kd_quality.py"


def _module():
    spec = importlib.util.spec_from_file_location("run_kd_quality", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_byte_categories_split_comments_strings_digits_whitespace_and_code():
    q = _module()
    text = 'x = 12  # hé 3\ns = "a b" + f(\'q\')\n"""doc\n7"""'
    cats = q.byte_categories(text)
    names = [q.CATEGORIES[c] for c in cats]
    raw = text.encode("utf-8")
    assert len(cats) == len(raw)
    by_byte = dict(zip(range(len(raw)), names))
    assert by_byte[raw.index(b"x")] == "code"
    assert by_byte[raw.index(b"1")] == "digits"
    assert by_byte[raw.index(b"#")] == "prose"
    assert names[raw.index("é".encode()) : raw.index("é".encode()) + 2] == ["prose", "prose"]
    assert by_byte[raw.index(b'"a')] == "prose" and by_byte[raw.index(b"+")] == "code"
    assert by_byte[raw.index(b"'q'")] == "prose"
    assert by_byte[raw.index(b"doc")] == "prose"
    assert by_byte[raw.index(b"7")] == "digits"
    assert all(n == "whitespace" for b, n in zip(raw, names) if b in b" \n")


def test_split_is_by_file_and_deterministic():
    q = _module()
    splits = {f"pkg/mod{i}.py": q.split_of(f"pkg/mod{i}.py", 0.06, 0.06) for i in range(2000)}
    assert splits == {s: q.split_of(s, 0.06, 0.06) for s in splits}
    counts = {k: list(splits.values()).count(k) for k in ("train", "val", "heldout")}
    assert 60 < counts["heldout"] < 180 and 60 < counts["val"] < 180


def _row(arm, seed, bpb):
    cat = {c: {"bits_per_byte": bpb, "bytes": 1} for c in ("prose", "code", "digits", "whitespace")}
    return {
        "arm": arm,
        "seed": seed,
        "tokens": 100,
        "steps": 10,
        "wall_s": 1.0,
        "heldout": {"bits_per_byte": bpb, "accuracy": 0.5, "per_category": cat},
    }


def test_bar_needs_a_gain_beyond_the_seed_spread():
    q = _module()
    rows = [_row("ce", s, v) for s, v in enumerate((2.00, 2.02, 2.04))]
    rows += [_row("pkl", s, v) for s, v in enumerate((1.90, 1.91, 1.92))]  # clear win
    rows += [_row("gold", s, v) for s, v in enumerate((1.99, 2.01, 2.05))]  # within spread
    s = q.summarize(rows)
    assert s["arms"]["pkl"]["bar_met"] is True
    assert s["arms"]["gold"]["bar_met"] is False
    assert s["arms"]["pkl"]["paired_gains"] == pytest.approx([0.10, 0.11, 0.12])


@pytest.mark.slow
def test_arm_spec_carries_loss_overrides_into_the_run_config(tmp_path):
    q = _module()
    assert q.parse_arm("gold:uncommon_topk=1,kl_weight=0.3") == (
        "gold",
        {"uncommon_topk": 1, "kl_weight": 0.3},
    )
    args = type("A", (), {})()
    args.device, args.temperature, args.kl_weight, args.collators = "cpu", 1.0, 1.0, 1
    args.teacher_tokenizer, args.ctx, args.limit, args.teacher, args.batch = (
        "smollm2",
        64,
        4,
        "tiny",
        2,
    )
    args.steps, args.epochs, args.eval_every, args.eval_texts, args.lr, args.warmup = (
        2,
        1,
        1,
        2,
        1e-3,
        1,
    )
    args.corpus = tmp_path
    cfg = q.arm_config(
        "pkl:kl_weight=0.3,temperature=2", 0, tmp_path, args, tmp_path, tmp_path / "p.pt"
    )
    loss = cfg["trainer"]["loss"]
    assert (loss["mode"], loss["kl_weight"], loss["temperature"]) == ("pkl", 0.3, 2)
    assert "pkl:" not in cfg["run_dir"] and cfg["run_dir"].endswith("_s0")


@pytest.mark.parametrize("bad", ["foo", "ce:kl_weight=1", "pkl:nope=1", "pkl:mode=gold", "pkl:x"])
def test_arm_spec_refuses_unknown_arms_keys_and_ce_overrides(bad):
    with pytest.raises(ValueError, match=bad.split(":")[0] if ":" not in bad else "arm"):
        _module().parse_arm(bad)


def test_runs_spread_over_gpus_each_sees_its_own_and_none_holds_more_than_parallel(
    tmp_path, monkeypatch
):
    """--gpus 0 1 --parallel 1: four real processes, each started with the one GPU it was given
    (the name this process sees under CUDA_VISIBLE_DEVICES), never two at once on one GPU."""
    q = _module()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    out = tmp_path / "seen"
    out.mkdir()
    prog = (
        "import os, sys, time; t = time.time(); time.sleep(0.3); "
        "open(sys.argv[1], 'w').write(f\"{os.environ['CUDA_VISIBLE_DEVICES']} {t} {time.time()}\")"
    )
    jobs = [("arm", i, [sys.executable, "-c", prog, str(out / f"run{i}")]) for i in range(4)]
    done = q.launch_all(jobs, tmp_path, 1, time.monotonic() + 600, gpus=[0, 1])
    assert all(code == 0 for code, _ in done.values())
    runs = [(out / f"run{i}").read_text().split() for i in range(4)]
    assert sorted(gpu for gpu, *_ in runs) == ["2", "2", "3", "3"]
    for gpu in ("2", "3"):
        (_, a0, a1), (_, b0, b1) = [r for r in runs if r[0] == gpu]
        assert float(a1) <= float(b0) or float(b1) <= float(a0)  # one after the other


@pytest.mark.parametrize("gpus, visible", [([0, 0], None), ([2], "4,5"), ([-1], None)])
def test_gpu_indices_that_this_process_does_not_see_are_refused(gpus, visible):
    with pytest.raises(ValueError, match="--gpus"):
        _module().gpu_names(gpus, visible)


def test_the_script_refuses_a_gpu_it_does_not_see_with_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--preset",
            "heal",
            "--gpus",
            "0",
            "1",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--gpus: GPU 1" in done.stderr


def test_ablation_table_pairs_each_arm_with_ce_of_the_same_seed_on_validation():
    q = _module()
    rows = []
    for arm, seed, bpb in (
        ("ce", 0, 2.0),
        ("ce", 1, 2.2),
        ("gold:uncommon_topk=1", 0, 1.9),
        ("gold:uncommon_topk=1", 1, 2.3),
    ):
        r = _row(arm, seed, bpb)
        r["val"] = r.pop("heldout")
        rows.append(r)
    table = q.ablation_table(rows)
    line = next(ln for ln in table.splitlines() if "uncommon_topk=1" in ln)
    assert "+0.100" in line and "-0.100" in line and "0,1" in line
    assert q.summarize(rows)["arms"] == {}  # validation rows never enter the held-out bar


def run_script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``run_kd_quality.py ARGS`` in a subprocess; fails the test on a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_cpu_smoke_trains_every_arm_through_xtoken_run_and_scores_it(tmp_path):
    out = tmp_path / "out"
    run_script("--smoke", "--work", str(tmp_path / "work"), "--out", str(out))
    rows = [json.loads(line) for line in (out / "quality_rows.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows) == ["ce", "gold", "pkl", "xtoken"]
    for r in rows:
        assert r["exit"] == 0 and r["steps"] == 6
        h = r["heldout"]
        assert sum(c["bytes"] for c in h["per_category"].values()) == h["bytes"]
        assert 0 < h["bits_per_byte"] < 20 and 0 <= h["accuracy"] <= 1
    assert len({r["tokens"] for r in rows}) == 1  # equal tokens in every arm
    report = run_script("--report", str(out / "quality_rows.jsonl"), "--out", str(out), timeout=300)
    assert "| CE only |" in (out / "quality_table.md").read_text()
    if importlib.util.find_spec("matplotlib") is None:  # the plots need the bench extra
        assert "no plots: matplotlib is not installed" in report.stderr
    else:
        assert (out / "quality_val_bpb.png").stat().st_size > 1000


@pytest.mark.slow
def test_heal_smoke_trains_arms_with_their_own_teachers_scores_both_splits_and_resumes(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"

    def run(*extra):
        return run_script("--smoke-heal", "--work", str(work), *extra)

    run("--out", str(out))
    rows = [json.loads(line) for line in (out / "heal_rows.jsonl").read_text().splitlines()]
    kinds = sorted((r["kind"], r["arm"]) for r in rows)
    assert kinds == [
        ("before", "before"),
        ("student", "ce"),
        ("student", "pkl@qwen2.5-coder-0.5b:on_policy=0.5"),
        ("student", "pkl@smollm2"),
        ("student", "xtoken@qwen2.5-coder-0.5b"),
        ("teacher", "qwen2.5-coder-0.5b"),
        ("teacher", "smollm2"),
    ]
    students = [r for r in rows if r["kind"] == "student"]
    for r in rows:
        for split in ("heldout", "fresh"):
            h = r[split]
            assert sum(c["bytes"] for c in h["per_category"].values()) == h["bytes"]
            assert 0 < h["bits_per_byte"] < 20 and h["nextline"]["lines"] == 4
    assert all(r["exit"] == 0 and r["steps"] == 4 for r in students)
    off = [r for r in students if not r["on_policy"]]
    assert len({r["tokens"] for r in off}) == 1  # one data order for every off-policy arm
    for r in students + [r for r in rows if r["kind"] == "before"]:  # one scorer for all
        rated = r["heldout"]["continuation"]
        assert rated["scorer"] == "qwen2.5-coder-0.5b" and rated["continuations"] >= 1
        assert 0 < rated["bits_per_byte"] < 40
    assert next(r for r in students if r["arm"] == "pkl@smollm2")["parent"] is True

    again = run("--out", str(tmp_path / "out2"), "--resume", str(out / "heal_rows.jsonl"))
    assert "0 runs to go" in again.stderr and not (tmp_path / "out2" / "heal_rows.jsonl").exists()
    # rows lost (a call cut short after training): the same work dir scores without training
    rescored = run("--out", str(tmp_path / "out3"))
    assert "0 runs to go (0 arm runs done before, 4 trained but not scored)" in rescored.stderr
    again_rows = (tmp_path / "out3" / "heal_rows.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["kind"] == "student" for line in again_rows) == 4

    report = run_script("--report", str(out / "heal_rows.jsonl"), "--out", str(out), timeout=300)
    md = (out / "heal.md").read_text()
    assert "### fresh" in md and "| pruned student, before training |" in md
    assert "best cross-tokenizer arm closes >= 50% of the gap" in md
    assert "own continuations, rated by a teacher" in md
    assert "| ce | qwen2.5-coder-0.5b |" in md  # each row names its scorer
    if importlib.util.find_spec("matplotlib") is None:  # the plot needs the bench extra
        assert "no plot: matplotlib is not installed" in report.stderr
    else:
        assert (out / "heal_diff.png").stat().st_size > 1000


def _bench_python_has_trl() -> bool:
    py = ROOT / ".venv-bench" / "bin" / "python"
    return py.exists() and subprocess.run([str(py), "-c", "import trl"]).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(
    not _bench_python_has_trl(), reason="needs .venv-bench with trl: ./scripts/setup.sh test peers"
)
def test_heal_peer_gold_trains_the_same_pair_with_trl_and_scores_it_like_the_arms(tmp_path):
    out = tmp_path / "out"
    run_script(
        "--smoke-heal",
        "--peer-gold",
        "--arms",
        "ce",
        "gold@qwen2.5-coder-0.5b",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
    )
    rows = [json.loads(line) for line in (out / "heal_rows.jsonl").read_text().splitlines()]
    peer = next(r for r in rows if r["kind"] == "peer")
    assert peer["trl"]["steps_run"] == 4 and "error" not in peer["trl"]
    assert peer["trl"]["lr_schedule"] == "cosine_with_min_lr"  # xtoken's schedule
    assert peer["trl"]["first_nonfinite_step"] is None
    assert (
        0 < peer["fresh"]["bits_per_byte"] < 20 and peer["compare_to"] == "gold@qwen2.5-coder-0.5b"
    )
    run_script("--report", str(out / "heal_rows.jsonl"), "--out", str(out), timeout=300)
    assert "at least as good as TRL GOLD" in (out / "heal.md").read_text()


def test_the_script_refuses_fewer_than_one_rollout_worker_with_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--preset",
            "heal",
            "--rollouts",
            "0",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rollouts 0" in lines[0] and ">= 1" in lines[0]
    assert not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.parametrize("flag", ["--rollout-batch", "--max-staleness"])
def test_the_script_refuses_a_rollout_batch_or_staleness_below_one_with_one_line_and_exit_2(
    tmp_path, flag
):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "heal", flag, "0", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag} 0" in lines[0] and ">= 1" in lines[0]
    assert not any(tmp_path.iterdir())


def test_a_runs_totals_hold_what_its_rollouts_gave_when_it_trained_on_policy(tmp_path):
    from benchmarks.quality.run_kd_quality import collect

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    steps = [
        {"event": "step", "step": i, "tokens": 100, "step_s": 1.0,
         "on_policy": {"samples": n, "mean_staleness": st, "dropped_stale": d, "wait_s": 0.5}}
        for i, (n, st, d) in enumerate([(8, 1.0, 0), (8, 3.0, 4), (0, None, 4)])
    ]  # fmt: skip
    (metrics / "trainer.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    batches = [
        {"event": "rollout", "generated_tokens": 300, "sample_s": 2.5, "collate_s": 0.5},
        {"event": "rollout", "generated_tokens": 100, "sample_s": 0.9, "collate_s": 0.1},
    ]
    (metrics / "rollout0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in batches))
    totals = collect("pkl:on_policy=0.5", 0, tmp_path)["rollout"]
    assert totals == {
        "samples": 16,
        "mean_staleness": 2.0,
        "dropped_stale": 4,
        "wait_s": 1.5,
        "generated_tokens": 400,
        "tokens_per_s_per_worker": 100.0,
    }
    (metrics / "trainer.rank0.jsonl").write_text(json.dumps({"event": "step", "step": 0}) + "\n")
    assert "rollout" not in collect("ce", 0, tmp_path)  # an off-policy run has none


def test_a_runs_totals_split_its_start_up_compile_and_first_step_and_a_bad_summary_is_none(
    tmp_path,
):
    from benchmarks.quality.run_kd_quality import collect

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    steps = [
        {"event": "step", "step": i, "tokens": 10, "step_s": s, "memory_mb": m}
        for i, s, m in ((1, 9.5, 900.0), (2, 0.5, 1200.5))
    ]
    (metrics / "trainer.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "summary.json").write_text(json.dumps({"compile_s": 42.0}))
    totals = collect("ce", 0, tmp_path)
    assert (totals["compile_s"], totals["first_step_s"], totals["train_s"]) == (42.0, 9.5, 10.0)
    assert totals["peak_memory_mib"] == {"trainer": 1200.5, "teacher": None}
    teacher = [{"event": "batch", "memory_mb": 3000.0}, {"event": "eval", "bits_per_byte": 0.7}]
    (metrics / "teacher.group0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in teacher))
    assert collect("pkl", 0, tmp_path)["peak_memory_mib"] == {"trainer": 1200.5, "teacher": 3000.0}
    assert collect("pkl", 0, tmp_path)["peak_reserved_mib"] == {"trainer": None, "teacher": None}
    steps[1]["memory_reserved_mb"] = 2048.0  # on a GPU: what the allocator held
    teacher[0]["memory_reserved_mb"] = 4096.0
    (metrics / "trainer.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (metrics / "teacher.group0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in teacher))
    assert collect("pkl", 0, tmp_path)["peak_reserved_mib"] == {"trainer": 2048.0, "teacher": 4096.0}
    (tmp_path / "summary.json").write_text("{not json")  # a run killed while writing it
    assert collect("ce", 0, tmp_path)["compile_s"] is None
    (tmp_path / "summary.json").unlink()
    assert collect("ce", 0, tmp_path)["compile_s"] is None


def test_projection_file_records_its_tokenizers_so_runs_check_it(tmp_path, caplog):
    from xtoken_core.data.projection import check_projection_tokenizers
    from xtoken_core.data.projection_file import read_projection_metadata
    from xtoken_core.tokenizers import load_tokenizer

    q = _module()
    path = tmp_path / "projection_smollm2_smollm2_k8.pt"
    q.build_projection_file(path, "smollm2", 8, "smollm2")
    meta = read_projection_metadata(path)
    assert (meta["student"], meta["teacher"]) == ("smollm2", "smollm2")
    tok = load_tokenizer("smollm2")
    with caplog.at_level("WARNING"):
        report = check_projection_tokenizers(path, tok, tok)
    assert report["checked"] and "records no tokenizers" not in caplog.text
