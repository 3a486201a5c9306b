"""The compiled student: one compile per run for every batch length, the same logits as eager,
the fallback to eager when compile fails, the start-up step, the attention mask left out under
right padding.

On the CPU these tests compile with Dynamo's ``aot_eager`` backend: the same tracing, guards and
autograd graphs as Inductor, without building kernels (the GPU tests build them).
"""

from __future__ import annotations

import logging

import pytest
import torch

from services.trainer.compile import compile_student, decoder_layers, warm_lengths
from services.trainer.worker import TrainerWorker, _is_prefix_mask
from tests.services.trainer import distill_setup as setup


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_worker(backend="aot_eager", **overrides) -> TrainerWorker:
    worker = TrainerWorker(setup.trainer_config(None, compile=False, **overrides))
    worker.compiled = compile_student(worker.compute, backend=backend) > 0
    return worker


def test_compile_is_off_on_cpu_unless_asked():
    worker = TrainerWorker(setup.trainer_config(None))
    assert not worker.compiled
    assert worker.warm_up() is None  # no start-up step: the CPU demo starts at once
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(worker.compute))


def test_compiled_student_trains_every_batch_length_without_recompiling():
    worker = _compiled_worker(max_length=40)
    assert worker.compiled
    assert worker.warm_up() is not None
    assert worker.recompiles() == 0
    lengths = set()
    for batch in setup.micro_batches():  # lengths 15, 18, 25, 21
        lengths.add(batch["input_ids"].shape[1])
        worker.train_step([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert len(lengths) == 4
    assert worker.recompiles() == 0


def test_compiled_student_gives_the_eager_logits_and_gradients():
    eager = TrainerWorker(setup.trainer_config(None))
    compiled = _compiled_worker()
    ids = setup.micro_batches()[2]["input_ids"]
    out_e, out_c = eager._forward(ids, None), compiled._forward(ids, None)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    out_e.float().logsumexp(-1).sum().backward()
    out_c.float().logsumexp(-1).sum().backward()
    for pe, pc in zip(eager.module.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5)


def test_each_decoder_layer_is_a_region_and_the_ladder_halves_down_to_64():
    worker = _compiled_worker()
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(worker.compute))
    assert worker.compute.lm_head._compiled_call_impl is None  # the output layer stays eager
    assert warm_lengths(4096) == [4096, 2048, 1024, 512, 256, 128, 64]
    assert warm_lengths(100) == [100]


def _broken_backend(gm, example_inputs):
    raise RuntimeError("this backend builds nothing")


def test_a_student_compile_cannot_build_trains_eagerly_after_one_warning(caplog):
    worker = _compiled_worker(backend=_broken_backend)
    with caplog.at_level(logging.WARNING, logger="services.trainer.worker"):
        assert worker.warm_up() is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "trainer.compile: false" in warnings[0].getMessage()
    assert not worker.compiled and worker.recompiles() is None
    result = worker.train_step(
        [setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)]
    )
    assert result.metrics["loss"] > 0 and worker.step == 1


def test_right_padded_rows_give_the_same_logits_without_the_attention_mask():
    worker = TrainerWorker(setup.trainer_config(None))
    batch = setup.micro_batches()[2]  # rows of 25 and 5 tokens
    mask = batch["token_mask"]
    assert _is_prefix_mask(mask) and not bool(mask.all())
    with_mask = worker._forward(batch["input_ids"], mask.long())
    without = worker._forward(batch["input_ids"], None)
    real = mask.bool()
    torch.testing.assert_close(without[real], with_mask[real], rtol=1e-5, atol=1e-5)


def test_a_mask_with_a_hole_is_not_a_prefix():
    assert _is_prefix_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not _is_prefix_mask(torch.tensor([[1, 0, 1], [1, 1, 1]]))
    assert not _is_prefix_mask(torch.tensor([[0, 1, 1]]))


def test_cuda_graphs_off_a_cuda_device_name_the_setting():
    with pytest.raises(ValueError, match="trainer.cuda_graphs: .*not a cuda device.*: false"):
        TrainerWorker(setup.trainer_config(None, cuda_graphs=True))


def test_activation_checkpointing_turns_cuda_graphs_off_and_refuses_them_when_asked():
    # the recomputed forward of a checkpointed layer breaks the graphs' replay (Inductor stops
    # the run at the first one): where CUDA graphs could otherwise run, checkpointing leaves
    # them off by default and an explicit `cuda_graphs: true` names the setting to change
    worker = TrainerWorker(setup.trainer_config(None, activation_checkpointing=True))
    worker.device, worker.compiled, worker.master = torch.device("cuda", 0), True, object()
    assert worker._resolve_cuda_graphs() is False
    worker.config.activation_checkpointing = False
    assert worker._resolve_cuda_graphs() is True
    worker.config.activation_checkpointing, worker.config.cuda_graphs = True, True
    with pytest.raises(ValueError, match="trainer.cuda_graphs: trainer.activation_checkpointing"):
        worker._resolve_cuda_graphs()


def test_a_triton_kernel_compiled_after_the_first_step_counts_as_a_recompile(monkeypatch):
    # the first step compiles the loss's kernels; one compiled later (first needed mid-run)
    # stalls its step for seconds on an empty cache: the run's recompile count shows it, through
    # Triton's post-compile hook, which keeps a hook set before
    triton = pytest.importorskip("triton")
    from services.trainer import compile as trainer_compile

    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(1))
    monkeypatch.setattr(trainer_compile, "_triton_hooked", False)
    monkeypatch.setattr(trainer_compile, "_triton_compiles", 0)
    worker = _compiled_worker(max_length=40)
    assert worker.warm_up() is not None
    after_compile = triton.knobs.runtime.jit_post_compile_hook
    after_compile(fn=None, key="k")  # before the first step's end: not counted
    batch = setup.micro_batches()[0]
    worker.train_step([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert worker.recompiles() == 0
    triton.knobs.runtime.jit_post_compile_hook(fn=None, key="k")  # what Triton calls after one
    assert worker.recompiles() == 1 and seen == [1, 1]
