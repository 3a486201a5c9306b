"""``data.seed`` + ``data.ordered`` through ``xtoken run``: two CE runs of one config train the same
samples in the same steps and end at the same held-out bits/byte; a KD run of that config (a
teacher claiming ahead) trains the same steps too; the order is the seed's, not the corpus's.
Two trainer ranks (gloo) with one micro-batch each train the steps of one rank with two, and
their per-step losses are the same."""

from __future__ import annotations

import json
import pathlib

import pytest

from services.common.metrics import read_jsonl
from services.supervise.config import DataConfig, QueueConfig, RunCollatorConfig, RunConfig
from services.teacher.config import TeacherConfig
from tests.e2e.conftest import (
    CTX,
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    corpus_parts,
    tiny_trainer,
    trained_records,
    write_config,
)
from xtoken_core.losses import CrossTokenizerLossConfig

TEXTS = 30  # micro_batch 2 x grad_accum 2: 7 steps of 4 and a last one of 2


def _config(
    run_dir: pathlib.Path,
    train: pathlib.Path,
    heldout: pathlib.Path,
    loss: CrossTokenizerLossConfig,
    *,
    trainers: int = 1,
    grad_accum: int = 2,
):
    return RunConfig(
        run_dir=str(run_dir),
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=CTX,
        ctx_teacher=CTX,
        queue=QueueConfig(capacity_bytes=1 << 30),
        trainers=trainers,
        data=DataConfig(train=str(train), heldout=str(heldout), seed=7, ordered=True),
        collator=RunCollatorConfig(workers=1, batch=3),
        teacher=TeacherConfig(model="tiny", transport="shm", max_batch=2, max_length=CTX),
        trainer=tiny_trainer(
            None, loss=loss, feed={"micro_batch": 2, "grad_accum": grad_accum},
            teacher={"verify_logits": False},
        ),
    )  # fmt: skip


def _run(procs, tmp_path, name, config) -> tuple[list[list[str]], float]:
    """Run ``config`` to its end; returns each step's keys and the final held-out bits/byte."""
    path = write_config(tmp_path / f"{name}.json", config)
    run = procs.start(name, ["run", str(path), "--no-progress"], ready=False)
    assert run.wait(280) == 0, run.tail()
    run_dir = pathlib.Path(config.run_dir)
    steps = [r["keys"] for r in sorted(trained_records(run_dir), key=lambda r: r["step"])]
    summary = json.loads((run_dir / "summary.json").read_text())
    return steps, summary["student_after"]["bits_per_byte"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ordered_runs_of_one_seed_train_the_same_steps_with_and_without_a_teacher(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=TEXTS, parts=1)
    ce = CrossTokenizerLossConfig(mode="ce")
    kd = CrossTokenizerLossConfig(mode="pkl", projection=projection)
    heldout = demo.heldout_path
    ce1, bpb1 = _run(procs, tmp_path, "ce1", _config(tmp_path / "ce1", paths[0], heldout, ce))
    ce2, bpb2 = _run(procs, tmp_path, "ce2", _config(tmp_path / "ce2", paths[0], heldout, ce))
    kd1, _ = _run(procs, tmp_path, "kd1", _config(tmp_path / "kd1", paths[0], heldout, kd))
    assert [len(s) for s in ce1] == [4] * 7 + [2]
    assert sorted(k for s in ce1 for k in s) == sorted(corpus)
    assert ce2 == ce1
    assert kd1 == ce1
    assert abs(bpb1 - bpb2) <= 1e-3
    assert set(ce1[0] + ce1[1]) != set(corpus[:8])  # the seed's order, not the file's


def _step_losses(run_dir: pathlib.Path) -> list[float]:
    records = read_jsonl(run_dir / "metrics" / "trainer.rank0.jsonl")
    return [
        r["loss"] for r in sorted(records, key=lambda r: r.get("step", 0)) if r["event"] == "step"
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ordered_ranks_train_the_steps_and_losses_of_one_rank_with_twice_the_accumulation(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=TEXTS, parts=1)
    # every teacher column: P-KL's top-k columns are picked per micro-batch, and the short
    # samples of the last steps pair up differently when one rank sorts both micro-batches
    kd = CrossTokenizerLossConfig(mode="pkl", projection=projection, vocab_topk=None)
    heldout = demo.heldout_path
    one = _config(tmp_path / "one", paths[0], heldout, kd, trainers=1, grad_accum=2)
    two = _config(tmp_path / "two", paths[0], heldout, kd, trainers=2, grad_accum=1)
    _run(procs, tmp_path, "one", one)
    _run(procs, tmp_path, "two", two)
    by_step: dict[int, list[str]] = {}
    for r in trained_records(tmp_path / "two"):
        by_step.setdefault(r["step"], []).extend(r["keys"])
    one_steps = [
        r["keys"] for r in sorted(trained_records(tmp_path / "one"), key=lambda r: r["step"])
    ]
    assert [sorted(by_step[s]) for s in sorted(by_step)] == [sorted(k) for k in one_steps]
    assert sorted(k for keys in by_step.values() for k in keys) == sorted(corpus)
    loss_one, loss_two = _step_losses(tmp_path / "one"), _step_losses(tmp_path / "two")
    assert len(loss_one) == len(loss_two) == 8
    assert loss_two == pytest.approx(loss_one, rel=1e-4)
