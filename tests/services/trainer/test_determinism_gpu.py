"""GPU: trainer.compute.deterministic on CUDA. Two sequences of steps from one config, each in a
freshly configured process state, give bitwise-equal per-step losses and final fp32 weights: the
default student step (bf16 parameters with fp32 masters, compiled decoder layers, CUDA graphs)
and the eager one, and the KD modes on the loss's Triton kernels."""

from __future__ import annotations

import pytest
import torch

from services.trainer import determinism
from services.trainer.startup import warm_up
from services.trainer.step import MicroBatch, StudentStep
from services.trainer.trainer import build_step
from tests.extras import missing_tokenizers
from tests.services.trainer import distill_setup as setup
from tests.services.trainer.determinism_setup import (
    hex_losses,
    restored_process_settings,
    weight_bits,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(autouse=True)
def process_settings():
    with restored_process_settings():
        yield


def _ce_batches(vocab: int, lengths=((15, 13), (18, 15), (25, 5), (21, 13))) -> list[dict]:
    """Right-padded CE micro-batches of 2 rows: ``(width, shorter row's length)`` each."""
    g = torch.Generator().manual_seed(0)
    out = []
    for width, short in lengths:
        ids = torch.randint(3, vocab, (2, width), generator=g)
        mask = torch.ones(2, width, dtype=torch.bool)
        mask[1, short:] = False
        ids[~mask] = 0
        out.append(
            {
                "input_ids": ids,
                "token_mask": mask,
                "sample_mask": torch.ones(2, dtype=torch.bool),
                "input_lengths": mask.sum(1),
            }
        )
    return out


def _sequence(config, batches, teacher=None, steps: int = 5) -> tuple[list[str], dict]:
    """``steps`` optimizer steps of two micro-batches each (lengths change from step to step)
    from a fresh process state: configured as the trainer's shell does, Dynamo's caches reset,
    the start-up step run. Returns the losses (hex) and the final fp32 weights (bytes)."""
    import torch._dynamo

    torch._dynamo.reset()
    determinism.configure(config.compute.deterministic, config.student.seed)
    step: StudentStep = build_step(config)
    warm_up(step.student, micro_batch=2, max_length=32, head=step.head)
    losses = []
    for i in range(steps):
        mbs = []
        for j in (i % len(batches), (i + 1) % len(batches)):
            logits = None if teacher is None else (lambda z=teacher[j]: z)
            mbs.append(MicroBatch(keys=[f"{i}.{j}"], batch=batches[j], teacher_logits=logits))
        losses.append(step.run(mbs).metrics["loss"])
    torch.cuda.synchronize()
    return hex_losses(losses), weight_bits(step.student.module)


@pytest.mark.parametrize("compute", [{}, {"compile": False}], ids=["compiled-cuda-graphs", "eager"])
def test_two_deterministic_cuda_step_sequences_give_bitwise_equal_losses_and_weights(compute):
    if (missing := missing_tokenizers("qwen3")) is not None:  # pragma: no cover
        pytest.skip(missing)
    config = setup.trainer_config(
        None, student_tokenizer="qwen3", teacher_tokenizer="qwen3",
        compute={"device": "cuda", "deterministic": True, **compute},
        feed={"grad_accum": 2, "ordered": True},
    )  # fmt: skip
    batches = _ce_batches(1000)
    first, second = _sequence(config, batches), _sequence(config, batches)
    assert first[0] == second[0]
    assert first[1] == second[1]


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_two_deterministic_cuda_kd_step_sequences_are_bitwise_equal(projection, mode):
    """The KD term and the CE on the loss's Triton kernels (``backend: auto`` on CUDA), the tiny
    teacher's bf16 logits given as a ring slot would give them."""
    config = setup.trainer_config(
        projection, loss={"mode": mode, "ce_weight": 0.5},
        compute={"device": "cuda", "deterministic": True},
        feed={"grad_accum": 2, "ordered": True},
    )  # fmt: skip
    batches = setup.micro_batches()[:3]
    teacher = [setup.teacher_logits(b).to("cuda", torch.bfloat16) for b in batches]
    first = _sequence(config, batches, teacher)
    second = _sequence(config, batches, teacher)
    assert first[0] == second[0]
    assert first[1] == second[1]
