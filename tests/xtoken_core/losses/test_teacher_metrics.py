"""Each teacher's own metrics in a loss of several teachers (``teacher{i}_kl_loss`` and the rest):
each equals the metric of a one-teacher loss of that teacher alone on the same batch, the totals
are their weighted sums (accuracy and chunk count their means), on every backend and through the
fused head; a one-teacher loss returns exactly :data:`METRIC_KEYS`."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_fused_head import _inputs, materialized, through_head
from tests.xtoken_core.losses.test_loss import (
    B,
    make_alignment,
    make_batch,
    make_logits,
    make_projection,
)
from xtoken_core.losses import (
    METRIC_KEYS,
    TEACHER_METRICS,
    CrossTokenizerLoss,
    CrossTokenizerLossConfig,
    teacher_metric_keys,
)

W1, U1 = 9, 10  # teacher 1's vocab and length (teacher 0's: test_loss's W = 11, U = 11)
WEIGHTS = (0.3, 0.7)
MODES = [("pkl", {"vocab_topk": 6}), ("pkl", {"vocab_topk": None}), ("gold", {}), ("xtoken", {})]
MODE_IDS = ["pkl-topk", "pkl", "gold", "xtoken"]


def two_teachers(seed: int, dtype: torch.dtype = torch.float64):
    """``(student_logits, [z0, z1], batch, batch_of_teacher_1_alone)``: teacher 1 has a vocab,
    a length and an alignment of its own; the second batch names its alignment ``alignment_*``."""
    zs, zt0 = make_logits(seed)
    g = torch.Generator().manual_seed(500 + seed)
    zt1 = 2 * torch.randn(B, U1, W1, generator=g, dtype=torch.float64)
    batch = make_batch(seed)
    alignment1 = make_alignment(seed + 50, Un=U1)
    alone1 = {**batch, **alignment1}
    batch.update({"teacher1_" + k: v for k, v in alignment1.items()})
    zs = zs.detach().to(dtype).requires_grad_()
    return zs, [zt0.to(dtype), zt1.to(dtype)], batch, alone1


def loss_of(projections, weights=None, **cfg) -> CrossTokenizerLoss:
    cfg = {"mode": "gold", "backend": "reference", "kl_weight": 0.6, "ce_weight": 0.4, **cfg}
    return CrossTokenizerLoss(
        CrossTokenizerLossConfig(projection=projections, teacher_weights=weights, **cfg)
    )


def assert_teacher_metrics(metrics, alone, *, rel: float) -> None:
    """``metrics`` (two teachers) hold each teacher's own figures, equal to ``alone[i]`` (the
    metrics of a one-teacher loss of teacher i), and totals made of them."""
    assert list(metrics) == [*METRIC_KEYS, *teacher_metric_keys(2)]
    for i, own in enumerate(alone):
        for name in TEACHER_METRICS:
            got, want = float(metrics[f"teacher{i}_{name}"]), float(own[name])
            assert got == pytest.approx(want, rel=rel, abs=1e-9), f"teacher{i}_{name}"
    t0, t1 = ({name: float(m[name]) for name in TEACHER_METRICS} for m in alone)
    for name in ("kl_loss", "kl_common", "l1_uncommon"):  # weighted sums
        want = WEIGHTS[0] * t0[name] + WEIGHTS[1] * t1[name]
        assert float(metrics[name]) == pytest.approx(want, rel=rel, abs=1e-9), name
    for name in ("proj_accuracy", "num_valid_chunks"):  # means over the teachers
        want = (t0[name] + t1[name]) / 2
        assert float(metrics[name]) == pytest.approx(want, rel=rel, abs=1e-9), name


def test_teacher_metric_keys_name_every_teacher_and_none_for_one():
    assert teacher_metric_keys(1) == ()
    assert teacher_metric_keys(2) == (
        "teacher0_kl_loss",
        "teacher0_kl_common",
        "teacher0_l1_uncommon",
        "teacher0_proj_accuracy",
        "teacher0_num_valid_chunks",
        "teacher1_kl_loss",
        "teacher1_kl_common",
        "teacher1_l1_uncommon",
        "teacher1_proj_accuracy",
        "teacher1_num_valid_chunks",
    )
    assert len(teacher_metric_keys(3)) == 15 and teacher_metric_keys(3)[-5] == "teacher2_kl_loss"


@pytest.mark.parametrize(("mode", "cfg"), MODES, ids=MODE_IDS)
def test_each_teachers_metrics_equal_a_loss_of_that_teacher_alone(mode, cfg):
    """Reference backend, fp64, each teacher over its own global denominator (two
    micro-batches' counts): exact to rounding."""
    zs, (zt0, zt1), batch, alone1 = two_teachers(1)
    proj0, proj1 = make_projection(), make_projection(W=W1)
    both = loss_of([proj0, proj1], WEIGHTS, mode=mode, **cfg)
    counts = both.count_valid([batch, make_batch(2) | _teacher1_alignment(2)])
    d0, d1 = counts["global_valid_chunks"].tolist()
    assert d0 != d1
    loss, metrics = both(zs, [zt0, zt1], batch, **counts)
    tokens = counts["global_valid_tokens"]
    one0, one1 = (loss_of(p, mode=mode, **cfg) for p in (proj0, proj1))
    _, m0 = one0(zs, zt0, batch, global_valid_chunks=d0, global_valid_tokens=tokens)
    _, m1 = one1(zs, zt1, alone1, global_valid_chunks=d1, global_valid_tokens=tokens)
    assert_teacher_metrics(metrics, [m0, m1], rel=1e-10)
    assert float(metrics["teacher0_kl_loss"]) != pytest.approx(float(metrics["teacher1_kl_loss"]))
    assert all(not v.requires_grad for v in metrics.values())
    assert loss.requires_grad


def test_each_teachers_metrics_over_its_local_count_without_global_counts():
    zs, (zt0, zt1), batch, alone1 = two_teachers(3)
    proj0, proj1 = make_projection(), make_projection(W=W1)
    _, metrics = loss_of([proj0, proj1], WEIGHTS, mode="xtoken")(zs, [zt0, zt1], batch)
    _, m0 = loss_of(proj0, mode="xtoken")(zs, zt0, batch)
    _, m1 = loss_of(proj1, mode="xtoken")(zs, zt1, alone1)
    assert m0["num_valid_chunks"] != m1["num_valid_chunks"]
    assert_teacher_metrics(metrics, [m0, m1], rel=1e-10)


@pytest.mark.parametrize(("mode", "cfg"), MODES, ids=MODE_IDS)
def test_the_cpu_path_gives_each_teachers_metrics(mode, cfg):
    """``backend: auto`` without CUDA (the CPU path), fp32 logits."""
    if torch.cuda.is_available():
        pytest.skip("auto picks the kernels where CUDA is available")
    zs, (zt0, zt1), batch, alone1 = two_teachers(4, torch.float32)
    proj0, proj1 = make_projection(), make_projection(W=W1)
    _, metrics = loss_of([proj0, proj1], WEIGHTS, mode=mode, backend="auto", **cfg)(
        zs, [zt0, zt1], batch
    )
    _, m0 = loss_of(proj0, mode=mode, backend="auto", **cfg)(zs, zt0, batch)
    _, m1 = loss_of(proj1, mode=mode, backend="auto", **cfg)(zs, zt1, alone1)
    assert_teacher_metrics(metrics, [m0, m1], rel=1e-5)


@pytest.mark.parametrize(("mode", "cfg"), MODES, ids=MODE_IDS)
def test_the_kernel_backend_gives_each_teachers_metrics(mode, cfg, monkeypatch):
    """The Triton kernels (interpreted on the CPU), fp32 logits: each teacher's figures as a
    kernel loss of it alone and as the reference's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, (zt0, zt1), batch, alone1 = two_teachers(5, torch.float32)
    proj0, proj1 = make_projection(), make_projection(W=W1)
    _, metrics = loss_of([proj0, proj1], WEIGHTS, mode=mode, backend="kernel", **cfg)(
        zs, [zt0, zt1], batch
    )
    _, m0 = loss_of(proj0, mode=mode, backend="kernel", **cfg)(zs, zt0, batch)
    _, m1 = loss_of(proj1, mode=mode, backend="kernel", **cfg)(zs, zt1, alone1)
    assert_teacher_metrics(metrics, [m0, m1], rel=1e-5)
    _, ref = loss_of([proj0, proj1], WEIGHTS, mode=mode, **cfg)(zs, [zt0, zt1], batch)
    for key, value in ref.items():
        assert float(metrics[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), key


def test_one_teacher_returns_exactly_the_metric_keys():
    zs, (zt0, _), batch, _ = two_teachers(6)
    _, metrics = loss_of(make_projection(), [0.5])(zs, zt0, batch)
    assert list(metrics) == list(METRIC_KEYS)


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_the_fused_head_gives_each_teachers_metrics_of_the_materialized_loss(backend, monkeypatch):
    """The head sums each teacher's figures over its blocks as it sums the totals."""
    dtype, rel = torch.float64, 1e-10
    if backend == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        dtype, rel = torch.float32, 1e-4
    _, (zt0, zt1), batch, _ = two_teachers(8)
    hidden, weight, _ = _inputs(8, dtype)
    teachers = [zt0.to(dtype), zt1.to(dtype)]
    both = loss_of([make_projection(), make_projection(W=W1)], WEIGHTS, backend=backend)
    counts = both.count_valid([batch, make_batch(9) | _teacher1_alignment(9)])
    ref = materialized(both, hidden, weight, teachers, batch, **counts)[3]
    got = through_head(both, hidden, weight, teachers, batch, block_rows=3, **counts)[3]
    assert set(got) == set(ref) == {*METRIC_KEYS, *teacher_metric_keys(2)}
    for key, value in ref.items():
        assert float(got[key]) == pytest.approx(float(value), rel=rel, abs=1e-9), key


def _teacher1_alignment(seed: int) -> dict[str, torch.Tensor]:
    return {"teacher1_" + k: v for k, v in make_alignment(seed + 50, Un=U1).items()}
