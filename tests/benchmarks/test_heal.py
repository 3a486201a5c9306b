"""The healing experiment's arms and runs (benchmarks/quality/heal.py): arm specs with a teacher,
model aliases, run configs, and same-tokenizer P-KL being the per-token KL."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import heal  # noqa: E402


def test_arm_spec_names_its_teacher_and_loss_overrides():
    arm = heal.parse_heal_arm("gold@qwen2.5-coder-0.5b:uncommon_topk=1,kl_weight=0.3")
    assert (arm.base, arm.teacher) == ("gold", "qwen2.5-coder-0.5b")
    assert arm.overrides == {"uncommon_topk": 1, "kl_weight": 0.3}
    assert heal.parse_heal_arm("ce") == heal.HealArm("ce", "ce", None, {})
    assert heal.parse_heal_arm("pkl@smollm2").teacher == "smollm2"
    assert heal.teacher_tokenizer("qwen2.5-coder-0.5b") == "qwen3"
    assert heal.teacher_tokenizer("gemma3-270m") == "gemma3"
    assert [heal.parse_heal_arm(a).spec for a in heal.HEAL_ARMS] == list(heal.HEAL_ARMS)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("pkl", "name its teacher"),
        ("ce@smollm2", "no teacher"),
        ("pkl@llama9", "not one of"),
        ("kd@smollm2", "not one of"),
        ("gold@smollm2:nope=1", "key=value"),
    ],
)
def test_arm_spec_refuses_a_missing_or_unknown_teacher(bad, match):
    with pytest.raises(ValueError, match=match):
        heal.parse_heal_arm(bad)


def test_alias_swaps_the_model_and_keeps_the_drop_suffix():
    aliases = heal.parse_aliases(["smollm2=gguf:/m/s.gguf", "qwen2.5-coder-0.5b=gguf:/m/q.gguf"])
    assert heal.resolve("smollm2:drop=10-19", aliases) == "gguf:/m/s.gguf:drop=10-19"
    assert heal.resolve("qwen2.5-coder-0.5b", aliases) == "gguf:/m/q.gguf"
    assert heal.resolve("gemma3-270m", aliases) == "gemma3-270m"
    with pytest.raises(ValueError, match="NAME=SPEC"):
        heal.parse_aliases(["qwen.gguf"])
    assert heal.student_tokenizer("smollm2:drop=10-19", None) == "smollm2"
    with pytest.raises(ValueError, match="--student-tokenizer"):
        heal.student_tokenizer("/some/folder:drop=1", None)


def test_run_config_gives_each_arm_its_teacher_and_one_data_order_per_seed(tmp_path):
    args = argparse.Namespace(
        device="cuda",
        work=tmp_path,
        corpus=tmp_path,
        student_tokenizer="smollm2",
        ctx=512,
        batch=16,
        limit=None,
        steps=150,
        epochs=3,
        eval_every=50,
        eval_texts=64,
        lr=5e-4,
        warmup=20,
        temperature=1.0,
        kl_weight=1.0,
        aliases={"qwen2.5-coder-0.5b": "gguf:/m/q.gguf"},
    )
    student = tmp_path / "student"
    cfgs = {
        a: heal.run_config(heal.parse_heal_arm(a), 1, args, student, tmp_path / f"{a}.pt")
        for a in ("ce", "pkl@smollm2", "xtoken@qwen2.5-coder-0.5b")
    }
    x = cfgs["xtoken@qwen2.5-coder-0.5b"]
    assert x["teacher_tokenizer"] == "qwen3" and x["teacher"]["model"] == "gguf:/m/q.gguf"
    assert x["trainer"]["loss"]["mode"] == "xtoken" and "vocab_topk" not in x["trainer"]["loss"]
    same = cfgs["pkl@smollm2"]["trainer"]["loss"]
    assert same["vocab_topk"] is None and cfgs["pkl@smollm2"]["teacher_tokenizer"] == "smollm2"
    for cfg in cfgs.values():
        assert cfg["data"]["seed"] == 1 and cfg["data"]["ordered"] is True
        assert cfg["collator"]["workers"] == 1 and cfg["trainer"]["student"]["seed"] == 1
        assert cfg["trainer"]["student"]["model"] == str(student)
    assert cfgs["ce"]["trainer"]["loss"] == {"mode": "ce"}


def test_same_tokenizer_pkl_is_per_token_kl(tmp_path):
    """The smollm2 -> smollm2 projection is the identity on its mapped ids, every chunk of a text
    is one token, so P-KL over all columns is the sum of per-token KL(teacher || student)."""
    from xtoken_core.align.aligner import TokenAligner
    from xtoken_core.data.projection import get_sparse_projection_matrix
    from xtoken_core.data.projection_build import build_projection_with_stats
    from xtoken_core.losses import CrossTokenizerLossConfig
    from xtoken_core.losses.inputs import LossInputs
    from xtoken_core.losses.modes.pkl import reference_kd_loss
    from xtoken_core.tokenizers import load_tokenizer

    tok = load_tokenizer("smollm2")
    V = tok.vocab_size
    proj, stats = build_projection_with_stats(tok, tok, 8)
    torch.save(proj, tmp_path / "p.pt")
    M = get_sparse_projection_matrix(
        tmp_path / "p.pt", "cpu", student_vocab_size=V, teacher_vocab_size=V
    ).coalesce()
    rows, cols = M.indices()
    assert torch.equal(rows, cols) and torch.all(M.values() == 1)
    assert len(rows) == V - stats.unmapped_rows
    unmapped = torch.ones(V, dtype=torch.bool)
    unmapped[rows] = False

    enc = tok.encode(
        "def heal(model):\n    return model.train()  # 42 ünïcode", add_special_tokens=False
    )
    a = TokenAligner().align_sample(enc.spans, enc.spans)
    T = len(enc.ids)
    chunk = torch.as_tensor(a.student_chunk_id)
    assert torch.equal(chunk, torch.arange(T)) and torch.equal(
        torch.as_tensor(a.teacher_chunk_id), chunk
    )

    g = torch.Generator().manual_seed(0)
    z_s = torch.randn(1, T, V, generator=g, dtype=torch.float64)
    z_t = torch.randn(1, T, V, generator=g, dtype=torch.float64)
    # unit-scale logits keep every probability above the loss's 1e-10 floor; ids without bytes
    # get no mass on either side
    z_s[..., unmapped] = -1e4
    z_t[..., unmapped] = -1e4
    shifted = torch.cat([chunk[1:], torch.tensor([-1])])[None]
    valid = torch.ones(1, T, dtype=torch.bool)
    valid[0, 0] = False  # chunk 0 (the first token) is predicted by no position
    terms = reference_kd_loss(
        LossInputs(z_s, z_t, shifted, shifted, valid),
        M,
        CrossTokenizerLossConfig(temperature=1.0, vocab_topk=None, reverse_kl=False),
    )
    lp_t, lp_s = z_t[0, :-1].log_softmax(-1), z_s[0, :-1].log_softmax(-1)
    kl = (lp_t.exp() * (lp_t - lp_s)).sum()
    assert terms.kd.item() == pytest.approx(kl.item(), rel=1e-9)
    assert int(terms.num_valid) == T - 1


def test_peer_texts_are_cut_after_ctx_tokens_of_both_tokenizers():
    from benchmarks.quality.heal_peer import cut_to_tokens
    from xtoken_core.tokenizers import load_tokenizer

    s, t = load_tokenizer("smollm2"), load_tokenizer("qwen3")
    text = "def heal(model):\n    return model.train()  # ünïcode 12345\n" * 10
    cut = cut_to_tokens(text, [s, t], 16)
    assert text.startswith(cut) and len(cut) < len(text)
    lengths = [len(tok.encode(cut, add_special_tokens=False).ids) for tok in (s, t)]
    assert max(lengths) == 16
    assert cut_to_tokens("short", [s, t], 16) == "short"


def _python_named(tmp_path, name: str, packages: list[str]) -> None:
    """An interpreter called ``name`` on ``PATH``: this python, seeing only ``packages``."""
    pkgs = tmp_path / f"{name}-site"
    for pkg in packages:
        (pkgs / pkg).mkdir(parents=True)
        (pkgs / pkg / "__init__.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={pkgs} exec {sys.executable} -S "$@"\n')
    exe.chmod(0o755)


def test_peer_python_given_by_command_name_is_found_on_path(tmp_path, monkeypatch):
    from benchmarks.quality.heal_peer import trl_python

    _python_named(tmp_path, "py-with-trl", ["trl", "datasets"])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert trl_python("py-with-trl") == str(tmp_path / "bin" / "py-with-trl")


def test_peer_python_without_trl_is_skipped_with_the_reason(tmp_path, monkeypatch, caplog):
    from benchmarks.quality.heal_peer import trl_python

    _python_named(tmp_path, "py-no-trl", ["datasets"])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with caplog.at_level("WARNING", logger="kd_quality.heal"):
        assert trl_python("py-no-trl") is None
        assert trl_python("no-such-python-here") is None
    assert "No module named 'trl'" in caplog.text
    assert "not importable by no-such-python-here (not found;" in caplog.text


def test_a_trl_run_whose_loss_turned_nan_is_not_scored_and_names_the_step(tmp_path):
    from types import SimpleNamespace

    from benchmarks.quality.heal_peer import peer_result

    args = SimpleNamespace(work=tmp_path, lr=5e-4)
    work = tmp_path / "trl" / "s0"
    work.mkdir(parents=True)
    res = {"steps_run": 150, "losses": [2.0, float("nan")], "first_nonfinite_step": 37}
    (work / "result.json").write_text(json.dumps(res))
    out, model = peer_result(args, 0)
    assert model is None and out["first_nonfinite_step"] == 37
    assert "not finite from step 37 of 150 (lr 0.0005)" in out["error"]
    (work / "result.json").write_text(json.dumps({**res, "first_nonfinite_step": None}))
    out, model = peer_result(args, 0)
    assert model == work / "final" and "error" not in out


def test_report_refuses_rows_of_different_experiments(tmp_path):
    from benchmarks.quality.heal_report import report_heal

    base = {"mode": "heal", "kind": "before", "arm": "before", "seed": None, "steps": 150}
    with pytest.raises(ValueError, match="mix 2 experiments"):
        report_heal(
            [{**base, "student": "smollm2:drop=10-19"}, {**base, "student": "x:drop=1"}], tmp_path
        )


def test_an_arm_naming_its_own_learning_rate_is_of_the_same_experiment_another_rate_is_not():
    from benchmarks.quality.heal_report import experiments

    base = {"mode": "heal", "kind": "student", "seed": 0, "steps": 150, "lr": 5e-4}
    rows = [{**base, "arm": "ce"}, {**base, "arm": "ce:lr=0.001", "lr": 1e-3},
            {**base, "arm": "gold@q:kl_weight=0.5,lr=0.001", "lr": 1e-3}]  # fmt: skip
    assert len(experiments(rows)) == 1
    assert len(experiments(rows + [{**base, "arm": "ce", "lr": 1e-3}])) == 2
    alone = [r for r in rows if r["arm"] != "ce"]  # only own-rate arms: one experiment
    assert len(experiments(alone)) == 1


def _run_args(tmp_path, device: str) -> argparse.Namespace:
    """The command-line values ``heal.run_config`` reads, the experiment's defaults."""
    return argparse.Namespace(
        device=device, work=tmp_path, corpus=tmp_path, student_tokenizer="smollm2", ctx=512,
        batch=16, limit=None, steps=150, epochs=3, eval_every=50, eval_texts=64, lr=5e-4,
        warmup=20, temperature=1.0, kl_weight=1.0, aliases={}, rollouts=None,
        rollout_batch=None, max_staleness=None, kv_cache=None,
    )  # fmt: skip


def test_an_on_policy_arm_runs_rollouts_unordered_with_rows_of_the_whole_context(tmp_path):
    arm = heal.parse_heal_arm("pkl@qwen2.5-coder-0.5b:on_policy=0.5,temperature=2")
    assert arm.on_policy == 0.5 and arm.overrides == {"temperature": 2}
    args = _run_args(tmp_path, "cuda")
    cfg = heal.run_config(arm, 2, args, tmp_path / "student", tmp_path / "p.pt")
    assert cfg["data"]["on_policy_fraction"] == 0.5 and cfg["data"]["ordered"] is False
    assert cfg["rollouts"] == 2 and cfg["rollout"]["device"] == "cuda"  # 3 x 0.5, rounded up
    whole = heal.run_config(heal.parse_heal_arm("pkl@qwen2.5-coder-0.5b:on_policy=1"), 2, args,
                            tmp_path / "student", tmp_path / "p.pt")  # fmt: skip
    assert whole["rollouts"] == 3
    args.rollouts = 1
    assert heal.run_config(arm, 2, args, tmp_path / "student", tmp_path / "p.pt")["rollouts"] == 1
    assert cfg["rollout"]["batch"] == 16 and cfg["rollout"]["kv_cache"] == "dynamic"
    assert cfg["trainer"]["on_policy"]["max_staleness"] == 4
    args.rollout_batch, args.max_staleness, args.kv_cache = 32, 8, "static"
    bigger = heal.run_config(arm, 2, args, tmp_path / "student", tmp_path / "p.pt")
    assert bigger["rollout"]["batch"] == 32 and bigger["rollout"]["kv_cache"] == "static"
    assert bigger["trainer"]["on_policy"]["max_staleness"] == 8
    bigger = bigger
    assert cfg["rollout"]["prompt_tokens"] + cfg["rollout"]["max_new_tokens"] == 512
    assert cfg["trainer"]["loss"]["temperature"] == 2
    off = heal.run_config(heal.parse_heal_arm("pkl@qwen2.5-coder-0.5b"), 2, args, tmp_path, None)
    assert "rollout" not in off and off["data"]["ordered"] is True
    from services.supervise.config import run_config_from_dict

    run_config_from_dict(cfg)  # the run accepts it as it is
    run_config_from_dict(bigger)


def test_an_agree_arm_keeps_kd_where_another_tokenizer_cuts_alike_and_the_run_accepts_it(tmp_path):
    arm = heal.parse_heal_arm("pkl@smollm2:agree=qwen3,temperature=2")
    assert arm.agree == "qwen3" and arm.overrides == {"temperature": 2} and arm.on_policy == 0
    args = _run_args(tmp_path, "cpu")
    cfg = heal.run_config(arm, 0, args, tmp_path / "student", tmp_path / "p.pt")
    assert cfg["kd_where_agrees"] == "qwen3"
    assert cfg["data"]["ordered"] is True  # paired with the parent's arm, same micro-batches
    from services.supervise.config import run_config_from_dict

    assert run_config_from_dict(cfg).kd_where_agrees == "qwen3"
    with pytest.raises(ValueError, match="must name a tokenizer"):
        heal.parse_heal_arm("pkl@smollm2:agree=")


@pytest.mark.parametrize("bad", ["on_policy=0", "on_policy=1.5", "on_policy=half"])
def test_an_on_policy_share_outside_0_1_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="must be a share in"):
        heal.parse_heal_arm(f"pkl@qwen2.5-coder-0.5b:{bad}")


def test_the_continuations_scorer_is_the_on_policy_arms_teacher_first():
    arms = [heal.parse_heal_arm(a) for a in
            ("ce", "pkl@smollm2", "pkl@gemma3-270m:on_policy=1")]  # fmt: skip
    assert heal.default_scorer(arms) == "gemma3-270m"
    assert heal.default_scorer(arms[:2]) == "smollm2"
    assert heal.default_scorer(arms[:1]) is None


def test_an_on_policy_arm_is_reported_against_its_off_policy_arm_paired_by_seed():
    from benchmarks.quality.heal_report import off_policy_arm, on_policy_section

    assert off_policy_arm("pkl@q:on_policy=0.5") == "pkl@q"
    assert off_policy_arm("pkl@q:temperature=2,on_policy=1") == "pkl@q:temperature=2"
    assert off_policy_arm("pkl@q:temperature=2") is None and off_policy_arm("ce") is None

    def row(arm, seed, held, cont, rollout=None):
        split = {"bits_per_byte": held, "continuation": {"bits_per_byte": cont}}
        r = {"kind": "student", "arm": arm, "seed": seed, "heldout": split, "fresh": split}
        return {**r, "rollout": rollout} if rollout else r

    totals = {"samples": 10, "mean_staleness": 2.0, "dropped_stale": 1,
              "tokens_per_s_per_worker": 800.0}  # fmt: skip
    rows = [
        row("pkl@q", 0, 1.00, 0.30), row("pkl@q", 1, 1.10, 0.20), row("pkl@q", 2, 1.20, 0.25),
        row("pkl@q:on_policy=0.5", 0, 1.02, 0.28, totals),
        row("pkl@q:on_policy=0.5", 1, 1.12, 0.17, {**totals, "mean_staleness": 4.0}),
        row("pkl@q:on_policy=0.5", 9, 2.00, 0.10),  # no off-policy run of seed 9: left out
    ]  # fmt: skip
    md = on_policy_section(rows, ["pkl@q", "pkl@q:on_policy=0.5"])
    line = next(ln for ln in md if ln.startswith("| pkl@q:on_policy=0.5 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["pkl@q:on_policy=0.5", "pkl@q", "2"]
    assert cells[3].startswith("+0.0200 [") and cells[4].startswith("-0.0250 [")
    assert cells[-1] == "20 samples, staleness 3.00, 2 dropped, 800 tok/s"
    assert on_policy_section(rows[:3], ["pkl@q"]) == []  # no on-policy arm: no section


def test_an_arm_of_its_own_learning_rate_trains_at_it_and_the_run_accepts_it(tmp_path):
    # a learning-rate sweep on the validation split: CE and KD arms each at their own lr
    args = _run_args(tmp_path, "cpu")
    ce = heal.parse_heal_arm("ce:lr=0.001")
    assert (ce.base, ce.teacher, ce.lr) == ("ce", None, 0.001)
    kd = heal.parse_heal_arm("pkl@qwen2.5-coder-0.5b:kl_weight=0.5,lr=2.5e-4")
    assert kd.lr == 2.5e-4 and kd.overrides == {"kl_weight": 0.5}
    cfg = heal.run_config(kd, 0, args, tmp_path / "student", tmp_path / "p.pt")
    assert cfg["trainer"]["optim"]["lr"] == 2.5e-4 and "lr" not in cfg["trainer"]["loss"]
    assert heal.run_config(ce, 0, args, tmp_path / "s", None)["trainer"]["optim"]["lr"] == 0.001
    plain = heal.run_config(heal.parse_heal_arm("ce"), 0, args, tmp_path / "s", None)
    assert plain["trainer"]["optim"]["lr"] == 5e-4 and heal.parse_heal_arm("ce").lr is None
    from services.supervise.config import run_config_from_dict

    assert run_config_from_dict(cfg).trainer.optim.lr == 2.5e-4


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("ce:lr=0", "learning rate > 0"),
        ("ce:lr=fast", "learning rate > 0"),
        ("ce:kl_weight=0.5", "only lr=VALUE"),
        ("ce:", "only lr=VALUE"),
        ("gold@qwen2.5-coder-0.5b:lr=-1", "learning rate > 0"),
        ("gold@qwen2.5-coder-0.5b:lr=inf", "learning rate > 0"),
    ],
)
def test_a_learning_rate_that_is_not_a_positive_number_is_refused_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        heal.parse_heal_arm(bad)


def test_a_preset_student_is_built_with_its_tokenizers_vocabulary():
    from benchmarks.quality.heal import student_model

    model = student_model("tiny", 1000)
    assert model.get_input_embeddings().weight.shape[0] == 1000
