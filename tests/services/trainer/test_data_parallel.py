"""Data parallel + gradient accumulation: the gradient two gloo ranks apply (DDP, or FSDP2 with
sharded parameters) equals the gradient of one process that accumulates every micro-batch of the
global batch (P-KL loss, real teacher); an FSDP2 checkpoint loads back on two ranks and on one."""

from __future__ import annotations

import pathlib
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer import checkpoint
from services.trainer.trainer import build_step
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
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True)["grads"] for r in range(2)]

    step = build_step(setup.trainer_config(projection, feed={"grad_accum": 3}))
    batches = setup.micro_batches()
    mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in (0, 1, 2)]
    full, _ = capture_step_gradients(step, mbs)

    assert set(ranks[0]) == set(full)
    for name, grad in full.items():
        assert grad.abs().sum() > 0, f"{name}: no gradient reached it"
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _bf16_ranks_against_one_process(projection: str, tmp_path, plan: list[list[int]]) -> None:
    """gloo ranks with bf16 compute parameters and fp32 masters train ``plan`` (indices of
    ``setup.micro_batches()``, one list a rank): each keeps its compute gradients in the DDP
    buckets (``held``), every rank's master gradients are equal, and they are one process's,
    accumulating every micro-batch in fp32, within bf16 precision."""
    world = len(plan)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = str(tmp_path / "grads")
    bf16 = {"compute": {"param_dtype": "bfloat16"}}
    args = (world, _free_port(), projection, plan, out, "cpu", "ddp", None, bf16)
    mp.spawn(run_rank, args=args, nprocs=world, join=True)
    saved = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(world)]
    assert all(s["held"] for s in saved)

    indices = [i for mine in plan for i in mine]
    step = build_step(setup.trainer_config(projection, feed={"grad_accum": len(indices)}, **bf16))
    batches = setup.micro_batches()
    full, _ = capture_step_gradients(
        step, [setup.micro_batch(batches[i], [f"s{i}"]) for i in indices]
    )
    cosines = []
    for name, grad in full.items():
        ranks = [s["grads"][name] for s in saved]
        for other in ranks[1:]:
            torch.testing.assert_close(ranks[0], other, rtol=0, atol=0)
        assert ranks[0].dtype == torch.float32  # the masters' gradients
        torch.testing.assert_close(ranks[0], grad, rtol=0.05, atol=2e-3, msg=name)
        cosines.append(torch.nn.functional.cosine_similarity(ranks[0].flatten(), grad.flatten(), 0))
    assert min(cosines) > 0.999


@pytest.mark.timeout(300)
def test_bf16_ranks_accumulate_in_the_ddp_buckets_and_apply_the_full_batch_gradient(
    projection, tmp_path
):
    # bf16 compute parameters with fp32 masters: under DDP each compute gradient is a view of the
    # reducer's bucket for the run (zeroed in place, never freed: a CUDA graph replay may not own
    # it); both ranks accumulate two micro-batches in bf16 there, the two ranks' sum is one bf16
    # addition. Against one process accumulating all four in fp32: bf16 precision
    _bf16_ranks_against_one_process(projection, tmp_path, [[0, 1], [2, 3]])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_four_bf16_ranks_sum_their_buckets_in_fp32_and_apply_the_full_batch_gradient(
    projection, tmp_path
):
    # above two ranks the bf16 buckets are summed in fp32 and rounded once
    # (services/trainer/precision.py fp32_allreduce_hook): every rank applies the same gradient
    _bf16_ranks_against_one_process(projection, tmp_path, [[0], [1], [2], [3]])


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # 1-process load
def test_two_fsdp_ranks_apply_the_full_batch_update_and_their_checkpoint_loads_back(
    projection, tmp_path
):
    # FSDP2 (fully_shard per decoder layer, then the root) on two gloo ranks with uneven
    # accumulation: the gradient is the sum over ranks (the loss is already divided by the global
    # counts), the rank with one micro-batch joins the other's second forward (FSDP's all-gathers
    # are collective), and the step's parameters equal those of one process
    plan = [[0, 1], [2]]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = str(tmp_path / "fsdp")
    mp.spawn(
        run_rank,
        args=(2, _free_port(), projection, plan, out, "cpu", "fsdp", str(tmp_path / "run")),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]

    step = build_step(setup.trainer_config(projection, feed={"grad_accum": 3}))
    student = step.student
    batches = setup.micro_batches()
    mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in (0, 1, 2)]
    before = {name: p.detach().clone() for name, p in student.module.named_parameters()}
    grads, result = capture_step_gradients(step, mbs)
    params = {name: p.detach().clone() for name, p in student.module.named_parameters()}

    # AdamW's first step is about lr * sign(grad), blind to the gradient's scale: the gradients
    # and their norm are what show a rank average where a sum is due
    assert ranks[0]["grad_norm"] == pytest.approx(result.metrics["grad_norm"], rel=1e-4)
    for rank in ranks:
        assert set(rank["grads"]) == set(grads) == set(rank["params"])
        for name, grad in grads.items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
            # where |grad| is near AdamW's eps (1e-8) its first step, lr * g / (|g| + eps), turns
            # the grads' allowed rounding (atol 1e-7) into any fraction of lr: compare the rest
            settled = grad.abs() > 1e-6
            torch.testing.assert_close(
                rank["params"][name][settled], params[name][settled], rtol=1e-4, atol=1e-6
            )
            assert not torch.equal(params[name], before[name]), f"{name} did not move"
        # the checkpoint of the step, loaded into a fresh FSDP2 student of other initial weights
        assert rank["loaded_step"] == 1
        for name, p in rank["params"].items():
            assert torch.equal(rank["loaded"][name], p), name

    # the same sharded checkpoint resumes a single process (DCP reshards on load)
    path = checkpoint.latest_checkpoint(tmp_path / "run")
    single = build_step(
        setup.trainer_config(projection, feed={"grad_accum": 3}, student={"seed": 7})
    ).student
    assert checkpoint.load(single, path)["step"] == 1
    for name, p in single.module.named_parameters():
        assert torch.equal(p.detach(), ranks[0]["params"][name]), name
    for p, q in zip(single.module.parameters(), student.module.parameters()):
        state, want = single.optimizer.state[p], student.optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], want[key], rtol=1e-4, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("plan", [[[0], [1]], [[0, 1], [2, 3]]], ids=["1mb", "accumulate2"])
def test_two_nccl_ranks_replaying_cuda_graphs_apply_the_gradient_of_one_rank(
    projection, tmp_path, plan
):
    # 2 ranks (NCCL, one GPU each; bf16 parameters, compiled layers replayed as CUDA graphs, the
    # gradients in DDP's buckets) vs 1 rank accumulating the same micro-batches; with two
    # micro-batches per rank the first one's gradients must survive the second one's replays
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = str(tmp_path / "grads")
    mp.spawn(run_rank, args=(2, _free_port(), projection, plan, out, "cuda"), nprocs=2, join=True)
    saved = [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(2)]
    assert saved[0]["cuda_graphs"] and saved[0]["held"] and saved[1]["held"]
    ranks = [s["grads"] for s in saved]
    indices = [i for rank in plan for i in rank]
    step = build_step(
        setup.trainer_config(
            projection, feed={"grad_accum": len(indices)}, compute={"device": "cuda"}
        )
    )
    batches = setup.micro_batches()
    mbs = [setup.micro_batch(batches[i], [f"s{i}"]) for i in indices]
    for mb in mbs:
        logits = mb.teacher_logits
        mb.teacher_logits = lambda f=logits: f().to(step.student.device)
    full = {k: v.cpu() for k, v in capture_step_gradients(step, mbs)[0].items()}
    for name, grad in full.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], grad, rtol=0.05, atol=1e-4, msg=name)
        cosine = torch.nn.functional.cosine_similarity(ranks[0][name].flatten(), grad.flatten(), 0)
        assert cosine > 0.999, (name, float(cosine))
