"""``xtoken run`` as a process: a SIGTERM mid-training stops every process it started cleanly."""

from __future__ import annotations

import json
import pathlib
import re
import signal

import pytest

from services.collator.cli import EXIT_STOPPED
from services.supervise.config import DataConfig, QueueConfig, RunCollatorConfig, RunConfig
from services.teacher.config import TeacherConfig
from tests.e2e.conftest import (
    CTX,
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    checkpoint_keys,
    corpus_parts,
    descendants,
    latest_checkpoint,
    pid_alive,
    step_records,
    tiny_run_config,
    tiny_trainer,
    trained_keys,
    wait_for,
    write_config,
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_on_xtoken_run_checkpoints_exits_zero_and_leaves_no_process(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=96, parts=1)
    run_dir = tmp_path / "run"
    config = tiny_run_config(run_dir, paths[0], str(demo.heldout_path), projection)
    steps_in_data = len(corpus) // (2 * 4 * 2)  # ranks x micro_batch x grad_accum
    run = procs.start("run", ["run", str(write_config(tmp_path / "run.json", config)),
                              "--no-progress"], ready=False)

    wait_for(lambda: step_records(run_dir, 0), 180, "the first trained step")
    started = descendants(run.pid)  # queue, teacher, trainers (and the collator if not done)
    ready = {p.name: json.loads(p.read_text())["pid"] for p in (run_dir / "ready").iterdir()}
    assert set(ready.values()) <= started and len(ready) == 4, (ready, started)
    teacher = ready["teacher0"]
    run.signal(signal.SIGTERM)
    assert run.wait(120) == 0, run.tail()

    left = sorted(p for p in started if pid_alive(p))
    assert not left, f"processes left behind: {left}"
    for log in sorted((run_dir / "logs").glob("*.log")):  # queue, teacher, trainers: stopped
        codes = re.findall(r"stopped \(SIGTERM\), exit code (\d+)", log.read_text())
        # a collator stopped before the end of its data says so (services/collator/cli.py)
        stopped = [str(EXIT_STOPPED)] if log.name.startswith("collator") else ["0"]
        assert codes in ([], stopped), f"{log.name}: exit codes {codes}"
    assert not list(pathlib.Path("/dev/shm").glob(f"xtk_{teacher}_*")), "the ring is left behind"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] and summary["step"] < steps_in_data, summary
    checkpoint = latest_checkpoint(run_dir)  # checkpoint_every=0: written by the stop
    assert checkpoint is not None and checkpoint.name == f"step_{summary['step']:08d}"
    trained = trained_keys(run_dir)
    assert len(trained) == len(set(trained))
    assert checkpoint_keys(checkpoint) == set(trained)  # the checkpoint is the truth of it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_run_trains_each_sample_once_evaluates_and_exports_a_loadable_student(
    procs, tmp_path, demo, projection
):
    import torch
    import transformers

    paths, corpus = corpus_parts(demo, tmp_path / "data", n=32, parts=1)
    run_dir = tmp_path / "run"
    config = RunConfig(
        run_dir=str(run_dir),
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=CTX,
        ctx_teacher=CTX,
        queue=QueueConfig(capacity_bytes=1 << 30),
        trainers=2,
        data=DataConfig(train=str(paths[0]), heldout=str(demo.heldout_path)),
        collator=RunCollatorConfig(workers=1, batch=16),
        teacher=TeacherConfig(model="tiny", transport="shm", max_batch=4, max_length=CTX),
        trainer=tiny_trainer(
            projection, compute={"parallel": "fsdp"},
            schedule={"checkpoint_every": 2, "export": True}, teacher={"verify_logits": False},
        ),
    )
    run = procs.start("run", ["run", str(write_config(tmp_path / "run.json", config)),
                              "--no-progress"], ready=False)
    assert run.wait(240) == 0, run.tail()
    keys = trained_keys(run_dir)
    assert sorted(keys) == sorted(set(keys)) and set(keys) == set(corpus)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["student_after"]["bits_per_byte"] < summary["student_before"]["bits_per_byte"]
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
