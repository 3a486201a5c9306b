"""FusedHead against the materialized path (``hidden @ W^T`` then CrossTokenizerLoss, or the
student CE): loss, metrics and the gradients of the hidden states and the output weight, in every
mode, with several blocks per sample, odd vocabularies, tied embeddings, and at full size on a GPU.

Tolerances: loss relative error <= 1e-3 and gradient cosine >= 0.999 wherever rounding differs
(the kernel backend against the fp64 reference, bf16); fp64 on the reference backend is exact to
rounding (1e-10).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.xtoken_core.losses.test_head_blocks import random_batch
from tests.xtoken_core.losses.test_loss import (
    B,
    T,
    V,
    W,
    make_alignment,
    make_batch,
    make_logits,
    make_projection,
)
from xtoken_core.losses import (
    METRIC_KEYS,
    CrossTokenizerLoss,
    CrossTokenizerLossConfig,
    FusedHead,
    student_ce,
)
from xtoken_core.losses.head_blocks import plan_blocks

D = 8
CE_KEYS = ("loss", "ce_loss", "accuracy")


@pytest.fixture
def interpret(monkeypatch):
    """The kernel backend's device: CUDA, else the CPU with the Triton interpreter on."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def _loss_fn(mode: str, backend: str, **cfg) -> CrossTokenizerLoss | None:
    if mode == "ce":
        return None
    cfg = {"kl_weight": 0.7, "ce_weight": 0.3, **cfg}
    config = CrossTokenizerLossConfig(
        projection=make_projection(), mode=mode, backend=backend, **cfg
    )
    return CrossTokenizerLoss(config)


def _inputs(seed: int, dtype: torch.dtype, device: str = "cpu", teacher_logits=None):
    g = torch.Generator().manual_seed(300 + seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5
    zt = make_logits(seed)[1] if teacher_logits is None else teacher_logits
    return hidden.to(device, dtype), weight.to(device, dtype), zt.to(device, dtype)


def materialized(loss_fn, hidden, weight, zt, batch, **counts):
    """``(loss, d_hidden, d_weight, metrics)`` of the whole logits ``hidden @ weight^T``."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = h @ w.t()
    if loss_fn is None:
        targets = (batch["input_ids"], batch["token_mask"], batch.get("sample_mask"))
        nll, correct, n = student_ce(logits, *targets)
        denom = counts.get("global_valid_tokens", n)
        loss = nll / denom
        metrics = {"loss": loss.detach(), "ce_loss": loss.detach(), "accuracy": correct / denom}
    else:
        loss, metrics = loss_fn(logits, zt, batch, **counts)
    d_h, d_w = torch.autograd.grad(loss, (h, w))
    return loss.detach(), d_h, d_w, metrics


def through_head(loss_fn, hidden, weight, zt, batch, block_rows=4, **counts):
    """The same by :class:`FusedHead` (``block_rows=4``: several blocks per sample)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, metrics = FusedHead(loss_fn, block_rows)(h, w, zt, batch, **counts)
    d_h, d_w = torch.autograd.grad(loss, (h, w))
    return loss.detach(), d_h, d_w, metrics


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0)
    )


def assert_close_results(got, ref, *, rel: float, cos: float) -> None:
    """Loss relative error <= ``rel``; each gradient's cosine >= ``cos``; metrics as the loss."""
    loss, d_h, d_w, metrics = got
    ref_loss, ref_h, ref_w, ref_metrics = ref
    assert abs(float(loss) - float(ref_loss)) <= rel * abs(float(ref_loss)) + 1e-12
    assert cosine(d_h, ref_h) >= cos and cosine(d_w, ref_w) >= cos
    assert float(d_h.norm()) == pytest.approx(float(ref_h.norm()), rel=max(rel, 1e-9))
    assert float(d_w.norm()) == pytest.approx(float(ref_w.norm()), rel=max(rel, 1e-9))
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        assert float(metrics[key]) == pytest.approx(float(value), rel=max(rel, 1e-9), abs=1e-9)


def _masked_batch(seed: int) -> dict[str, torch.Tensor]:
    batch = make_batch(seed)
    batch["sample_mask"][1] = False  # a masked sample: its rows are skipped
    return batch


MODES = [("pkl", {"vocab_topk": None}), ("pkl", {"vocab_topk": 4}), ("gold", {}), ("xtoken", {})]
MODES += [("ce", {})]
MODE_IDS = ["pkl", "pkl-topk", "gold", "xtoken", "ce"]


@pytest.mark.parametrize(("mode", "cfg"), MODES, ids=MODE_IDS)
def test_fp64_head_equals_the_materialized_reference(mode, cfg):
    """fp64, reference backend: the blocks sum to the whole loss to rounding (1e-10)."""
    batch = _masked_batch(1)
    hidden, weight, zt = _inputs(1, torch.float64)
    loss_fn = _loss_fn(mode, "reference", **cfg)
    ref = materialized(loss_fn, hidden, weight, zt, batch)
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)
    for key in METRIC_KEYS if loss_fn else CE_KEYS:
        assert key in got[3]


@pytest.mark.parametrize(("mode", "cfg"), MODES, ids=MODE_IDS)
def test_kernel_head_matches_the_materialized_kernels_and_the_fp64_reference(mode, cfg, interpret):
    """Kernel backend (Triton; interpreted on CPU), fp32: against the materialized kernel path
    and against the fp64 reference, loss relative error <= 1e-3, gradient cosine >= 0.999."""
    batch = _masked_batch(2)
    on = {k: v.to(interpret) for k, v in batch.items()}
    hidden, weight, zt = _inputs(2, torch.float32, interpret)
    loss_fn = _loss_fn(mode, "kernel", **cfg)
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert_close_results(got, materialized(loss_fn, hidden, weight, zt, on), rel=1e-3, cos=0.999)
    h64, w64, zt64 = hidden.double().cpu(), weight.double().cpu(), zt.double().cpu()
    ref = materialized(_loss_fn(mode, "reference", **cfg), h64, w64, zt64, batch)
    got_cpu = tuple(x.cpu() for x in got[:3]) + ({k: v.cpu() for k, v in got[3].items()},)
    assert_close_results(got_cpu, ref, rel=1e-3, cos=0.999)


@pytest.mark.parametrize("mode", ["pkl", "gold", "ce"])
def test_bf16_head_matches_the_materialized_bf16_path(mode, interpret):
    """bf16 hidden states and weight, kernel backend: loss relative error <= 1e-3, gradient
    cosine >= 0.999 against the materialized bf16 path; the gradients keep their dtypes."""
    batch = _masked_batch(3)
    on = {k: v.to(interpret) for k, v in batch.items()}
    hidden, weight, zt = _inputs(3, torch.bfloat16, interpret)
    loss_fn = _loss_fn(mode, "kernel", vocab_topk=5)
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert_close_results(got, materialized(loss_fn, hidden, weight, zt, on), rel=1e-3, cos=0.999)


@pytest.mark.parametrize("rule", ["valid", "all"])
def test_every_block_picks_the_top_k_teacher_columns_of_the_whole_micro_batch(rule):
    """P-KL's vocab_topk columns come from rows of other blocks (the last position, a padded
    tail): one row per block, the loss still equals the materialized one (1e-10)."""
    batch = make_batch(25)
    hidden, weight, zt = _inputs(25, torch.float64)
    zt[:, -1, :3] = 40.0  # the last position never belongs to a (shifted) chunk
    batch["alignment_teacher_chunk_id"][0, -3:] = -1  # a padded tail
    zt[0, -4:, 3] = 40.0
    results = {}
    for topk in (4, None):
        loss_fn = _loss_fn("pkl", "reference", vocab_topk=topk, topk_columns=rule)
        ref = materialized(loss_fn, hidden, weight, zt, batch)
        got = through_head(loss_fn, hidden, weight, zt, batch, block_rows=1)
        assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)
        results[topk] = float(got[0])
    assert results[4] != pytest.approx(results[None], rel=1e-3)  # the pick matters here


def test_tied_embeddings_get_both_gradients_on_the_one_parameter():
    """A tied output layer (the embedding's weight): the embedding's gradient from the input
    side and from the head add up as in the materialized model (fp64, 1e-10)."""
    batch = _masked_batch(4)
    loss_fn = _loss_fn("gold", "reference")
    zt = make_logits(4)[1]
    grads = []
    for head in (False, True):
        torch.manual_seed(0)
        embed = torch.nn.Embedding(V, D, dtype=torch.float64)
        mix = torch.nn.Linear(D, D, dtype=torch.float64)
        hidden = torch.tanh(mix(embed(batch["input_ids"])))
        if head:
            loss, _ = FusedHead(loss_fn, 4)(hidden, embed.weight, zt, batch)
        else:
            loss, _ = loss_fn(hidden @ embed.weight.t(), zt, batch)
        loss.backward()
        grads.append((float(loss), embed.weight.grad.clone(), mix.weight.grad.clone()))
    (l0, e0, m0), (l1, e1, m1) = grads
    assert l1 == pytest.approx(l0, rel=1e-10)
    torch.testing.assert_close(e1, e0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m1, m0, rtol=1e-10, atol=1e-12)


def test_several_teachers_with_their_own_alignments_split_no_chunk_of_either():
    batch = _masked_batch(7)
    W1, U1 = 9, 10
    for key, value in make_alignment(9, Un=U1).items():
        batch["teacher1_" + key] = value
    hidden, weight, zt0 = _inputs(7, torch.float64)
    zt1 = torch.randn(B, U1, W1, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    config = CrossTokenizerLossConfig(
        projection=[make_projection(), make_projection(W=W1)],
        teacher_weights=[0.25, 0.75],
        mode="pkl",
        vocab_topk=4,
        backend="reference",
    )
    loss_fn = CrossTokenizerLoss(config)
    ref = materialized(loss_fn, hidden, weight, [zt0, zt1], batch)
    got = through_head(loss_fn, hidden, weight, [zt0, zt1], batch, block_rows=3)
    assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)


def test_dynamic_scaling_runs_as_one_block_and_equals_the_materialized_loss():
    """|ce| / |kd| of the whole micro-batch does not split over blocks: one block, exact (fp64;
    the cosine of two equal gradients reads 1 to within a few units of its last place)."""
    batch = _masked_batch(10)
    hidden, weight, zt = _inputs(10, torch.float64)
    loss_fn = _loss_fn("pkl", "reference", dynamic_scaling=True)
    ref = materialized(loss_fn, hidden, weight, zt, batch)
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)


def test_global_denominators_divide_every_block_and_the_metrics_add_up():
    batch = _masked_batch(12)
    hidden, weight, zt = _inputs(12, torch.float64)
    loss_fn = _loss_fn("xtoken", "reference")
    counts = loss_fn.count_valid([batch, make_batch(13)])
    ref = materialized(loss_fn, hidden, weight, zt, batch, **counts)
    got = through_head(loss_fn, hidden, weight, zt, batch, block_rows=2, **counts)
    assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)


def test_random_alignments_with_padding_give_the_materialized_loss():
    """Random chunks, gaps, a masked sample and padded tails (the head skips rows that reach
    no term): fp64 reference, 1e-10, for block sizes from 1 row to one block."""
    for seed in range(6):
        batch = random_batch(seed, 1)
        b, t = batch["input_ids"].shape
        u = batch["teacher0_alignment_teacher_chunk_id"].shape[1]
        batch["input_ids"] = batch["input_ids"] % V
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(b, t, D, generator=g, dtype=torch.float64)
        weight = torch.randn(V, D, generator=g, dtype=torch.float64)
        zt = torch.randn(b, u, W, generator=g, dtype=torch.float64)
        loss_fn = _loss_fn("pkl", "reference", vocab_topk=4)
        ref = materialized(loss_fn, hidden, weight, zt, batch)
        for rows in (1, 5, 1000):
            got = through_head(loss_fn, hidden, weight, zt, batch, block_rows=rows)
            assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)


def test_bad_shapes_and_ids_are_refused_before_the_blocks():
    batch = make_batch(14)
    hidden, weight, zt = _inputs(14, torch.float64)
    loss_fn = _loss_fn("gold", "reference")
    with pytest.raises(ValueError, match="hidden size"):
        FusedHead(loss_fn)(hidden, weight[:, :-1], zt, batch)
    with pytest.raises(ValueError, match="alignment_student_chunk_id"):
        FusedHead(loss_fn)(hidden[:, :-1], weight, zt, batch)
    bad = dict(batch, alignment_teacher_chunk_id=batch["alignment_teacher_chunk_id"] + 50)
    with pytest.raises(ValueError, match="alignment_teacher_chunk_id has ids"):
        FusedHead(loss_fn)(hidden, weight, zt, bad)
    with pytest.raises(ValueError, match="block_rows=0"):
        FusedHead(loss_fn, 0)


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_the_blocks_input_checks_are_read_once_after_the_last_block(backend, monkeypatch):
    """The loss calls of the blocks queue their checks on one held set, read once (no host wait
    per block); a CE target outside the vocab and a NaN in one block still fail with the loss's
    own messages."""
    from xtoken_core.losses.checks import DeferredChecks

    if backend == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dtype = torch.float64 if backend == "reference" else torch.float32
    batch = _masked_batch(3)
    hidden, weight, zt = _inputs(3, dtype)
    loss_fn = _loss_fn("pkl", backend)
    reads = []
    read = DeferredChecks._read
    monkeypatch.setattr(
        DeferredChecks, "_read", lambda self, after: reads.append(1) or read(self, after)
    )
    head = FusedHead(loss_fn, block_rows=4)
    assert len(plan_blocks(batch, 1, 4)) > 2
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert len(reads) == 1
    assert_close_results(
        got, materialized(loss_fn, hidden, weight, zt, batch), rel=1e-5, cos=0.9999
    )
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    bad["input_ids"][0, 3] = V + 5
    bad["token_mask"] = torch.ones_like(bad["input_ids"], dtype=torch.bool)
    with pytest.raises(ValueError, match=f"input_ids hold {V + 5} at a counted position"):
        head(hidden, weight, zt, bad)
    nan = hidden.clone()
    nan[0, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="student_logits holds NaN or inf"):
        head(nan, weight, zt, batch)


def test_held_checks_keep_only_their_sums_and_raise_when_finished():
    from xtoken_core.losses.checks import DeferredChecks

    checks = DeferredChecks(hold=True)
    x = torch.tensor([1.0, float("inf")])
    checks.finite("student_logits", x)
    checks.run()  # each loss call's: nothing read yet
    assert all(item[2] is None for item in checks._items)  # no block's logits kept alive
    with pytest.raises(ValueError, match="student_logits holds NaN or inf"):
        checks.finish()
    checks.finite("student_logits", torch.ones(3))
    checks.run()
    checks.finish()  # what failed before is gone with that read


# ----------------------------------------------------------------------------- full size, GPU


def _full_size_case(mode: str):
    """B*T = 4096 rows (2 x 2048), V = 151936, W = 49152, D = 896, bf16, random chunks."""
    Bn, Tn, Un, Vn, Wn, Dn, Kn = 2, 2048, 1900, 151936, 49152, 896, 4
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, Wn, (Vn, Kn), generator=g)
    likelihoods = torch.rand(Vn, Kn, generator=g) + 0.05
    config = {"kl_weight": 0.7, "ce_weight": 0.3, "vocab_topk": 8192}
    loss_fn = None
    if mode != "ce":
        loss_fn = CrossTokenizerLoss(
            CrossTokenizerLossConfig(
                projection=(indices, likelihoods / likelihoods.sum(1, keepdim=True)),
                mode=mode,
                backend="kernel",
                **config,
            )
        )
    s_ids = torch.full((Bn, Tn), -1, dtype=torch.long)
    t_ids = torch.full((Bn, Un), -1, dtype=torch.long)
    C = 1800
    for b in range(Bn):
        ps = pt = c = 0
        while c < C:
            ls, lt = (int(x) for x in torch.randint(1, 3, (2,), generator=g))
            if ps + ls > Tn - 8 or pt + lt > Un:
                break
            s_ids[b, ps : ps + ls], t_ids[b, pt : pt + lt] = c, c
            ps, pt, c = ps + ls, pt + lt, c + 1
    batch = {
        "input_ids": torch.randint(0, Vn, (Bn, Tn), generator=g),
        "token_mask": torch.ones(Bn, Tn, dtype=torch.bool),
        "sample_mask": torch.ones(Bn, dtype=torch.bool),
        "alignment_student_chunk_id": s_ids,
        "alignment_teacher_chunk_id": t_ids,
        "alignment_pair_valid": torch.rand(Bn, C, generator=g) > 0.1,
    }
    dev = "cuda"
    hidden = torch.randn(Bn, Tn, Dn, generator=g).to(dev, torch.bfloat16)
    weight = (torch.randn(Vn, Dn, generator=g) / Dn**0.5).to(dev, torch.bfloat16)
    zt = (3 * torch.randn(Bn, Un, Wn, generator=g)).to(dev, torch.bfloat16)
    return loss_fn, hidden, weight, zt, batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken", "ce"])
def test_full_size_bf16_head_matches_the_materialized_path_in_less_memory(mode):
    """B*T = 4096, V = 151936, bf16, kernel backend: loss relative error <= 1e-3, gradient
    cosine >= 0.999, and the head's peak memory below the materialized path's."""
    loss_fn, hidden, weight, zt, batch = _full_size_case(mode)
    on = {k: v.cuda() for k, v in batch.items()}
    counts = {"global_valid_tokens": on["token_mask"][:, 1:].sum().float()}
    if loss_fn is not None:
        counts = {k: v.cuda() for k, v in loss_fn.count_valid([batch]).items()}
    runs, peaks = {}, {}
    for name in ("materialized", "head"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if name == "head":
            runs[name] = through_head(loss_fn, hidden, weight, zt, batch, 1024, **counts)
        else:
            runs[name] = materialized(loss_fn, hidden, weight, zt, on, **counts)
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{mode}: peak GiB above inputs {peaks}")
    assert_close_results(runs["head"], runs["materialized"], rel=1e-3, cos=0.999)
    assert peaks["head"] < peaks["materialized"]


class _HostCopies(TorchDispatchMode):
    """Records each copy onto a ``device_type`` device from pageable host memory (onto a cuda
    device such a copy waits for every kernel queued before it)."""

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.device_type = device_type
        self.pageable: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            to = kwargs.get("device") if func is torch.ops.aten._to_copy.default else args[0].device
            onto = to is not None and torch.device(to).type == self.device_type
            if onto and src.device.type == "cpu" and src.numel() and not src.is_pinned():
                self.pageable.append(f"{tuple(src.shape)} {src.dtype}")
        return func(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pkl_head_queues_its_blocks_without_waiting_for_the_gpu():
    """After a first call (the projection's tables), a micro-batch's P-KL forward and backward
    by blocks of 1,024 rows: no synchronizing call and no copy from pageable host memory."""
    loss_fn, hidden, weight, zt, batch = _full_size_case("pkl")
    loss_fn = CrossTokenizerLoss(dataclasses.replace(loss_fn.config, check_inputs=False))
    counts = {k: v.cuda() for k, v in loss_fn.count_valid([batch]).items()}
    through_head(loss_fn, hidden, weight, zt, batch, 1024, **counts)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    copies = _HostCopies()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with copies:
            loss, _ = FusedHead(loss_fn, 1024)(h, w, zt, batch, **counts)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert copies.pageable == []
    assert torch.isfinite(loss) and h.grad is not None and w.grad is not None


def test_a_batch_without_ce_targets_gives_the_kd_term_alone():
    batch = {k: v for k, v in make_batch(15).items() if k not in ("input_ids", "token_mask")}
    hidden, weight, zt = _inputs(15, torch.float64)
    loss_fn = _loss_fn("gold", "reference", ce_weight=0.0)
    ref = materialized(loss_fn, hidden, weight, zt, batch)
    got = through_head(loss_fn, hidden, weight, zt, batch)
    assert_close_results(got, ref, rel=1e-10, cos=1 - 1e-12)
    with pytest.raises(ValueError, match="no input_ids but ce_weight > 0"):
        through_head(_loss_fn("gold", "reference"), hidden, weight, zt, batch)
