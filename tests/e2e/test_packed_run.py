"""``pack`` through ``xtoken run``: a P-KL run of tiny models on packed rows (several
demo-corpus texts per row, a shm teacher, one trainer) finishes, trains every text exactly once in
fewer samples than texts, and its loss and held-out bits/byte go down."""

from __future__ import annotations

import json
import pathlib

import pytest

from services.supervise.config import DataConfig, QueueConfig, RunCollatorConfig, RunConfig
from services.teacher.config import TeacherConfig
from tests.e2e.conftest import (
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    assert_exactly_once,
    corpus_parts,
    step_records,
    tiny_trainer,
    trained_keys,
    write_config,
)
from xtoken_core.data.packing import document_keys

CTX = 1024  # rows of 1024 tokens hold about three demo-corpus texts (~340 tokens each)
TEXTS = 40


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_packed_run_trains_every_text_once_in_fewer_rows(procs, tmp_path, demo, projection):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=TEXTS, parts=1)
    config = RunConfig(
        run_dir=str(tmp_path / "run"),
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=CTX,
        ctx_teacher=CTX,
        queue=QueueConfig(capacity_bytes=1 << 30),
        data=DataConfig(train=str(paths[0]), heldout=str(demo.heldout_path)),
        pack=True,
        collator=RunCollatorConfig(workers=1, batch=TEXTS),
        teacher=TeacherConfig(model="tiny", transport="shm", max_batch=2, max_length=CTX),
        trainer=tiny_trainer(
            projection, feed={"micro_batch": 2}, teacher={"verify_logits": False}
        ),
    )  # fmt: skip
    path = write_config(tmp_path / "packed.json", config)
    run = procs.start("run", ["run", str(path), "--no-progress"], ready=False)
    assert run.wait(560) == 0, run.tail()

    run_dir = pathlib.Path(config.run_dir)
    rows = trained_keys(run_dir)
    assert len(rows) < TEXTS // 2  # several texts per row
    assert_exactly_once([k for row in rows for k in document_keys(row)], corpus)
    losses = [r["loss"] for r in step_records(run_dir, 0)]
    assert len(losses) == -(-len(rows) // 2)
    assert losses[-1] < losses[0], losses
    summary = json.loads((run_dir / "summary.json").read_text())
    after, before = summary["student_after"], summary["student_before"]
    assert after["bits_per_byte"] < before["bits_per_byte"], summary
