"""Sparse top-K teacher targets: encode and decode round trip to the logits, the rest mass spread
evenly, an exact rest where the top K hold nearly all the mass, a finite floor where it is 0
(applied before the log-partition), bad K and bad targets refused in one line, and the
cross-tokenizer losses (P-KL, gold, relaxed gold; P-KL also at its default ``vocab_topk`` below
the teacher vocab) of decoded targets equal to those of the full logits when K covers the
vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_batch, make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.wire import topk as topk_mod
from xtoken_core.wire.topk import (
    LOG_FLOOR,
    TopK,
    check_top_k,
    decode_dtype,
    decode_topk,
    encode_topk,
    topk_bytes_per_token,
)


def _logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g)


def test_k_covering_the_vocab_round_trips_to_the_logits_themselves():
    # a per-position offset that log-probs would lose: the decode must give it back
    z_BUW = _logits(2, 5, 17) + 40.0 * torch.arange(5.0)[:, None]
    targets = encode_topk(z_BUW, 17)
    assert targets.ids_NK.dtype == torch.int32 and targets.ids_NK.shape == (2, 5, 17)
    assert targets.logprobs_NK.dtype == torch.float32 and targets.rest_N.shape == (2, 5)
    assert targets.lse_N.dtype == torch.float32 and targets.lse_N.shape == (2, 5)
    torch.testing.assert_close(targets.lse_N, torch.logsumexp(z_BUW, -1), rtol=0, atol=1e-5)
    assert torch.isneginf(targets.rest_N).all()  # no mass outside the K ids
    dense_BUW = decode_topk(targets, 17)
    torch.testing.assert_close(dense_BUW, z_BUW, rtol=0, atol=2e-5)  # fp32 rounding of z - lse


def test_decode_keeps_the_top_k_and_spreads_the_rest_evenly_over_the_other_ids():
    W, K = 23, 5
    z_NW = _logits(7, W, seed=1)
    lp_NW = torch.log_softmax(z_NW.double(), -1)
    targets = encode_topk(z_NW, K)
    top_NK = lp_NW.topk(K, -1)
    assert torch.equal(targets.ids_NK.long(), top_NK.indices)  # by decreasing log-prob
    torch.testing.assert_close(targets.logprobs_NK.double(), top_NK.values, rtol=0, atol=2e-6)
    rest_N = torch.log1p(-top_NK.values.exp().sum(-1))
    torch.testing.assert_close(targets.rest_N.double(), rest_N, rtol=0, atol=2e-6)

    dense_NW = decode_topk(targets, W).double()
    # the top K ids get their logits back, the others the log of an equal share of the rest
    torch.testing.assert_close(
        dense_NW.gather(-1, top_NK.indices),
        z_NW.double().gather(-1, top_NK.indices),
        rtol=0,
        atol=2e-6,
    )
    lse_N = torch.logsumexp(z_NW.double(), -1)
    others_NW = torch.ones_like(dense_NW, dtype=torch.bool).scatter_(-1, top_NK.indices, False)
    others = dense_NW[others_NW].reshape(7, W - K)
    want = (rest_N - math.log(W - K) + lse_N)[:, None].expand(7, W - K)
    torch.testing.assert_close(others, want, rtol=0, atol=2e-6)
    # the same partition as the logits: the decoded probabilities still sum to 1
    torch.testing.assert_close(torch.logsumexp(dense_NW, -1), lse_N, rtol=0, atol=2e-6)


def test_the_rest_stays_exact_when_the_top_k_hold_nearly_all_the_mass():
    # one id at +30: the others hold ~1e-12 of the mass, which 1 - sum(p) in fp32 rounds to 0
    z_W = torch.zeros(50)
    z_W[3] = 30.0
    targets = encode_topk(z_W, 1)
    exact = 49 * math.exp(-30) / (1 + 49 * math.exp(-30))
    assert targets.rest_N.item() == pytest.approx(math.log(exact), rel=1e-6)
    assert math.isfinite(decode_topk(targets, 50)[0].item())


@pytest.mark.parametrize("top", [0.0, 20.0, -2.0e4])
@pytest.mark.parametrize("others", [float("-inf"), -1e5])
def test_a_rest_of_zero_or_below_the_floor_decodes_to_the_floor_below_the_logit(others, top):
    # -inf: ids the teacher masks (no mass at all); -1e5 below the top: a mass exp() cannot hold
    # in fp32. The floor is relative to the row: at a top logit of -2e4 a floor of -1e4 applied
    # after adding the log-partition would give the masked ids nearly all the mass.
    z_W = torch.tensor([top, top + others, top + others, top + others])
    targets = encode_topk(z_W, 1)
    assert targets.rest_N.item() < LOG_FLOOR and targets.lse_N.item() == top
    dense_W = decode_topk(targets, 4)
    assert dense_W.isfinite().all()
    assert dense_W.tolist() == [top, *[LOG_FLOOR + top] * 3]
    assert torch.softmax(dense_W / 0.5, -1).tolist() == [1.0, 0.0, 0.0, 0.0]  # no NaN


def test_encoding_in_blocks_gives_what_one_block_gives(monkeypatch):
    z_NW = _logits(37, 19, seed=2).to(torch.bfloat16)
    whole = encode_topk(z_NW, 4)
    monkeypatch.setattr(topk_mod, "_BLOCK_ELEMENTS", 19 * 5)  # blocks of 5 positions
    for a, b in zip(encode_topk(z_NW, 4), whole, strict=True):
        assert torch.equal(a, b)


def test_the_logits_are_left_untouched():
    z_NW = _logits(3, 9, seed=3)
    before = z_NW.clone()
    encode_topk(z_NW, 2)
    assert torch.equal(z_NW, before)


def test_bf16_logprobs_are_the_fp32_ones_rounded():
    z_NW = _logits(4, 30, seed=4)
    fp32 = encode_topk(z_NW, 6)
    bf16 = encode_topk(z_NW, 6, logprobs_dtype=torch.bfloat16)
    assert bf16.logprobs_NK.dtype == torch.bfloat16 and torch.equal(bf16.ids_NK, fp32.ids_NK)
    assert torch.equal(bf16.logprobs_NK, fp32.logprobs_NK.to(torch.bfloat16))
    assert torch.equal(bf16.rest_N, fp32.rest_N)  # the rest and the log-partition stay fp32
    assert bf16.lse_N.dtype == torch.float32 and torch.equal(bf16.lse_N, fp32.lse_N)


def test_a_gpu_trainer_decodes_into_bf16_the_fp32_decode_rounded_once():
    assert decode_dtype("cuda:1") == torch.bfloat16  # the ring's dtype: half the fp32 tensor
    assert decode_dtype(torch.device("cpu")) == torch.float32
    targets = encode_topk(_logits(5, 40, seed=6), 7)
    fp32 = decode_topk(targets, 40)
    bf16 = decode_topk(targets, 40, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


def test_bytes_per_token_count_ids_logprobs_the_rest_and_the_log_partition():
    assert topk_bytes_per_token(64) == 64 * 8 + 8 == 520
    assert topk_bytes_per_token(64, torch.bfloat16) == 64 * 6 + 8
    # what the fields hold: 4 + 4 bytes per kept id, 4 for the rest, 4 for the log-partition
    targets = encode_topk(_logits(3, 40), 5)
    sent = sum(t.numel() * t.element_size() for t in targets)
    assert sent == 3 * topk_bytes_per_token(5)


@pytest.mark.parametrize("k", [0, -3, 12, 2.0])
def test_a_k_outside_one_to_the_vocab_is_refused_in_one_line(k):
    with pytest.raises(ValueError) as exc:
        check_top_k(k, 11)
    message = str(exc.value)
    assert "\n" not in message
    assert message == (
        f"teacher.top_k={k!r} must be between 1 and the teacher's vocab of 11; set "
        "teacher.top_k <= 11"
    )
    with pytest.raises(ValueError, match=r"^k=.* vocab of 11"):
        encode_topk(_logits(2, 11), k)


def test_decode_refuses_ids_outside_the_vocab_and_shapes_that_disagree():
    targets = encode_topk(_logits(2, 3, 8), 3)
    with pytest.raises(ValueError, match=r"ids outside \[0, 6\)"):
        decode_topk(TopK(targets.ids_NK.clamp_min(7), *targets[1:]), 6)
    shapes = r"expected \[\.\.\., K\], \[\.\.\., K\], \[\.\.\.\], \[\.\.\.\]$"
    with pytest.raises(ValueError, match=r"rest \(1, 3\), lse \(2, 3\): " + shapes):
        decode_topk(targets._replace(rest_N=targets.rest_N[:1]), 8)
    with pytest.raises(ValueError, match=r"rest \(2, 3\), lse \(2, 3, 1\): " + shapes):
        decode_topk(targets._replace(lse_N=targets.lse_N[..., None]), 8)
    with pytest.raises(ValueError, match=r"^top-k log-partition is torch.bfloat16, not float32$"):
        decode_topk(targets._replace(lse_N=targets.lse_N.bfloat16()), 8)
    with pytest.raises(ValueError, match="not an integer tensor"):
        decode_topk(TopK(targets.ids_NK.float(), *targets[1:]), 8)
    with pytest.raises(ValueError, match="top-k targets' K=3 must be between 1 and .* of 2"):
        decode_topk(targets, 2)


def test_encode_refuses_logits_that_are_not_float():
    with pytest.raises(ValueError, match=r"expected float logits \[\.\.\., W\]"):
        encode_topk(torch.zeros(2, 5, dtype=torch.int64), 2)


# ----------------------------------------------------------------------------- the losses


def _loss(zs, zt, batch, mode, temperature, backend):
    config = CrossTokenizerLossConfig(
        projection=make_projection(),
        mode=mode,
        temperature=temperature,
        uncommon_topk=4,
        ce_weight=0.0,
        backend=backend,
    )
    zs = zs.detach().requires_grad_()
    loss, metrics = CrossTokenizerLoss(config)(zs, zt, batch)
    (grad,) = torch.autograd.grad(loss, zs)
    return metrics["kl_loss"], grad


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_losses_of_targets_covering_the_vocab_equal_those_of_the_full_logits(
    mode, temperature, backend
):
    zs, zt = (z.float() for z in make_logits(0))
    batch = make_batch(0)
    W = zt.shape[-1]
    dense = decode_topk(encode_topk(zt, W), W)
    full_kd, full_grad = _loss(zs, zt, batch, mode, temperature, backend)
    topk_kd, topk_grad = _loss(zs, dense, batch, mode, temperature, backend)
    assert full_kd.item() > 0
    assert topk_kd.item() == pytest.approx(full_kd.item(), rel=1e-5)
    torch.testing.assert_close(topk_grad, full_grad, rtol=1e-4, atol=1e-7)


def _pkl_default(zs, zt, batch, projection):
    config = CrossTokenizerLossConfig(projection=projection, mode="pkl", ce_weight=0.0)
    zs = zs.detach().requires_grad_()
    loss, metrics = CrossTokenizerLoss(config)(zs, zt, batch)
    (grad,) = torch.autograd.grad(loss, zs)
    return config, metrics["kl_loss"], grad


def test_pkl_at_its_default_vocab_topk_from_targets_covering_the_vocab_equals_the_full_logits():
    # a teacher vocab over P-KL's default vocab_topk (8192): the loss picks its columns by the
    # largest teacher logit over the positions, which a per-position shift would change
    W = 9000
    zs, zt = (z.float() for z in make_logits(0, Wn=W))
    zt = (
        zt + 5.0 * torch.randn(zt.shape[:-1], generator=torch.Generator().manual_seed(5))[..., None]
    )
    batch = make_batch(0)
    projection = make_projection(W=W)
    targets = encode_topk(zt, W)
    config, full_kd, full_grad = _pkl_default(zs, zt, batch, projection)
    assert config.vocab_topk == 8192 < W
    _, topk_kd, topk_grad = _pkl_default(zs, decode_topk(targets, W), batch, projection)
    assert full_kd.item() > 0
    assert topk_kd.item() == pytest.approx(full_kd.item(), rel=1e-5)
    torch.testing.assert_close(topk_grad, full_grad, rtol=1e-4, atol=1e-7)
    # the log-probs alone (the log-partition dropped) pick other columns: the equality is not
    # a property of every decode
    logprobs = decode_topk(targets._replace(lse_N=torch.zeros_like(targets.lse_N)), W)
    _, _, logprob_grad = _pkl_default(zs, logprobs, batch, projection)
    assert (logprob_grad - full_grad).norm() > 1e-2 * full_grad.norm()


@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_fewer_ids_than_the_vocab_change_the_loss(mode):
    # the equality above is not a property of any decode: with K = 2 of 11 ids it breaks
    zs, zt = (z.float() for z in make_logits(0))
    batch = make_batch(0)
    dense = decode_topk(encode_topk(zt, 2), zt.shape[-1])
    full_kd, _ = _loss(zs, zt, batch, mode, 1.0, "reference")
    topk_kd, _ = _loss(zs, dense, batch, mode, 1.0, "reference")
    assert abs(topk_kd.item() - full_kd.item()) > 1e-3 * full_kd.item()
