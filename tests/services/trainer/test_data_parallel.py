"""Data parallel + gradient accumulation: the gradient two gloo ranks apply equals the gradient of
one process that accumulates every micro-batch of the global batch (P-KL loss, real teacher)."""

from __future__ import annotations

import pathlib
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer.worker import TrainerWorker
from tests.services.trainer import distill_setup as setup
from tests.services.trainer.dp_ranks import capture_step_gradients, run_rank

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_ranks_with_accumulation_apply_the_full_batch_gradient(projection, tmp_path):
    # rank 0 accumulates two micro-batches, rank 1 has one: the denominators are global, so
    # each micro-batch counts the same wherever it runs
    plan = [[0, 1], [2]]
    if str(ROOT) not in sys.path:  # the spawned ranks import this package by name
        sys.path.insert(0, str(ROOT))
    out = str(tmp_path / "grads")
    mp.spawn(run_rank, args=(2, _free_port(), projection, plan, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]

    worker = TrainerWorker(setup.trainer_config(projection, grad_accum=3))
    batches = setup.micro_batches()
    mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in (0, 1, 2)]
    full = capture_step_gradients(worker, mbs)

    assert set(ranks[0]) == set(full)
    for name, grad in full.items():
        assert grad.abs().sum() > 0, f"{name}: no gradient reached it"
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_apply_the_gradient_of_one_rank_with_twice_the_accumulation(
    projection, tmp_path
):
    # 2 ranks x 1 micro-batch (NCCL, one GPU each) vs 1 rank accumulating the same 2
    plan = [[0], [1]]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = str(tmp_path / "grads")
    mp.spawn(
        run_rank, args=(2, _free_port(), projection, plan, out, "cuda"), nprocs=2, join=True
    )
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]
    worker = TrainerWorker(setup.trainer_config(projection, grad_accum=2, device="cuda"))
    batches = setup.micro_batches()
    mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in (0, 1)]
    for mb in mbs:
        logits = mb.teacher_logits
        mb.teacher_logits = lambda f=logits: f().to(worker.device)
    full = {k: v.cpu() for k, v in capture_step_gradients(worker, mbs).items()}
    for name, grad in full.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], grad, rtol=1e-3, atol=1e-5, msg=name)
