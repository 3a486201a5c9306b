"""SampleFeed's ordered mode on a real queue: each step is the next micro_batch x grad_accum
samples in put order, sorted only within the step, whatever the puts' sizes and timing and the
claims' sizes; the last step of the data is short; samples of a step being gathered go back on a
stop."""

from __future__ import annotations

import time

import pytest

from services.collator.worker import samples_to_put_fields
from services.protocol import put_eof
from services.queue.client import QueueClient
from services.trainer.samples import SampleFeed
from tests.services.queue.conftest import ServerProcess
from tests.services.trainer import distill_setup as setup

PARTITION = "train"
PADS = {"student_pad_id": 0, "teacher_pad_id": 0}
N = 11  # micro_batch 2 x grad_accum 2: steps of 4, 4 and a last one of 3


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


def _samples():
    base = setup.samples()
    return [base[i % len(base)] for i in range(N)]


def _feed(client, config, task: str, trained=(), **kwargs) -> SampleFeed:
    """The sample feed of ``config`` as the trainer opens it (its feed section, the run's
    partition); ``kwargs``: ``rank``, ``ranks``."""
    return SampleFeed(
        client, config.feed, PADS, task, set(trained), **setup.feed_settings(config), **kwargs
    )


def _put(client, first: int, count: int) -> None:
    samples = _samples()[first : first + count]
    keys = [f"k{i:02d}" for i in range(first, first + count)]
    client.put(PARTITION, keys, samples_to_put_fields(samples))


def _steps(queue: str, task: str, put_sizes: list[int], *, ahead: int) -> list[list[list[str]]]:
    """Train through an ordered feed: puts of ``put_sizes`` interleaved with claims of
    ``ahead`` micro-batches that do not wait; returns each step's micro-batches' keys."""
    config = setup.trainer_config(
        None,
        queue=queue,
        partition=PARTITION,
        feed={"grad_accum": 2, "ordered": True, "claim_timeout_s": 0.2},
    )
    steps: list[list[list[str]]] = []
    with QueueClient(queue, timeout_s=10) as client:
        feed = _feed(client, config, task)
        put = 0
        for size in put_sizes:
            if put < N:
                _put(client, put, min(size, N - put))
                put += min(size, N - put)
            got = feed.claim(ahead, block=False)  # a claim ahead, as the feed's top-up does
            if got:
                steps.append([c.keys for c in got])
                feed.ack(got)
        if put == N:
            put_eof(client, PARTITION, N)
        while not feed.ended:
            got = feed.claim(ahead, block=True)
            if got:
                steps.append([c.keys for c in got])
                feed.ack(got)
    return steps


@pytest.mark.timeout(60)
def test_ordered_steps_are_the_next_samples_in_put_order_whatever_the_timing(queue):
    teacher_len = {f"k{i:02d}": int(s["teacher_input_lengths"]) for i, s in enumerate(_samples())}
    one_put = _steps(queue, "a", [N], ahead=4)
    drip = _steps(queue, "b", [1, 2, 1, 3, 1, 3], ahead=1)
    assert drip == one_put
    assert [len(sum(step, [])) for step in one_put] == [4, 4, 3]
    for step, start in zip(one_put, (0, 4, 8)):
        keys = sum(step, [])
        assert sorted(keys) == [f"k{i:02d}" for i in range(start, min(start + 4, N))]
        lengths = [teacher_len[k] for k in keys]
        assert lengths == sorted(lengths, reverse=True)  # sorted within the step only
        assert [len(mb) for mb in step] == [2] * (len(keys) // 2) + [1] * (len(keys) % 2)


@pytest.mark.timeout(60)
def test_without_ordered_a_claim_mixes_what_is_ready_across_steps(queue):
    """What ordered mode fixes: the plain feed sorts whatever one claim brought."""
    config = setup.trainer_config(None, queue=queue, partition=PARTITION, feed={"grad_accum": 2})
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, N)
        feed = _feed(client, config, "t")
        got = feed.claim(6, block=True)  # 6 micro-batches ahead: 11 samples sorted together
    keys = [k for c in got for k in c.keys]
    assert len(keys) == N
    assert sorted(keys[:4]) != [f"k{i:02d}" for i in range(4)]


@pytest.mark.timeout(60)
def test_a_step_being_gathered_is_given_back_on_a_stop(queue):
    config = setup.trainer_config(
        None,
        queue=queue,
        partition=PARTITION,
        feed={"grad_accum": 2, "ordered": True, "claim_timeout_s": 0.2},
    )
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, 3)  # less than a step
        feed = _feed(client, config, "t")
        assert feed.claim(2, block=True) is None
        assert client.status(PARTITION, "t")["leased"] == 3
        feed.give_back([])
        assert client.status(PARTITION, "t")["leased"] == 0
        assert not feed.ended


@pytest.mark.timeout(60)
def test_a_sample_whose_lease_lapsed_while_its_step_was_gathered_keeps_its_place(queue):
    config = setup.trainer_config(
        None,
        queue=queue,
        partition=PARTITION,
        feed={"grad_accum": 2, "ordered": True, "claim_timeout_s": 0.2, "lease_s": 0.5},
    )
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, 3)
        feed = _feed(client, config, "t")
        assert feed.claim(2, block=True) is None  # 3 of 4 gathered
        time.sleep(0.8)  # their leases lapse: the next claim brings k00 again first
        _put(client, 3, 2)
        got = feed.claim(2, block=True)
    assert sorted(k for c in got for k in c.keys) == ["k00", "k01", "k02", "k03"]


@pytest.mark.timeout(60)
def test_two_ordered_ranks_train_in_each_step_the_samples_of_one_rank_with_twice_the_accumulation(
    queue,
):
    """Fixed shares: rank r keeps the r-th half of each 8-sample step (in put order), acks the
    other half for its own task, and both ranks see the end of the data."""
    one = setup.trainer_config(
        None,
        queue=queue,
        partition=PARTITION,
        feed={"grad_accum": 4, "ordered": True, "claim_timeout_s": 0.2},
    )
    two = setup.trainer_config(
        None,
        queue=queue,
        partition=PARTITION,
        feed={"grad_accum": 2, "ordered": True, "claim_timeout_s": 0.2},
    )
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, N)
        put_eof(client, PARTITION, N)
        single = _feed(client, one, "solo")
        ranks = [_feed(client, two, "pair", rank=r, ranks=2) for r in (0, 1)]
        assert [f.task for f in ranks] == ["pair/r0", "pair/r1"]
        solo_steps, pair_steps = [], []
        while not single.ended:
            got = single.claim(4, block=True)
            if got:
                solo_steps.append(sorted(k for c in got for k in c.keys))
                single.ack(got)
        while not all(f.ended for f in ranks):
            shares = []
            for f in ranks:
                got = f.claim(2, block=True) or []
                shares.append(sorted(k for c in got for k in c.keys))
                f.ack(got)
            if any(shares):
                pair_steps.append(shares)
        for f in ranks:
            assert client.status(PARTITION, f.task)["pending"] == 0
    assert [sorted(a + b) for a, b in pair_steps] == solo_steps
    assert pair_steps[0] == [[f"k{i:02d}" for i in range(4)], [f"k{i:02d}" for i in range(4, 8)]]
    assert pair_steps[1] == [["k08", "k09", "k10"], []]  # the short last step: rank order


def _drain_ahead(feed: SampleFeed) -> list[str]:
    """Every key ``feed`` takes when it claims far ahead without waiting (as a rank whose
    backward runs while another rank is still claiming for the same step)."""
    keys: list[str] = []
    while (got := feed.claim(8, block=False)) is not None:
        keys += [k for c in got for k in c.keys]
    return keys


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trained", [0, 4], ids=["fresh", "resumed"])
def test_two_ranks_claiming_ahead_split_the_untrained_samples_of_the_epoch_evenly(queue, trained):
    config = setup.trainer_config(None, queue=queue, partition=PARTITION, feed={"grad_accum": 2})
    done = {f"k{i:02d}" for i in range(trained)}
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, N)
        put_eof(client, PARTITION, N)
        first = _feed(client, config, "t", done, rank=0, ranks=2)
        second = _feed(client, config, "t", done, rank=1, ranks=2)
        greedy, late = _drain_ahead(first), _drain_ahead(second)
    untrained = N - trained
    # the first rank claims no more than its share, whatever it asks for: the other rank's
    # steps are never empty
    assert len(greedy) == untrained - untrained // 2 and len(late) == untrained // 2
    assert sorted(greedy + late) == sorted(f"k{i:02d}" for i in range(trained, N))


@pytest.mark.timeout(60)
def test_a_rank_past_its_share_with_no_data_for_its_step_claims_what_is_pending(queue):
    # e.g. a sample whose lease lapsed comes again after the ranks claimed their shares: a rank
    # with no data for its step (a claim that waits) takes it, so the epoch can end
    config = setup.trainer_config(None, queue=queue, partition=PARTITION, feed={"grad_accum": 2})
    with QueueClient(queue, timeout_s=10) as client:
        _put(client, 0, N)
        put_eof(client, PARTITION, N)
        first = _feed(client, config, "t", rank=0, ranks=2)
        share = _drain_ahead(first)
        assert first.claim(1, block=False) is None  # ahead: its share is claimed
        more = first.claim(1, block=True)
    assert len(share) == N - N // 2 and more is not None
    assert not {k for c in more for k in c.keys} & set(share)
