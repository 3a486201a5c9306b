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
from services.trainer.startup import warm_up
from services.trainer.step import StudentStep
from services.trainer.student import is_prefix_mask
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_step(backend="aot_eager", **overrides) -> StudentStep:
    step = build_step(setup.trainer_config(None, compute={"compile": False}, **overrides))
    step.student.compiled = compile_student(step.student.compute, backend=backend) > 0
    return step


def _warm_up(step: StudentStep, max_length: int = 0) -> float | None:
    """The start-up step of the test configs' micro-batches of 2."""
    return warm_up(step.student, micro_batch=2, max_length=max_length, head=step.head)


def test_compile_is_off_on_cpu_unless_asked():
    step = build_step(setup.trainer_config(None))
    assert not step.student.compiled
    assert _warm_up(step) is None  # no start-up step: the CPU demo starts at once
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(step.student.compute))


def test_compiled_student_trains_every_batch_length_without_recompiling():
    step = _compiled_step()
    assert step.student.compiled
    assert _warm_up(step, max_length=40) is not None
    assert step.student.recompiles() == 0
    lengths = set()
    for batch in setup.micro_batches():  # lengths 15, 18, 25, 21
        lengths.add(batch["input_ids"].shape[1])
        step.run([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert len(lengths) == 4
    assert step.student.recompiles() == 0


def test_a_compiled_student_evaluates_eagerly_compiling_nothing_for_its_windows():
    step = _compiled_step()
    assert _warm_up(step, max_length=40) is not None
    texts = [f"def f(x):\n    return x + {i}\n" * (1 + 2 * i) for i in range(9)]
    result = step.student.evaluate(texts, 32)  # windows of many lengths up to 32, batches of 8
    assert step.student.recompiles() == 0
    eager = build_step(setup.trainer_config(None)).student.evaluate(texts, 32)
    assert result["bits_per_byte"] == pytest.approx(eager["bits_per_byte"], rel=1e-6)
    for batch in setup.micro_batches():  # and the steps after it still replay what they built
        step.run([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert step.student.recompiles() == 0


def test_compiled_student_gives_the_eager_logits_and_gradients():
    eager = build_step(setup.trainer_config(None)).student
    compiled = _compiled_step().student
    ids = setup.micro_batches()[2]["input_ids"]
    out_e, out_c = eager.forward(ids, None), compiled.forward(ids, None)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    out_e.float().logsumexp(-1).sum().backward()
    out_c.float().logsumexp(-1).sum().backward()
    for pe, pc in zip(eager.module.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5)


def test_each_decoder_layer_is_a_region_and_the_ladder_halves_down_to_64():
    student = _compiled_step().student
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(student.compute))
    assert student.compute.lm_head._compiled_call_impl is None  # the output layer stays eager
    assert warm_lengths(4096) == [4096, 2048, 1024, 512, 256, 128, 64]
    assert warm_lengths(100) == [100]


def _broken_backend(gm, example_inputs):
    raise RuntimeError("this backend builds nothing")


def test_a_student_compile_cannot_build_trains_eagerly_after_one_warning(caplog):
    step = _compiled_step(backend=_broken_backend)
    with caplog.at_level(logging.WARNING, logger="services.trainer.startup"):
        assert _warm_up(step) is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "trainer.compute.compile: false" in warnings[0].getMessage()
    assert not step.student.compiled and step.student.recompiles() is None
    result = step.run([setup.micro_batch(setup.micro_batches()[0], ["a"], with_teacher=False)])
    assert result.metrics["loss"] > 0 and step.student.step == 1


def test_right_padded_rows_give_the_same_logits_without_the_attention_mask():
    student = build_step(setup.trainer_config(None)).student
    batch = setup.micro_batches()[2]  # rows of 25 and 5 tokens
    mask = batch["token_mask"]
    assert is_prefix_mask(mask) and not bool(mask.all())
    with_mask = student.forward(batch["input_ids"], mask.long())
    without = student.forward(batch["input_ids"], None)
    real = mask.bool()
    torch.testing.assert_close(without[real], with_mask[real], rtol=1e-5, atol=1e-5)


def test_a_mask_with_a_hole_is_not_a_prefix():
    assert is_prefix_mask(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not is_prefix_mask(torch.tensor([[1, 0, 1], [1, 1, 1]]))
    assert not is_prefix_mask(torch.tensor([[0, 1, 1]]))


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
    step = _compiled_step()
    assert _warm_up(step, max_length=40) is not None
    after_compile = triton.knobs.runtime.jit_post_compile_hook
    after_compile(fn=None, key="k")  # before the first step's end: not counted
    batch = setup.micro_batches()[0]
    step.run([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert step.student.recompiles() == 0
    triton.knobs.runtime.jit_post_compile_hook(fn=None, key="k")  # what Triton calls after one
    assert step.student.recompiles() == 1 and seen == [1, 1]


def test_a_micro_batch_padded_to_a_length_multiple_trains_to_the_same_loss_and_weights(tmp_path):
    from xtoken_core.data.sample import pad_samples

    projection = setup.write_projection(tmp_path / "proj.pt")
    rows = setup.samples()[:2]
    plain = pad_samples(rows, **setup.pads())
    padded = pad_samples(rows, **setup.pads(), make_seq_div_by_student=16)
    assert plain["input_ids"].shape[1] % 16 and padded["input_ids"].shape[1] % 16 == 0
    out = []
    for batch in (plain, padded):
        torch.manual_seed(0)
        step = build_step(setup.trainer_config(projection, compute={"length_multiple": 16}))
        loss = step.run([setup.micro_batch(batch, ["a", "b"])]).metrics["loss"]
        out.append((loss, [p.detach().clone() for p in step.student.module.parameters()]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # AdamW: ~lr-sized steps


def test_the_start_up_ladder_takes_lengths_of_the_multiple(monkeypatch):
    import services.trainer.startup as startup

    step = _compiled_step()
    seen = []
    monkeypatch.setattr(
        startup, "warm_step", lambda student, ids, head=None: seen.append(ids.shape[1])
    )
    warm_up(step.student, micro_batch=2, max_length=192, length_multiple=48)
    assert seen == [192, 96]  # multiples of 48 already
    seen.clear()
    warm_up(step.student, micro_batch=2, max_length=320, length_multiple=64)
    assert seen == [320, 192, 128]  # 160 and 80 rounded up to multiples of 64


def test_a_ladder_cut_short_still_trains_a_shorter_micro_batch_compiling_it_at_its_step(
    monkeypatch,
):
    import services.trainer.startup as startup

    step = _compiled_step()
    seen = []
    real = startup.warm_step
    monkeypatch.setattr(
        startup, "warm_step", lambda s, ids, head=None: (seen.append(ids.shape[1]), real(s, ids))
    )
    warm_up(step.student, micro_batch=2, max_length=512, shortest=256)
    assert seen == [512, 256]  # no rungs below 256
    assert warm_lengths(512) == [512, 256, 128, 64]  # the default reaches down to 64
    batch = setup.micro_batches()[0]  # 15 tokens: below every rung
    result = step.run([setup.micro_batch(batch, ["a"], with_teacher=False)])
    assert result.metrics["loss"] > 0 and step.student.step == 1


def test_the_start_up_report_times_each_call_counts_cache_lookups_and_names_compiler_phases(
    tmp_path, monkeypatch
):
    from services.trainer.startup import start_up_brief

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    reports = []
    for _ in range(2):  # the second compile is another run's: it finds the first one's graphs
        torch._dynamo.reset()
        step = _compiled_step(backend="inductor")
        report: dict = {}
        seconds = warm_up(step.student, micro_batch=2, max_length=40, head=step.head,
                          report=report)  # fmt: skip
        assert [n for n, _ in report["calls"]] == warm_lengths(40, 64)
        assert 0 < sum(t for _, t in report["calls"]) <= seconds + 0.001 * len(report["calls"])
        phases = report["phases"]  # the compiler's timers of this start-up alone, largest first
        assert phases and all(v >= 0.05 for v in phases.values())
        assert list(phases.values()) == sorted(phases.values(), reverse=True)
        assert max(phases.values()) <= seconds + 0.01
        reports.append(report["caches"])
    first, second = (r["fx_graph"] for r in reports)
    assert first["miss"] >= 1 and first["hit"] == 0
    assert second["hit"] == first["miss"] and second["miss"] == 0
    brief = start_up_brief({"calls": [[512, 60.0], [512, 3.0], [256, 2.5]], "caches": reports[1]})
    assert brief.startswith(": the first call 60.0 s, the 2 others 5.5 s (2 lengths); ")
    assert f"Inductor's caches {sum(c['hit'] for c in reports[1].values())} hits" in brief
    assert start_up_brief({}) == ""
