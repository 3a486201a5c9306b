"""Published student weights over cuda_ipc: a trainer process publishes bf16 parameters on its GPU,
a reader in another process copies the newest whole version into its own model, never a torn one."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from xtoken_core.ipc.policy_weights import WeightPublisher, WeightSubscriber

pytestmark = pytest.mark.gpu

ELEMENTS = 1 << 24  # 32 MiB of bf16 per version


def _publisher(directory: str, versions: int, started, copied, finished, done) -> None:
    """Child: a trainer on cuda:0 that publishes ``versions`` versions, each filled with its
    number; the later ones only once the reader copied the first, then as fast as it can."""
    torch.cuda.set_device(0)
    param = torch.nn.Parameter(torch.zeros(ELEMENTS, dtype=torch.bfloat16, device="cuda:0"))
    with WeightPublisher(directory, [("w", param)], transport="cuda_ipc") as pub:
        for v in range(versions):
            param.data.fill_(float(v))
            pub.publish([("w", param)], version=v)
            if v == 0:
                started.set()
                copied.wait(120)
        finished.set()
        done.wait(120)


def test_a_reader_on_the_gpu_copies_whole_versions_while_the_trainer_publishes(tmp_path):
    versions = 200
    ctx = mp.get_context("spawn")
    started, copied, finished, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_publisher,
        args=(str(tmp_path), versions, started, copied, finished, done),
        daemon=True,
    )
    proc.start()
    try:
        assert started.wait(120), "the publisher did not start"
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(
            torch.full((ELEMENTS,), -1.0, dtype=torch.bfloat16, device="cuda:0")
        )
        reader, seen = WeightSubscriber(tmp_path), []

        def copy() -> None:
            version = reader.load_into(model)
            if version is None:
                return  # nothing newer, or every try overlapped a publication: the next call
            seen.append(version)
            values = model.w.detach()
            # one version, whole: every element the value the publisher wrote for it
            assert torch.equal(values, torch.full_like(values, float(version))), version
            copied.set()

        while not finished.is_set():  # however fast the publisher runs beside it
            copy()
        copy()  # after the last publication: the final version
        assert seen[0] == 0 and seen[-1] == versions - 1, seen
        assert seen == sorted(seen) and len(set(seen)) == len(seen)
    finally:
        done.set()
        proc.join(60)
