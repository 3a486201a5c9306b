"""Published student weights over cuda_ipc: a trainer process publishes bf16 parameters on its GPU,
a reader in another process copies the newest whole version into its own model, never a torn one."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from xtoken_core.ipc.policy_weights import WeightPublisher, WeightSubscriber

pytestmark = pytest.mark.gpu

ELEMENTS = 1 << 24  # 32 MiB of bf16 per version


def _publisher(directory: str, versions: int, started, finished, done) -> None:
    """Child: a trainer on cuda:0 that publishes ``versions`` versions, each filled with its
    number."""
    torch.cuda.set_device(0)
    param = torch.nn.Parameter(torch.zeros(ELEMENTS, dtype=torch.bfloat16, device="cuda:0"))
    with WeightPublisher(directory, [("w", param)], transport="cuda_ipc") as pub:
        for v in range(versions):
            param.data.fill_(float(v))
            pub.publish([("w", param)], version=v)
            started.set()
        finished.set()
        done.wait(120)


def test_a_reader_on_the_gpu_copies_whole_versions_while_the_trainer_publishes(tmp_path):
    ctx = mp.get_context("spawn")
    started, finished, done = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_publisher, args=(str(tmp_path), 200, started, finished, done), daemon=True
    )
    proc.start()
    try:
        assert started.wait(120), "the publisher did not start"
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(
            torch.full((ELEMENTS,), -1.0, dtype=torch.bfloat16, device="cuda:0")
        )
        reader, seen = WeightSubscriber(tmp_path), []
        while not finished.is_set():
            version = reader.load_into(model)
            if version is None:
                continue
            seen.append(version)
            values = model.w.detach()
            assert torch.equal(values, torch.full_like(values, float(version))), version
        assert seen == sorted(seen) and len(seen) >= 2
    finally:
        done.set()
        proc.join(60)
