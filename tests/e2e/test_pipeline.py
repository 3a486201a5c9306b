"""A whole distillation run of real processes started by their CLIs: queue, two collators, one shm
teacher, two gloo trainer ranks; rank 0 reports to TensorBoard and exports the student."""

from __future__ import annotations

import pathlib
import signal

import pytest

from tests.e2e.conftest import (
    assert_exactly_once,
    corpus_parts,
    evals,
    feed_totals,
    rings_in_flight,
    step_records,
    trained_keys,
)


@pytest.mark.timeout(120)
def test_pipeline_trains_every_sample_once_and_every_process_exits_cleanly(pipeline, demo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoTokenizer

    paths, corpus = corpus_parts(demo, pipeline.root / "data", n=44, parts=2)
    queue = pipeline.start_queue()
    teacher = pipeline.start_teacher(pipeline.teacher_config())
    trainers = pipeline.start_trainers(
        pipeline.trainer_config(
            eval={"heldout": pipeline.heldout},
            observe={"report_to": ["tensorboard"]},
            schedule={"export": True},
        )
    )
    collators = [pipeline.start_collator(f"collator{i}", p) for i, p in enumerate(paths)]

    for c in collators:
        assert c.wait(60) == 0, c.tail()
    assert pipeline.put_eof() == len(corpus)
    for t in trainers:
        assert t.wait(60) == 0, t.tail()
    for p in (teacher, queue):  # servers run until told to stop; together, like a run stops
        p.signal(signal.SIGTERM)
    for p in (teacher, queue):
        assert p.wait(20) == 0, p.tail()
    assert rings_in_flight(teacher) == [[], []]  # every slot released by its trainer
    assert not list(pathlib.Path("/dev/shm").glob(f"xtk_{teacher.pid}_*")), "the ring is left behind"

    run_dir = pipeline.run_dir
    assert_exactly_once(trained_keys(run_dir), corpus)
    counters = feed_totals(run_dir)
    assert counters["checksum_mismatch"] == 0, counters
    before_after = evals(run_dir)
    assert before_after["after"] < before_after["before"], before_after
    losses = [r["loss"] for r in step_records(run_dir, 0)]
    assert losses[-1] < losses[0], losses
    # each step says how long the host spent in Python's garbage collector since the step
    # before: with the default schedule (gc_every 50) no collection falls in a run this short
    gcs = [(r["gc_s"], r["gc_full"]) for r in step_records(run_dir, 0)]
    assert gcs == [(0.0, 0)] * len(gcs), gcs

    # rank 0 alone writes TensorBoard events: the JSONL's metrics, same names, values and steps
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for name in ("step/loss", "step/kl_loss", "step/lr", "step/grad_norm", "step/tokens_per_s",
                 "step/times/forward", "step/memory_mb"):  # fmt: skip
        field = name.split("/")
        jsonl = [(r["step"], r[field[1]] if len(field) == 2 else r[field[1]][field[2]])
                 for r in step_records(run_dir, 0)]  # fmt: skip
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in jsonl], name
    bpb = [e.value for e in events.Scalars("eval/bits_per_byte")]
    assert bpb == [pytest.approx(before_after["before"]), pytest.approx(before_after["after"])]

    final = run_dir / "final"  # the student, its tokenizer and its card
    names = {p.name for p in final.iterdir()}
    assert {"README.md", "generation_config.json", "tokenizer.json"} <= names
    assert AutoTokenizer.from_pretrained(final, local_files_only=True)("a b")["input_ids"]
