"""The mixed feed on a real queue: each step takes its on-policy share from the rollout partition
and the rest from the collators' partition; a stale on-policy sample is dropped (acked, counted)
and never trained, at its claim or when its step starts; CE is masked on the tokens the student
sampled; what was not trained goes back."""

from __future__ import annotations

import math
import types

import pytest
import torch

from services.collator.worker import samples_to_put_fields
from services.protocol import ROLLOUT_FIELDS, ROLLOUT_TASK, put_eof, rollout_partition
from services.protocol.rollout import rollout_values
from services.queue.client import QueueClient
from services.trainer.on_policy import OnPolicyFeed
from services.trainer.sections import OnPolicyConfig
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup

PARTITION = "train"
ROLLOUTS = rollout_partition(PARTITION)
PROMPT = 3  # student tokens of each on-policy sample's prompt


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


def trainer(step: int = 0):
    """The trainer's step count, as the feed reads it (the version of the weights it trains)."""
    return types.SimpleNamespace(step=step)


def config(grad_accum: int = 2, **on_policy):
    """Micro-batches of 2, steps of ``grad_accum`` micro-batches."""
    values = {"fraction": 0.5, "sync_every": 1, "max_staleness": 2, **on_policy}
    return setup.trainer_config(
        None,
        queue="",
        partition=PARTITION,
        feed={"grad_accum": grad_accum, "claim_timeout_s": 0.2},
        schedule={"max_steps": 10},
        loss={"mode": "pkl", "projection": "unused.pt"},
        on_policy=OnPolicyConfig(**values),
    )


def put_off_policy(client, n: int) -> list[str]:
    samples = [setup.samples()[i % len(setup.samples())] for i in range(n)]
    keys = [f"off{i}" for i in range(n)]
    client.put(PARTITION, keys, samples_to_put_fields(samples))
    return keys


def put_on_policy(client, versions: list[int], prefix: str = "on") -> list[str]:
    samples = []
    for i, version in enumerate(versions):
        sample = dict(setup.samples()[i % len(setup.samples())])
        sample.update(
            rollout_values(
                policy_version=version, prompt_length=PROMPT, teacher_prompt_length=2,
                scored_bytes=10,
            )
        )  # fmt: skip
        samples.append(sample)
    fields = samples_to_put_fields(samples)
    for name in ROLLOUT_FIELDS:
        fields[name] = torch.stack([s[name] for s in samples])
    keys = [f"{prefix}{i}" for i in range(len(versions))]
    client.put(ROLLOUTS, keys, fields)
    return keys


def feed_of(client, cfg, trainer) -> OnPolicyFeed:
    pads = {"student_pad_id": 0, "teacher_pad_id": 0}
    return OnPolicyFeed(
        client, cfg.feed, pads, "trainer/e0/s0", set(), on_policy=cfg.on_policy,
        version=lambda: trainer.step, **setup.feed_settings(cfg),
    )  # fmt: skip


def test_the_share_rounds_and_keeps_one_on_policy_sample():
    shares = [OnPolicyConfig(fraction=f).share(4) for f in (0.0, 0.1, 0.5, 0.6, 1.0)]
    assert shares == [0, 1, 2, 2, 4]


def test_each_step_mixes_the_on_policy_share_with_off_policy_samples(queue):
    with QueueClient(queue, timeout_s=10) as client:
        off = put_off_policy(client, 8)
        on = put_on_policy(client, [0] * 8)
        feed = feed_of(client, config(fraction=0.25), trainer())
        # a claim ahead of two steps still gets one whole step: 2 x 2 samples, 1 on-policy
        step = feed.claim(4, block=True)
        assert len(step) == 2
        keys = [k for c in step for k in c.keys]
        assert len(keys) == 4 and len(set(keys) & set(on)) == 1 and len(set(keys) & set(off)) == 3
        feed.start_step(step)
        feed.ack(step)
        assert client.status(ROLLOUTS, ROLLOUT_TASK)["dropped"] == 1  # consumed once: dropped
        assert feed.trained == set(keys) & set(off)  # only off-policy keys go to the checkpoint
        stats = feed.step_stats()
        assert stats["samples"] == 1 and stats["mean_staleness"] == 0.0
        assert stats["dropped_stale"] == 0


def test_the_tokens_the_student_sampled_get_no_ce_unless_asked(queue):
    with QueueClient(queue, timeout_s=10) as client:
        put_on_policy(client, [0] * 4)
        for ce in (False, True):
            feed = feed_of(client, config(fraction=1.0, ce=ce), trainer())  # steps of 4
            step = feed.claim(1, block=True)
            for c in step:
                mask = c.batch["token_mask"]
                lengths = c.batch["input_lengths"]
                for b in range(len(c.keys)):
                    want = torch.arange(mask.shape[1]) < (lengths[b] if ce else PROMPT)
                    assert torch.equal(mask[b], want), (ce, b)
            feed.give_back(step)


def test_a_sample_too_old_or_from_the_future_is_dropped_at_its_claim(queue):
    with QueueClient(queue, timeout_s=10) as client:
        # the trainer holds the weights of step 10; max_staleness 2 x sync_every 2: 4 steps
        on = put_on_policy(client, [5, 11, 10, 6, 8])
        feed = feed_of(client, config(1, fraction=1.0, sync_every=2), trainer(step=10))
        assert feed.claim(1, block=True) is None  # versions 5 (3 publications behind) and 11
        assert feed.dropped_stale == 2
        assert client.status(ROLLOUTS, ROLLOUT_TASK)["dropped"] == 2  # acked: consumed
        step = feed.claim(1, block=True)
        assert sorted(k for c in step for k in c.keys) == [on[2], on[3]]
        feed.start_step(step)
        stats = feed.step_stats()
        assert stats["samples"] == 2 and stats["mean_staleness"] == pytest.approx((0 + 2) / 2 / 1)


def test_a_sample_gone_stale_before_its_step_starts_is_masked_and_not_trained(queue):
    with QueueClient(queue, timeout_s=10) as client:
        on = put_on_policy(client, [4, 5])
        at = trainer(step=5)
        feed = feed_of(client, config(1, fraction=1.0), at)
        step = feed.claim(1, block=True)  # fresh when claimed
        at.step = 7  # two steps later (claimed ahead): version 4 is 3 behind, > 2
        feed.start_step(step)
        (c,) = step
        rows = {k: b for b, k in enumerate(c.keys)}
        assert float(c.batch["sample_mask"][rows[on[0]]]) == 0.0  # no loss, no gradient
        assert float(c.batch["sample_mask"][rows[on[1]]]) == 1.0
        assert feed.trained_keys(c) == [on[1]]  # the keys log names only what was trained
        feed.ack(step)
        status = client.status(ROLLOUTS, ROLLOUT_TASK)
        assert status["dropped"] == 2 and status["pending"] == 0  # both consumed
        assert feed.step_stats()["dropped_stale"] == 1


def test_a_step_waits_for_its_on_policy_share_and_gives_everything_back_on_stop(queue):
    with QueueClient(queue, timeout_s=10) as client:
        put_off_policy(client, 4)
        feed = feed_of(client, config(fraction=0.5), trainer())
        assert feed.claim(2, block=True) is None  # the off-policy share came, no rollout yet
        assert feed.step_stats()["wait_s"] > 0
        on = put_on_policy(client, [0])
        assert feed.claim(2, block=True) is None  # 1 of 2 on-policy samples
        held = client.status(PARTITION, "trainer/e0/s0")
        assert held["leased"] == 2
        feed.give_back([])
        assert client.status(PARTITION, "trainer/e0/s0")["leased"] == 0
        assert client.status(ROLLOUTS, ROLLOUT_TASK)["pending"] == len(on)


def test_the_last_step_of_the_data_keeps_the_mix(queue):
    with QueueClient(queue, timeout_s=10) as client:
        off = put_off_policy(client, 5)
        put_on_policy(client, [0] * 6)
        put_eof(client, PARTITION, 5)
        feed = feed_of(client, config(fraction=0.5), trainer())
        steps = []
        while not feed.ended:
            got = feed.claim(2, block=True)
            if got:
                feed.start_step(got)
                feed.ack(got)
                steps.append([k for c in got for k in c.keys])
        assert [len(s) for s in steps] == [4, 4, 2]  # 2 + 2, 2 + 2, then 1 + 1
        assert sorted(k for s in steps for k in s if k.startswith("off")) == sorted(off)


def test_the_steps_of_an_off_policy_start_take_no_on_policy_share_then_each_step_does(queue):
    with QueueClient(queue, timeout_s=10) as client:
        off = put_off_policy(client, 12)
        put_on_policy(client, [2] * 4)  # fresh at steps 3 and 4 (max_staleness 2)
        t = trainer(step=1)  # a feed opened at step 1 (a resume): its first claim is step 1
        feed = feed_of(client, config(fraction=0.5, start_step=3), t)
        kinds = []
        for _ in range(4):  # steps 1, 2 (the start), then 3, 4 (half on-policy)
            step = feed.claim(4, block=True)
            feed.start_step(step)
            feed.ack(step)
            keys = [k for c in step for k in c.keys]
            kinds.append(sum(k.startswith("on") for k in keys))
            t.step += 1
        assert kinds == [0, 0, 2, 2]
        assert len(feed.trained) == 4 + 4 + 2 + 2 and feed.trained <= set(off)


def test_the_last_step_of_an_off_policy_start_takes_what_is_left_off_policy(queue):
    with QueueClient(queue, timeout_s=10) as client:
        put_off_policy(client, 3)
        put_eof(client, PARTITION, 3)
        feed = feed_of(client, config(fraction=0.5, start_step=5), trainer())
        steps = []
        while not feed.ended:
            got = feed.claim(2, block=True)
            if got:
                feed.ack(got)
                steps.append([k for c in got for k in c.keys])
        assert [len(s) for s in steps] == [3]  # no on-policy share before step 5, even here


def test_the_start_step_moves_the_share_and_the_first_weights_for_the_rollout_workers():
    op = OnPolicyConfig(fraction=0.5, start_step=10, max_staleness=2, sync_every=3)
    assert [op.share(4, step) for step in (0, 9, 10, 11)] == [0, 0, 2, 2]
    assert op.share(4) == 2  # a step past the start
    assert op.first_publication == 4  # samples of step 4's weights: 2 publications old at 10
    assert OnPolicyConfig(fraction=0.5, start_step=3, max_staleness=4).first_publication == 0


def test_the_teacher_log_prob_of_the_continuations_is_measured(queue):
    with QueueClient(queue, timeout_s=10) as client:
        put_on_policy(client, [0, 0])
        feed = feed_of(client, config(1, fraction=1.0), trainer())
        (c,) = feed.claim(1, block=True)
        feed.start_step([c])
        logits = setup.teacher_logits(c.batch)
        assert feed.score(c, logits) is logits
        ids, lengths = c.batch["teacher_input_ids"], c.batch["teacher_input_lengths"]
        want = 0.0
        for b in range(2):
            lp = torch.log_softmax(logits[b].double(), dim=-1)
            want += sum(float(lp[u - 1, ids[b, u]]) for u in range(2, int(lengths[b])))
        got = feed.step_stats()["teacher_logprob_per_byte"]
        assert math.isclose(got, want / 20, rel_tol=1e-4)  # 10 scored bytes each
