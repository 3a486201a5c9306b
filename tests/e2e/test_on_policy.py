"""On-policy distillation with real processes: ``xtoken run examples/on_policy.yaml`` (half of
each step sampled by a rollout worker with the trainer's weights) trains every off-policy sample
once and each on-policy sample at most once, never one staler than allowed; a rollout worker
SIGKILLed mid-batch and restarted loses no prompt and stores no sample twice."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal

import pytest

from services.common.metrics import read_jsonl
from services.protocol import ROLLOUT_FIELDS, ROLLOUT_TASK, rollout_partition
from services.rollout.config import RolloutConfig
from services.rollout.prompts import PromptSource
from services.supervise.config import load_run_config
from tests.e2e.conftest import (
    ROOT,
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    assert_exactly_once,
    corpus_parts,
    evals,
    pid_alive,
    step_records,
    trained_records,
    wait_for,
    write_config,
)
from xtoken_core.data import sample as schema

EXAMPLE = ROOT / "examples" / "on_policy.yaml"


def _run_example(procs, tmp_path, demo, **extra: str) -> tuple[pathlib.Path, list]:
    """``xtoken run examples/on_policy.yaml`` on 16 demo texts (``extra``: more ``--set``
    pairs, dots as ``__``); returns the run dir and the corpus once the run ended with 0."""
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=16, parts=1)
    run_dir = tmp_path / "run"
    sets = {
        "data.train": str(paths[0]),
        "data.heldout": str(demo.heldout_path),
        "data.limit": "null",
        "trainer.schedule.export": "false",
        "trainer.schedule.checkpoint_every": "0",
        **{key.replace("__", "."): value for key, value in extra.items()},
    }
    argv = ["run", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    run = procs.start("run", argv, ready=False)
    assert run.wait(170) == 0, run.tail()
    return run_dir, corpus


@pytest.mark.slow  # ~60 s of real processes; CI keeps tests/e2e/test_pipeline.py: `pytest -m slow`
@pytest.mark.timeout(180)
def test_an_on_policy_run_mixes_each_step_and_trains_each_sample_once(procs, tmp_path, demo):
    run_dir, corpus = _run_example(procs, tmp_path, demo)

    config = load_run_config(EXAMPLE)
    step_size = config.trainer.feed.micro_batch * config.trainer.feed.grad_accum
    # the trainer's on-policy settings as the run hands them to it (its fraction: the data's)
    on_policy = dataclasses.replace(
        config.trainer.on_policy, fraction=config.data.on_policy_fraction
    )
    share = on_policy.share(step_size)
    records = trained_records(run_dir)
    off = [k for r in records for k in r["keys"] if not k.startswith("p")]
    on = [k for r in records for k in r["keys"] if k.startswith("p")]
    assert_exactly_once(off, corpus)  # the collator's samples: exactly once, as without rollouts
    assert on and len(on) == len(set(on))  # on-policy samples: each trained once at most
    steps = step_records(run_dir, 0)
    assert len(steps) == len(corpus) // (step_size - share)
    for step, record in zip(steps, records, strict=True):
        op = step["on_policy"]
        mine = [k for k in record["keys"] if k.startswith("p")]
        assert len(mine) == op["samples"] <= share  # the rest of the share dropped as stale
        assert len(record["keys"]) == step_size - (share - op["samples"])
        if op["samples"]:
            assert op["mean_staleness"] <= config.trainer.on_policy.max_staleness
            assert op["teacher_logprob_per_byte"] < 0
        # the step's wait for rollouts is inside its data wait (also across tries that found
        # no whole step): a step's time holds every wait before it
        assert op["wait_s"] <= step["times"]["data_wait"] + 1e-3, (op, step["times"])
    dropped = steps[-1]["on_policy"]["dropped_stale"]
    assert len(on) + dropped >= share * len(steps)
    generated = [r for r in read_jsonl(run_dir / "metrics" / "rollout0.jsonl")]
    assert generated and all(r["generated_tokens"] > 0 for r in generated)
    assert {r["version"] for r in generated} > {0}  # the rollout followed the trainer's weights
    before_after = evals(run_dir)
    assert before_after["after"] < before_after["before"], before_after


@pytest.mark.slow  # ~60 s of real processes: `pytest -m slow`
@pytest.mark.timeout(180)
def test_an_off_policy_start_trains_its_first_steps_from_the_collator_alone(procs, tmp_path, demo):
    # steps 0 and 1 off-policy only; the rollout worker's first weights are step 1's (samples at
    # most one publication old at step 2)
    run_dir, corpus = _run_example(
        procs, tmp_path, demo, trainer__on_policy__start_step="2",
        trainer__on_policy__max_staleness="1",
    )  # fmt: skip
    records = trained_records(run_dir)
    on = [[k for k in r["keys"] if k.startswith("p")] for r in records]
    assert on[:2] == [[], []] and any(on[2:])
    off = [k for r in records for k in r["keys"] if not k.startswith("p")]
    assert_exactly_once(off, corpus)
    assert [len(r["keys"]) for r in records[:2]] == [4, 4]  # whole steps from the collator
    generated = read_jsonl(run_dir / "metrics" / "rollout0.jsonl")
    assert generated and min(r["version"] for r in generated) >= 1
    steps = step_records(run_dir, 0)
    assert [s["on_policy"]["samples"] for s in steps[:2]] == [0, 0]


# ----------------------------------------------------------------------------- SIGKILL


def _rollout_config(
    queue: str, tmp_path: pathlib.Path, prompts: pathlib.Path, kv_cache: str = "dynamic"
) -> RolloutConfig:
    return RolloutConfig(
        kv_cache=kv_cache,
        queue=queue,
        partition="train",
        student="tiny",
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=96,
        ctx_teacher=96,
        weights=str(tmp_path / "policy"),
        prompts=str(prompts),
        prompt_tokens=8,
        max_new_tokens=64,
        batch=2,
        max_pending=1000,
        state_dir=str(tmp_path / "state"),
        poll_s=0.05,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_a_rollout_worker_killed_mid_batch_loses_no_prompt_and_stores_no_sample_twice(
    procs, pipeline, tmp_path, demo, kv_cache
):
    import torch

    from services.queue.client import QueueClient
    from xtoken_core.ipc.policy_weights import WeightPublisher
    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    paths, _ = corpus_parts(demo, tmp_path / "data", n=40, parts=1)
    pipeline.start_queue()
    config = _rollout_config(pipeline.queue, tmp_path, paths[0], kv_cache)
    student = load_tokenizer(STUDENT_TOKENIZER)
    model = load_model("tiny", vocab_size=student.vocab_size, seed=3)
    path = write_config(tmp_path / "config" / "rollout.json", config)
    metrics = pipeline.run_dir / "metrics" / "rollout0.jsonl"
    argv = ["rollout", "--config", str(path), "--run-dir", str(pipeline.run_dir)]
    partition = rollout_partition("train")
    with WeightPublisher(config.weights, model.named_parameters(), transport="shm") as pub:
        pub.publish(model.named_parameters(), version=0)
        first = procs.start("rollout-a", argv)
        first.wait_ready(120)
        # SIGKILL while it samples its third batch: two were put (and their position kept)
        wait_for(lambda: len(read_jsonl(metrics)) >= 2 if metrics.exists() else False, 120,
                 "two batches put")  # fmt: skip
        assert first.kill() == -signal.SIGKILL
        assert not pid_alive(first.pid)
        kept = json.loads((tmp_path / "state" / "worker0.json").read_text())
        with QueueClient(pipeline.queue, timeout_s=10) as client:
            at_kill = client.list(partition)["keys"]
        second = procs.start("rollout-b", argv)
        second.wait_ready(120)
        wait_for(lambda: len(read_jsonl(metrics)) >= 5, 120, "three more batches")
        second.signal(signal.SIGTERM)
        assert second.wait(60) == 0, second.tail()
        with QueueClient(pipeline.queue, timeout_s=10) as client:
            keys = client.list(partition)["keys"]
            got = client.claim(
                partition, ROLLOUT_TASK, (*schema.FIELD_NAMES, *ROLLOUT_FIELDS), len(keys) + 1
            )
    # the prompts in order, none skipped, none twice: the batch killed mid-way came again
    expected = [p.key for p, _ in zip(PromptSource(str(paths[0]), student, 8), range(len(keys)))]
    assert sorted(keys) == sorted(expected), (keys, expected)
    assert set(at_kill) <= set(keys) and len(keys) > len(at_kill)
    assert kept["index"] <= len(at_kill) + 2  # at most the batch put as it died was not kept
    from xtoken_core.data_plane.codec import columns_to_samples

    samples = columns_to_samples(got["fields"])
    assert len(samples) == len(keys)
    for sample in samples:  # whole samples only: a put is one message
        schema.validate_sample(sample)
        assert int(sample["policy_version"]) == 0
        assert int(sample["input_lengths"]) >= int(sample["prompt_lengths"]) >= 1
    assert torch.is_tensor(samples[0]["input_ids"])


@pytest.mark.slow  # a second on-policy run of real processes (~30 s): `pytest -m slow`
@pytest.mark.timeout(180)
def test_a_trainer_waiting_for_rollouts_counts_every_wait_in_the_next_steps_data_wait(
    procs, tmp_path, demo
):
    """Every sample on-policy, claims that give up after 0.2 s: the trainer tries several times
    per step while the rollout samples. Each step record's data wait holds all of it (it held
    only the last try's, so a trainer starved by its rollouts reported ~0% waiting)."""
    run_dir, _ = _run_example(
        procs, tmp_path, demo, data__on_policy_fraction="1.0", trainer__feed__claim_timeout_s="0.2",
        trainer__schedule__max_steps="4", rollout__max_new_tokens="48",
    )  # fmt: skip
    steps = step_records(run_dir, 0)
    assert len(steps) == 4
    waits = [(s["on_policy"]["wait_s"], s["times"]["data_wait"]) for s in steps]
    assert all(wait <= data_wait + 1e-3 for wait, data_wait in waits), waits
    assert sum(wait for wait, _ in waits) > 0.2, waits  # it did wait past one try
