"""TrainerWorker without sockets: the schedule, optimizer steps, skipped steps, the CE-only mode."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.worker import (
    TrainerWorker,
    is_allocation_failure,
    lr_lambda,
    startup_oom_message,
)
from tests.services.trainer import distill_setup as setup
from xtoken_core.losses import CrossTokenizerLossConfig


def _params(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.module.named_parameters()}


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


def test_a_step_reports_the_learning_rate_it_used():
    config = setup.trainer_config(None, optim={"lr": 1e-3, "warmup_steps": 4}, max_steps=8)
    worker = TrainerWorker(config)
    batch = setup.micro_batches()[0]
    lrs = [
        worker.train_step([setup.micro_batch(batch, ["a"], False)]).metrics["lr"] for _ in range(5)
    ]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert worker.step == 5


def test_steps_on_a_fixed_batch_lower_the_pkl_loss(projection):
    worker = TrainerWorker(setup.trainer_config(projection, loss={"ce_weight": 0.5}))
    assert worker.loss_fn is not None
    batch = setup.micro_batches()[1]
    mbs = [setup.micro_batch(batch, ["a", "b"])]
    losses = [worker.train_step(mbs).metrics for _ in range(6)]
    assert all(math.isfinite(m["loss"]) for m in losses)
    curve = [m["loss"] for m in losses]
    assert all(b < a for a, b in zip(curve, curve[1:])), curve
    assert losses[-1]["kl_loss"] < losses[0]["kl_loss"]
    assert mbs[0].context == {"teacher": 6, "done": 6}  # logits once, slot released once a step
    assert losses[0]["tokens"] == int(batch["input_lengths"].sum())
    assert worker.step == 6 and worker.skipped_steps == 0


# a skipped first update means the schedule steps before the optimizer ever did: intended
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_step_returns_before_its_figures_are_read_and_the_next_step_reads_them():
    # the host queues step 2 while step 1 finishes: step 1's figures are read by then at the
    # latest; a skipped update counts once its step is read (the count reads it)
    worker = TrainerWorker(setup.trainer_config(None))
    param = next(worker.module.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    first = worker.train_step([mb])
    handle.remove()
    assert not first.read and first.keys == ["a"] and first.step == 1
    second = worker.train_step([mb])
    assert first.read and not second.read
    assert first.skipped and not math.isfinite(first.metrics["grad_norm"])
    assert worker.skipped_steps == 1 and second.read  # the count reads the last step too
    assert not second.skipped and math.isfinite(second.metrics["loss"])
    assert set(second.times) >= {"forward", "backward", "optimizer", "sync"}


# a skipped first update means the schedule steps before the optimizer ever did: intended
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_non_finite_gradient_skips_the_update_and_counts_it():
    worker = TrainerWorker(setup.trainer_config(None))
    before = _params(worker)
    param = next(worker.module.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    mb = setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)
    result = worker.train_step([mb])
    handle.remove()
    assert result.skipped and worker.skipped_steps == 1
    assert not math.isfinite(result.metrics["grad_norm"])
    after = _params(worker)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed weights"
    assert all(p.grad is None for p in worker.module.parameters())  # nothing leaks to the next
    # the fused AdamW skipped the whole update: its state is as new (no step counted)
    for state in worker.optimizer.state.values():
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    result = worker.train_step([mb])  # the next finite step trains again
    assert not result.skipped and worker.skipped_steps == 1 and worker.step == 2
    assert any(not torch.equal(before[n], p) for n, p in worker.module.named_parameters())


def test_ce_mode_needs_no_projection_nor_teacher():
    config = TrainerConfig(
        student="tiny",
        student_tokenizer=setup.STUDENT_TOKENIZER,
        teacher_tokenizer=setup.TEACHER_TOKENIZER,
        loss=CrossTokenizerLossConfig(mode="ce"),
    )
    worker = TrainerWorker(config)
    assert worker.loss_fn is None and not config.loss.uses_teacher
    batch = setup.micro_batches()[2]
    mb = setup.micro_batch(batch, ["a", "b"], with_teacher=False)
    first = worker.train_step([mb]).metrics
    for _ in range(3):
        last = worker.train_step([mb]).metrics
    assert set(first) >= {"loss", "ce_loss", "accuracy", "grad_norm", "lr", "tokens"}
    assert first["loss"] == first["ce_loss"]
    assert last["loss"] < first["loss"]


def test_pkl_mode_without_a_projection_is_a_config_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"loss.projection.*xtoken projection build"):
        setup.trainer_config(None, loss={"mode": "pkl"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"micro_batch": 0}, "micro_batch=0: must be >= 1"),
        ({"optim": {"min_lr_ratio": 1.5}}, r"min_lr_ratio=1.5: must be in \[0, 1\]"),
        ({"loss": {"mode": "ce", "ce_weight": 0.0}}, "trains nothing"),
        ({"queue_timeout_s": 0.0}, "queue_timeout_s=0.0: must be > 0 seconds"),
        ({"packed_attention": "dense"}, "packed_attention='dense': use auto, flex_attention"),
    ],
)
def test_trainer_config_names_a_bad_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        setup.trainer_config(None, **overrides)


def _recorded_projection(path, student_tok, teacher_tok, indices=None):
    """The test projection saved with ``student_tok -> teacher_tok`` as its recorded pair."""
    from xtoken_core.data.projection_build import (
        build_projection,
        projection_metadata,
        save_projection,
    )

    result = build_projection(*setup.tokenizers(), 4)
    if indices is not None:
        result = {"indices": indices, "likelihoods": (indices >= 0).float()}
    save_projection(result, path, projection_metadata(student_tok, teacher_tok))
    return str(path)


def test_a_trainer_refuses_a_projection_built_for_other_tokenizers(tmp_path):
    student, _ = setup.tokenizers()
    path = _recorded_projection(tmp_path / "proj.pt", student, student)  # teacher side wrong
    with pytest.raises(ValueError, match=r"built for teacher tokenizer.*xtoken projection build"):
        TrainerWorker(setup.trainer_config(path))


def test_a_trainer_refuses_a_projection_with_no_usable_row(tmp_path):
    student, teacher = setup.tokenizers()
    empty = torch.full((student.vocab_size, 4), -1, dtype=torch.long)
    path = _recorded_projection(tmp_path / "proj.pt", student, teacher, indices=empty)
    with pytest.raises(ValueError, match="no usable row"):
        TrainerWorker(setup.trainer_config(path))


def test_a_trainer_accepts_the_projection_built_for_its_tokenizers(tmp_path):
    path = _recorded_projection(tmp_path / "proj.pt", *setup.tokenizers())
    assert TrainerWorker(setup.trainer_config(path)).loss_fn is not None


def test_activation_checkpointing_keeps_the_gradients_and_saves_fewer_activations(projection):
    from tests.services.trainer.dp_ranks import capture_step_gradients

    batch = setup.micro_batches()[1]
    grads, saved = {}, {}
    for ckpt in (False, True):
        worker = TrainerWorker(setup.trainer_config(projection, activation_checkpointing=ckpt))
        assert worker.module.model.layers[0].gradient_checkpointing is ckpt
        count = [0]  # elements the forward keeps for the backward

        def pack(t: torch.Tensor, count=count) -> torch.Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grads[ckpt], _ = capture_step_gradients(worker, [setup.micro_batch(batch, ["a", "b"])])
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
    config = setup.trainer_config(None, activation_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing=false"):
        TrainerWorker(config, model=Bare(vocab))


def test_a_startup_step_that_does_not_fit_names_the_settings_and_the_other_processes():
    alone = startup_oom_message(4, 2048, "cuda:0", 80 * 2**30, int(0.6 * 2**30))
    assert alone == (
        "a student step of micro_batch=4 x 2048 tokens does not fit in cuda:0's memory (80 GiB): "
        "lower trainer.micro_batch, or set trainer.activation_checkpointing: true"
    )
    shared = startup_oom_message(4, 2048, "cuda:0", 80 * 2**30, 54 * 2**30)
    assert shared.startswith(alone)
    assert "other processes hold 54.0 GiB of it (a teacher, rollout workers" in shared
    assert startup_oom_message(1, 64, "cpu", None, None).endswith(
        "cpu's memory: lower trainer.micro_batch, or set trainer.activation_checkpointing: true"
    )


def test_out_of_memory_under_another_name_is_told_from_a_compile_failure():
    cublas = RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    assert is_allocation_failure(cublas)
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("Inductor: compiling the backward failed") from oom
    except RuntimeError as wrapped:
        assert is_allocation_failure(wrapped)
    assert not is_allocation_failure(RuntimeError("Dynamo cannot trace this call"))
