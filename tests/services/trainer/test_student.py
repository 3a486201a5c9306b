"""The student as it trains: the learning-rate schedule, activation checkpointing, where CUDA
graphs can run."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.student import lr_lambda, resolve_cuda_graphs
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr_ratio():
    f = lr_lambda(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # the decay starts at the peak
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1)
    assert f(100) == pytest.approx(0.1)  # past max_steps it stays at the end
    decay = [f(s) for s in range(4, 15)]
    assert decay == sorted(decay, reverse=True)


def test_lr_is_constant_after_warmup_without_max_steps_and_full_without_warmup():
    assert [lr_lambda(2, 0, 0.1)(s) for s in (0, 1, 2, 50)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(0, 10, 0.0)(0) == 1.0
    assert lr_lambda(0, 10, 0.0)(10) == pytest.approx(0.0)


def test_activation_checkpointing_keeps_the_gradients_and_saves_fewer_activations(projection):
    from tests.services.trainer.dp_ranks import capture_step_gradients

    batch = setup.micro_batches()[1]
    grads, saved = {}, {}
    for ckpt in (False, True):
        step = build_step(
            setup.trainer_config(projection, compute={"activation_checkpointing": ckpt})
        )
        assert step.student.module.model.layers[0].gradient_checkpointing is ckpt
        count = [0]  # elements the forward keeps for the backward

        def pack(t: torch.Tensor, count=count) -> torch.Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grads[ckpt], _ = capture_step_gradients(step, [setup.micro_batch(batch, ["a", "b"])])
        saved[ckpt] = count[0]
    assert saved[True] < saved[False]  # the decoder layers' internals are recomputed instead
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_of_a_model_without_it_names_the_setting():
    import types

    from xtoken_core.tokenizers import load_tokenizer

    class Bare(torch.nn.Module):  # a causal LM's vocab, no checkpointing
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(vocab_size=vocab)
            self.lm_head = torch.nn.Linear(4, vocab, bias=False)

    vocab = load_tokenizer(setup.STUDENT_TOKENIZER).vocab_size
    config = setup.trainer_config(None, compute={"activation_checkpointing": True})
    with pytest.raises(ValueError, match="activation_checkpointing=false"):
        build_step(config, model=Bare(vocab))


def test_activation_checkpointing_turns_cuda_graphs_off_and_refuses_them_when_asked():
    # the recomputed forward of a checkpointed layer breaks the graphs' replay (Inductor stops
    # the run at the first one): where CUDA graphs could otherwise run, checkpointing leaves
    # them off by default and an explicit `cuda_graphs: true` names the setting to change
    where = {
        "device": torch.device("cuda", 0),
        "compiled": True,
        "parallel": "ddp",
        "world_size": 1,
        "masters": True,
    }
    assert resolve_cuda_graphs(None, activation_checkpointing=True, **where) is False
    assert resolve_cuda_graphs(None, activation_checkpointing=False, **where) is True
    with pytest.raises(
        ValueError, match="trainer.compute.cuda_graphs: trainer.compute.activation_checkpointing"
    ):
        resolve_cuda_graphs(True, activation_checkpointing=True, **where)


def test_cuda_graphs_off_a_cuda_device_name_the_setting():
    with pytest.raises(
        ValueError, match="trainer.compute.cuda_graphs: .*not a cuda device.*: false"
    ):
        build_step(setup.trainer_config(None, compute={"cuda_graphs": True}))
