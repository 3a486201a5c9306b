"""GPU: the default student step (bf16 parameters with fp32 masters, decoder layers compiled by
Inductor) against the eager fp32 step; no recompile over batch lengths; the start-up step's
out-of-memory message."""

from __future__ import annotations

import pytest
import torch

from services.trainer.startup import StartupOutOfMemory, warm_up
from services.trainer.step import MicroBatch, StudentStep
from services.trainer.trainer import build_step
from tests.extras import missing_tokenizers
from tests.services.trainer import distill_setup as setup

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)
if (missing := missing_tokenizers("qwen3")) is not None:  # pragma: no cover
    pytest.skip(missing, allow_module_level=True)


def _step(grad_accum: int = 1, **compute) -> StudentStep:
    # CE only, with the tokenizer of the core install (no teacher model); ``compute``: settings
    # of the compute section over cuda's defaults
    config = setup.trainer_config(
        None, student_tokenizer="qwen3", teacher_tokenizer="qwen3",
        compute={"device": "cuda", **compute}, feed={"grad_accum": grad_accum},
    )  # fmt: skip
    return build_step(config)


def _warm_up(step: StudentStep, micro_batch: int = 2, max_length: int = 32) -> float | None:
    return warm_up(step.student, micro_batch=micro_batch, max_length=max_length, head=step.head)


def _flat_weights(step: StudentStep) -> torch.Tensor:
    """The student's fp32 weights, one flat copy."""
    return torch.cat([p.detach().flatten().clone() for p in step.student.module.parameters()])


def _batches(vocab: int, lengths=((15, 13), (18, 15), (25, 5), (21, 13))) -> list[MicroBatch]:
    """Right-padded CE micro-batches of 2 rows: ``(width, shorter row's length)`` each."""
    g = torch.Generator().manual_seed(0)
    out = []
    for width, short in lengths:
        ids = torch.randint(3, vocab, (2, width), generator=g)
        mask = torch.ones(2, width, dtype=torch.bool)
        mask[1, short:] = False
        ids[~mask] = 0
        batch = {
            "input_ids": ids,
            "token_mask": mask,
            "sample_mask": torch.ones(2, dtype=torch.bool),
            "input_lengths": mask.sum(1),
        }
        out.append(MicroBatch(keys=["a", "b"], batch=batch))
    return out


def test_default_cuda_step_is_bf16_compiled_and_follows_the_eager_fp32_step():
    """One step from the same weights: loss within 2% of eager fp32 autocast, update cosine
    >= 0.98 (bf16 rounds parameters and gradients; the fp32 masters keep the update)."""
    import torch._dynamo

    torch._dynamo.reset()
    mb = _batches(1000)[0]
    results, updates = [], []
    for overrides in ({"param_dtype": "float32", "compile": False}, {}):
        step = _step(**overrides)
        _warm_up(step)
        params = step.student.module.parameters
        before = torch.cat([p.detach().flatten().clone() for p in params()])
        results.append(step.run([mb]).metrics["loss"])
        after = torch.cat([p.detach().flatten() for p in params()])
        updates.append(after - before)
    assert step.student.compiled and step.student.master is not None
    assert step.student.fused_update  # the default on a cuda device with masters
    assert abs(results[1] - results[0]) <= 0.02 * abs(results[0])
    cos = torch.nn.functional.cosine_similarity(updates[0], updates[1], dim=0)
    assert float(cos) >= 0.98


def test_default_cuda_step_compiles_once_for_every_batch_length():
    import torch._dynamo

    torch._dynamo.reset()
    step = _step()
    assert _warm_up(step) is not None and step.student.recompiles() == 0
    for mb in _batches(step.student.vocab):  # four lengths
        step.run([mb])
    assert step.student.recompiles() == 0


def test_a_start_up_step_too_large_for_the_gpu_names_micro_batch_and_checkpointing():
    free, _ = torch.cuda.mem_get_info()
    step = _step(compile=False)
    with pytest.raises(
        StartupOutOfMemory, match="trainer.feed.micro_batch.*activation_checkpointing"
    ):
        _warm_up(step, micro_batch=64, max_length=int(free // (64 * 4 * 1000)))


def test_a_non_finite_gradient_skips_the_fused_update_on_the_gpu():
    """The finite check and the clip run inside the fused AdamW: a NaN gradient leaves weights,
    optimizer state and step count as they were."""
    step = _step()
    student = step.student
    mb = _batches(student.vocab)[0]
    step.run([mb])
    weights = [p.detach().clone() for p in student.module.parameters()]
    head = student.module.lm_head.weight
    state = {k: v.clone() for k, v in student.optimizer.state[head].items()}
    handle = next(student.compute.parameters()).register_hook(lambda g: g * float("nan"))
    result = step.run([mb])
    handle.remove()
    assert result.skipped and step.skipped_steps == 1
    assert all(torch.equal(w, p) for w, p in zip(weights, student.module.parameters()))
    after = student.optimizer.state[head]
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert not step.run([mb]).skipped
    assert not torch.equal(weights[0], next(student.module.parameters()))


def test_the_fused_update_trains_as_torchs_adamw_with_cuda_graphs_and_skips_a_nan_step():
    """Five CUDA-graph steps of two micro-batches: ``fused_update`` against torch's fused AdamW
    and the copy. Both sequences are deterministic (``compute.deterministic``), so the first
    step's fp32 weights differ only by the update's own rounding (its bias corrections as
    ``exp(t log beta)``): within 1e-5. After five steps, losses within 1e-4 and weights within
    one learning rate: a weight one fp32 ulp apart can round to another bf16 copy, the next
    gradients differ, and Adam's normalized step carries that (an H200 gave 2.4e-4 at lr 1e-3,
    identical run to run). A NaN gradient then writes nothing."""
    import torch._dynamo

    from services.trainer import determinism
    from tests.services.trainer.determinism_setup import restored_process_settings

    mbs = _batches(1000)
    losses, first, weights, steps = [], [], [], []
    with restored_process_settings():
        for fused in (False, True):
            torch._dynamo.reset()
            config = setup.trainer_config(
                None, student_tokenizer="qwen3", teacher_tokenizer="qwen3",
                compute={"device": "cuda", "deterministic": True, "fused_update": fused},
                feed={"grad_accum": 2, "ordered": True},
            )  # fmt: skip
            determinism.configure(True, config.student.seed)
            step = build_step(config)
            _warm_up(step)
            losses.append([])
            for i in range(5):
                losses[-1].append(step.run([mbs[i % 4], mbs[(i + 1) % 4]]).metrics["loss"])
                if i == 0:
                    first.append(_flat_weights(step))
            weights.append(_flat_weights(step))
            steps.append(step)
        assert float((first[1] - first[0]).abs().max()) <= 1e-5
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
        assert float((weights[1] - weights[0]).abs().max()) <= config.optim.lr
        student = steps[1].student
        for m, c in zip(student.module.parameters(), student.compute.parameters(), strict=True):
            assert torch.equal(c, m.to(torch.bfloat16))
        handle = next(student.compute.parameters()).register_hook(lambda g: g * float("nan"))
        before = [p.detach().clone() for p in student.module.parameters()]
        assert steps[1].run([mbs[0]]).skipped
        handle.remove()
        assert all(torch.equal(w, p) for w, p in zip(before, student.module.parameters()))
        assert all(float(s["step"]) == 5.0 for s in student.optimizer.state.values())


def test_counting_a_steps_tokens_does_not_wait_for_the_gpu():
    """The step's counts go to the GPU through pinned memory: the host comes back while a
    queued 1 s GPU sleep still runs (a blocking copy would wait for it)."""
    step = _step()
    mb = _batches(step.student.vocab)[0]
    step.count_valid([mb])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    counts = step.count_valid([mb])
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert float(counts["global_valid_tokens"]) == float(
        (mb.batch["token_mask"][:, 1:] & mb.batch["sample_mask"][:, None]).sum()
    )


def test_cuda_graph_replays_train_as_the_compiled_step():
    """Five steps of two micro-batches each (lengths change from step to step), CUDA graphs
    (the default) against the compiled step without them: losses within 1e-4 and fp32 weights
    within 2e-4 (an H200 gave losses within 1e-5 and 5.6e-5 on the weights: the embedding
    gradient's atomic adds sum in another order from run to run, and Adam's normalized update
    carries that to the weights)."""
    import torch._dynamo

    mbs = _batches(1000)
    losses, weights = [], []
    for overrides in ({"cuda_graphs": False}, {}):
        torch._dynamo.reset()
        step = _step(grad_accum=2, **overrides)
        _warm_up(step)
        run = [step.run([mbs[i % 4], mbs[(i + 1) % 4]]).metrics["loss"] for i in range(5)]
        losses.append(run)
        weights.append(_flat_weights(step))
    assert step.student.cuda_graphs and step.student.recompiles() == 0
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert float((weights[1] - weights[0]).abs().max()) <= 2e-4


def test_a_checkpointed_compiled_step_trains_without_cuda_graphs():
    """Activation checkpointing with the compiled layers: CUDA graphs stay off (their replay
    breaks on the recomputed forward) and the steps train with finite losses, no recompile."""
    import torch._dynamo

    torch._dynamo.reset()
    step = _step(grad_accum=2, activation_checkpointing=True)
    _warm_up(step)
    assert step.student.compiled and not step.student.cuda_graphs
    mbs = _batches(1000)
    losses = [step.run([mbs[i % 4], mbs[(i + 1) % 4]]).metrics["loss"] for i in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and step.student.recompiles() == 0
