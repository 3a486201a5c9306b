"""Published student weights: a reader copies the newest complete version into its model, never a
torn one (a publisher in another process writing while the reader copies), and follows a new
publisher (a restarted trainer)."""

from __future__ import annotations

import logging
import multiprocessing as mp

import pytest
import torch

from xtoken_core.ipc.policy_weights import (
    DESCRIPTOR,
    WEIGHTS_FILE,
    WeightPublisher,
    WeightSubscriber,
)

TRANSPORTS = ["file", "shm"]


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3))
    model[1].weight = torch.nn.Parameter(torch.randn(3, 8))
    return model


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reader_loads_each_newer_version_once(tmp_path, transport):
    trained, rollout = small_model(0), small_model(1)
    assert not same_params(trained, rollout)
    reader = WeightSubscriber(tmp_path)
    assert reader.newest() is None and reader.load_into(rollout) is None  # nothing yet
    with WeightPublisher(tmp_path, trained.named_parameters(), transport=transport) as pub:
        assert reader.newest() is None
        pub.publish(trained.named_parameters(), version=0)
        assert reader.newest() == 0
        assert reader.load_into(rollout) == 0 and same_params(trained, rollout)
        assert reader.load_into(rollout) is None  # nothing newer
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(1.0)
        pub.publish(trained.named_parameters(), version=3)
        assert reader.newest() == 3
        assert reader.load_into(rollout) == 3 and same_params(trained, rollout)
    if transport == "shm":
        assert reader.newest() is None  # closed: nothing newer comes from it


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reader_follows_a_new_publisher(tmp_path, transport):
    first, second, rollout = small_model(0), small_model(2), small_model(1)
    reader = WeightSubscriber(tmp_path)
    with WeightPublisher(tmp_path, first.named_parameters(), transport=transport) as pub:
        pub.publish(first.named_parameters(), version=8)
        assert reader.load_into(rollout) == 8
    # a restarted trainer resumes from an earlier step: its version is older, and it is taken
    with WeightPublisher(tmp_path, second.named_parameters(), transport=transport) as pub:
        pub.publish(second.named_parameters(), version=6)
        assert reader.load_into(rollout) == 6 and same_params(second, rollout)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_weights_of_another_model_are_refused_naming_the_parameter(tmp_path, transport):
    other = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4))
    with WeightPublisher(tmp_path, small_model().named_parameters(), transport=transport) as pub:
        pub.publish(small_model().named_parameters(), version=0)
        with pytest.raises(ValueError, match=r"published '1.weight' is \[3, 8\], the rollout's"):
            WeightSubscriber(tmp_path).load_into(other)


# a descriptor whose bytes were damaged: msgpack's str of 2 bytes, not UTF-8
DAMAGED = b"\x82\xa2\xb6\xb6\x01\xa6format\x01"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_damaged_descriptor_is_waited_out_until_the_next_publication_rewrites_it(
    tmp_path, transport, caplog
):
    trained, rollout = small_model(0), small_model(1)
    reader = WeightSubscriber(tmp_path)
    with WeightPublisher(tmp_path, trained.named_parameters(), transport=transport) as pub:
        pub.publish(trained.named_parameters(), version=1)
        (tmp_path / DESCRIPTOR).write_bytes(DAMAGED)
        fresh = WeightSubscriber(tmp_path)  # one that never read the good descriptor
        with caplog.at_level(logging.WARNING, logger="xtoken_core.ipc.policy_weights"):
            assert fresh.load_into(rollout) is None and fresh.newest() is None
            assert fresh.load_into(rollout) is None
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1, warned  # once per damaged file, not per call
        assert str(tmp_path / DESCRIPTOR) in warned[0] and "damaged" in warned[0]
        assert "next publication" in warned[0]
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(1.0)
        pub.publish(trained.named_parameters(), version=2)  # rewrites the descriptor
        assert fresh.load_into(rollout) == 2 and same_params(trained, rollout)
        assert reader.load_into(rollout) == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reader_keeps_its_publisher_while_the_descriptor_is_damaged(tmp_path, transport):
    trained, rollout = small_model(0), small_model(1)
    reader = WeightSubscriber(tmp_path)
    with WeightPublisher(tmp_path, trained.named_parameters(), transport=transport) as pub:
        pub.publish(trained.named_parameters(), version=1)
        assert reader.load_into(rollout) == 1
        (tmp_path / DESCRIPTOR).write_bytes(DAMAGED)
        assert reader.load_into(rollout) is None  # nothing newer, and no error
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(1.0)
        pub.publish(trained.named_parameters(), version=2)
        assert reader.load_into(rollout) == 2 and same_params(trained, rollout)


def test_a_publisher_leaves_the_descriptor_of_its_successor_alone(tmp_path):
    first, second, rollout = small_model(0), small_model(2), small_model(1)
    old = WeightPublisher(tmp_path, first.named_parameters(), transport="shm")
    try:
        with WeightPublisher(tmp_path, second.named_parameters(), transport="shm") as new:
            new.publish(second.named_parameters(), version=4)
            old.publish(first.named_parameters(), version=9)  # the old trainer, not yet gone
            assert WeightSubscriber(tmp_path).load_into(rollout) == 4
            assert same_params(second, rollout)
    finally:
        old.close()


def test_a_damaged_weights_file_is_waited_out_until_the_next_publication(tmp_path):
    trained, rollout = small_model(0), small_model(1)
    reader = WeightSubscriber(tmp_path)
    with WeightPublisher(tmp_path, trained.named_parameters(), transport="file") as pub:
        pub.publish(trained.named_parameters(), version=1)
        (tmp_path / WEIGHTS_FILE).write_bytes(b"\xb6" * 64)
        assert reader.newest() is None and reader.load_into(rollout) is None
        pub.publish(trained.named_parameters(), version=2)
        assert reader.load_into(rollout) == 2 and same_params(trained, rollout)


def test_cuda_ipc_needs_parameters_on_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="cuda_ipc needs parameters on a CUDA device"):
        WeightPublisher(tmp_path, small_model().named_parameters(), transport="cuda_ipc")


# ---------------------------------------------------------------------------- concurrent writer

ELEMENTS = 1 << 19  # 2 MiB of fp32 per version: copies long enough to overlap


def _publisher(directory: str, transport: str, started, enough, finished, done) -> None:
    param = torch.nn.Parameter(torch.zeros(ELEMENTS))
    with WeightPublisher(directory, [("w", param)], transport=transport) as pub:
        v = 0  # publishes until the reader has taken a few versions (however loaded the machine)
        while not enough.is_set() and v < 100_000:
            param.data.fill_(float(v))
            pub.publish([("w", param)], version=v)
            started.set()
            v += 1
        finished.set()
        done.wait(60)  # the reader is done: then the segments go


@pytest.mark.parametrize("transport", ["shm"])  # file: a rename, read from one open file
def test_a_copy_overlapping_publications_is_never_torn(tmp_path, transport):
    ctx = mp.get_context("spawn")
    started, enough, finished, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_publisher,
        args=(str(tmp_path), transport, started, enough, finished, done),
        daemon=True,
    )
    proc.start()
    try:
        assert started.wait(60), "the publisher did not start"
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.full((ELEMENTS,), -1.0))
        reader, seen = WeightSubscriber(tmp_path), []
        while not finished.is_set():
            version = reader.load_into(model)
            if version is None:
                continue
            seen.append(version)
            if len(seen) >= 5:
                enough.set()
            values = model.w.detach()
            # one version, whole: every element the value the publisher wrote for it
            assert torch.equal(values, torch.full_like(values, float(version))), version
        assert seen == sorted(seen) and len(set(seen)) == len(seen)
        assert len(seen) >= 5
    finally:
        done.set()
        proc.join(30)
