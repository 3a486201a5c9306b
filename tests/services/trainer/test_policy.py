"""The trainer's weight publication for its rollout workers, read back by a real subscriber: at
the start and every ``sync_every`` steps, and after an off-policy start only from the first step
whose samples are still fresh when the on-policy share begins."""

from __future__ import annotations

import types

import torch

from services.protocol.names import policy_dir
from services.trainer.policy import PolicyPublisher
from services.trainer.sections import OnPolicyConfig
from xtoken_core.ipc.policy_weights import WeightSubscriber


def student(step: int = 0):
    """What the publisher reads of a student: its compute model, device, step, rank, sharding."""
    model = torch.nn.Linear(3, 2)
    return types.SimpleNamespace(
        compute=model, device=torch.device("cpu"), step=step, rank=0, sharded=False
    )


def published(on_policy: OnPolicyConfig, tmp_path, steps: int) -> list[int | None]:
    """The newest version a subscriber sees after the start and after each of ``steps``."""
    s = student()
    publisher = PolicyPublisher.create(s, on_policy, tmp_path)
    subscriber = WeightSubscriber(policy_dir(tmp_path))
    try:
        publisher.start()
        seen = [subscriber.newest()]
        for _ in range(steps):
            s.step += 1
            publisher.after_step()
            seen.append(subscriber.newest())
        return seen
    finally:
        subscriber.close()
        publisher.close()


def test_the_weights_go_out_at_the_start_and_every_sync_every_steps(tmp_path):
    op = OnPolicyConfig(fraction=0.5, sync_every=2, weights="shm")
    assert published(op, tmp_path, 4) == [0, 0, 2, 2, 4]


def test_after_an_off_policy_start_the_first_weights_go_out_when_their_samples_stay_fresh(
    tmp_path,
):
    # start at step 7, samples at most 1 publication (3 steps) old: first weights at step 4,
    # then on the multiples of 3
    op = OnPolicyConfig(fraction=0.5, start_step=7, max_staleness=1, sync_every=3, weights="shm")
    assert published(op, tmp_path, 7) == [None, None, None, None, 4, 4, 6, 6]


def test_a_resume_past_the_first_publication_publishes_at_once(tmp_path):
    op = OnPolicyConfig(fraction=0.5, start_step=7, max_staleness=1, sync_every=3, weights="shm")
    s = student(step=5)
    publisher = PolicyPublisher.create(s, op, tmp_path)
    subscriber = WeightSubscriber(policy_dir(tmp_path))
    try:
        publisher.start()
        assert subscriber.newest() == 5
    finally:
        subscriber.close()
        publisher.close()
