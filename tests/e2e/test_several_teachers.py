"""``xtoken run`` of two teachers of different tokenizer families as real processes: the run
completes, every sample is trained exactly once, and each step records each teacher's KD term."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tests.e2e.conftest import (
    assert_exactly_once,
    corpus_parts,
    feed_totals,
    step_records,
    tiny_run_config,
    trained_keys,
    write_config,
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_teacher_run_trains_each_sample_once_and_records_each_teachers_kd_term(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=32, parts=1)
    run_dir = tmp_path / "run"
    config = tiny_run_config(run_dir, paths[0], str(demo.heldout_path), projection)
    # teacher 1 speaks Qwen3's tokenizer; the teacher section's transport, batch and checksums
    # are its defaults; its projection (mistral -> qwen3) is built by the run
    second = {"tokenizer": "qwen3", "model": "tiny", "weight": 0.5}
    config = dataclasses.replace(config, extra_teachers=[second])
    run = procs.start("run", ["run", str(write_config(tmp_path / "run.json", config)),
                              "--no-progress"], ready=False)  # fmt: skip
    assert run.wait(240) == 0, run.tail()

    assert_exactly_once(trained_keys(run_dir), corpus)
    teacher1 = (run_dir / "logs" / "t1.teacher0.log").read_text()
    assert "serving train.t1.teacher0 (tiny, shm on cpu)" in teacher1, teacher1[-2000:]
    sections = json.loads((run_dir / "config" / "t1.teacher0.json").read_text())
    assert (sections["teacher"], sections["tokenizer"]) == (1, "qwen3")
    for rank in (0, 1):
        steps = step_records(run_dir, rank)
        assert steps, f"rank {rank} recorded no step"
        for record in steps:
            for name in ("teacher0_kl_loss", "teacher1_kl_loss"):
                assert math.isfinite(record[name]) and record[name] > 0, (name, record)
            assert record["teacher1_num_valid_chunks"] > 0
    assert feed_totals(run_dir).get("checksum_mismatch", 0) == 0
    assert (run_dir / "metrics" / "t1.teacher.group0.jsonl").is_file()
