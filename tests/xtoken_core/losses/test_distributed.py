"""Global denominators: 2 gloo ranks x micro-batches give the single-process full-batch gradient;
the DP count without a process group."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig, dp_all_reduce_sum

B, T, U, D, V, W, C = 8, 10, 9, 4, 12, 10, 6
WORLD = 2
MICRO = 2  # micro-batches per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_data():
    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(W, generator=g)[:3] for _ in range(V)])
    likelihoods = torch.rand(V, 3, generator=g) + 0.1
    likelihoods[:4] = torch.tensor([1.0, 0.0, 0.0])
    indices[:4, 1:] = -1
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, U, W, generator=g, dtype=torch.float64)
    weight = torch.randn(D, V, generator=g, dtype=torch.float64)
    s_ids = torch.full((B, T), -1, dtype=torch.long)
    t_ids = torch.full((B, U), -1, dtype=torch.long)
    for b in range(B):  # samples of different lengths: per-sample chunk counts differ
        n = 2 + b % 4
        s_ids[b, : 2 * n] = torch.arange(n).repeat_interleave(2)
        t_ids[b, :n] = torch.arange(n)
    batch = {
        "alignment_pair_valid": torch.rand(B, C, generator=g) > 0.2,
        "alignment_pair_is_correct": torch.ones(B, C, dtype=torch.bool),
        "alignment_student_chunk_id": s_ids,
        "alignment_teacher_chunk_id": t_ids,
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "token_mask": s_ids >= 0,
        "sample_mask": torch.arange(B) != 5,
    }
    return (indices, likelihoods), hidden, teacher, weight, batch


def _slice(batch, lo, hi):
    return {k: v[lo:hi] for k, v in batch.items()}


def _config(projection, mode):
    # vocab_topk=None: the top-k column choice is per micro-batch by design, so only the full
    # teacher vocabulary makes micro-batching exact.
    return CrossTokenizerLossConfig(
        projection=projection, mode=mode, vocab_topk=None, ce_weight=0.5
    )


def _worker(rank, port, out_paths):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        projection, hidden, teacher, weight0, batch = _make_data()
        per_rank, per_micro = B // WORLD, B // WORLD // MICRO
        lo = rank * per_rank
        micro = [(lo + m * per_micro, lo + (m + 1) * per_micro) for m in range(MICRO)]
        for mode, out_path in out_paths.items():
            weight = weight0.clone().requires_grad_()
            loss_fn = CrossTokenizerLoss(_config(projection, mode))
            counts = loss_fn.count_valid([_slice(batch, a, b) for a, b in micro])
            for a, b in micro:
                loss, _ = loss_fn(hidden[a:b] @ weight, teacher[a:b], _slice(batch, a, b), **counts)
                loss.backward()
            dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM)
            if rank == 0:
                torch.save(weight.grad, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_micro_batches_on_two_ranks_sum_to_the_full_batch_gradient(tmp_path):
    out_paths = {mode: tmp_path / f"grad_{mode}.pt" for mode in ("pkl", "gold")}
    mp.spawn(_worker, args=(_free_port(), out_paths), nprocs=WORLD, join=True)
    projection, hidden, teacher, weight, batch = _make_data()
    for mode, path in out_paths.items():
        weight_full = weight.clone().requires_grad_()
        loss, metrics = CrossTokenizerLoss(_config(projection, mode))(
            hidden @ weight_full, teacher, batch
        )
        loss.backward()
        assert metrics["num_valid_chunks"].item() > 0
        torch.testing.assert_close(torch.load(path), weight_full.grad, rtol=1e-10, atol=1e-12)


def test_dp_all_reduce_sum_is_a_fresh_float32_copy_without_distributed():
    local = torch.tensor(7, dtype=torch.int64)
    out = dp_all_reduce_sum(local)
    assert out.dtype == torch.float32 and out.item() == 7.0
    out += 1
    assert local.item() == 7
    assert dp_all_reduce_sum(3).item() == 3.0
