"""Top-K targets read by P-KL without their dense logits: the column maxima and the selected
columns equal the fp32 decode's bit for bit (ties, unused rows, a rest of 0, K covering the
vocab), so P-KL's loss and gradient from the targets equal those from the decoded logits on every
backend, with no ``[B, U, W]`` tensor made; other modes decode them; bad targets refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.xtoken_core.losses.test_loss import make_batch, make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.sparse_teacher import SparseTeacher
from xtoken_core.wire.topk import LOG_FLOOR, TopK, decode_topk, encode_topk

W = 400  # teacher vocab, wider than the student's 13 ids and than vocab_topk


def _targets(k: int, seed: int = 0, B: int = 3, U: int = 11, width: int = W) -> TopK:
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(B, U, width, generator=g)
    z = z + 4 * torch.randn(B, U, 1, generator=g)  # per-position shifts: the maxima move
    return encode_topk(z, k)


def _rows(B: int = 3, U: int = 11, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-1, 5, (B, U), generator=g)
    rows[0] = -1  # a sample without a used row
    return rows


@pytest.mark.parametrize("k", [1, 8, W])
def test_column_maxima_equal_the_dense_decodes_masked_maximum_bit_for_bit(k):
    targets = _targets(k)
    dense = decode_topk(targets, W)
    rows = _rows()
    sparse = SparseTeacher.from_targets(targets, W)
    want = dense.masked_fill((rows < 0)[..., None], float("-inf")).amax(dim=(0, 1))
    assert torch.equal(sparse.column_max(rows), want)
    assert torch.equal(sparse.column_max(torch.full_like(rows, -1)), torch.full((W,), -torch.inf))


def test_a_rest_of_zero_and_quantised_log_probs_below_the_fill_keep_the_maxima_exact():
    ids, logprobs, rest, lse = _targets(8)
    rest = rest.clone()
    rest[1, :4] = float("-inf")  # ids masked at -inf by the teacher: the floor
    logprobs = logprobs.clone()
    logprobs[2, 3, -1] = rest[2, 3] - 30.0  # a K-th log-prob below the rest's average
    targets = TopK(ids, logprobs, rest, lse)
    dense = decode_topk(targets, W)
    assert float(dense[1, 0].min()) == pytest.approx(LOG_FLOOR + float(lse[1, 0]), rel=1e-6)
    rows = torch.zeros(3, 11, dtype=torch.long)
    assert torch.equal(
        SparseTeacher.from_targets(targets, W).column_max(rows), dense.amax(dim=(0, 1))
    )


@pytest.mark.parametrize("k", [4, W])
def test_selected_columns_equal_the_dense_decodes_columns_bit_for_bit(k):
    targets = _targets(k, seed=2)
    idx = torch.randperm(W, generator=torch.Generator().manual_seed(3))[:37]
    sparse = SparseTeacher.from_targets(targets, W)
    assert torch.equal(sparse.columns(idx), decode_topk(targets, W)[..., idx])
    assert sparse.shape == (3, 11, W) and sparse.dim() == 3 and sparse.detach() is sparse


def _pkl(zs, zt, batch, backend, vocab_topk, mode="pkl", topk_columns="valid"):
    config = CrossTokenizerLossConfig(
        projection=make_projection(W=W), mode=mode, ce_weight=0.0, backend=backend,
        vocab_topk=vocab_topk, topk_columns=topk_columns, temperature=1.5, uncommon_topk=4,
    )  # fmt: skip
    zs = zs.detach().clone().requires_grad_()
    loss, metrics = CrossTokenizerLoss(config)(zs, zt, batch)
    (grad,) = torch.autograd.grad(loss, zs)
    return metrics["kl_loss"], grad


def _case(k: int, seed: int = 0):
    zs, _ = make_logits(seed, Wn=W)
    targets = _targets(k, seed=seed, U=11)
    return zs.float(), targets, make_batch(seed)


# (K = W leaves no rest: each row's fill sits at the floor, -1e4 below its logits, where fp32
# keeps ~1e-3 of it; the loss below, where such values weigh exp(-1e4) = 0, is held at K = W)
@pytest.mark.parametrize("k", [3, 64])
@pytest.mark.parametrize("columns", [37, W])
def test_chunk_means_of_the_kept_columns_log_softmax_equal_the_dense_decodes(k, columns):
    targets = _targets(k, seed=4)
    dense_RW = decode_topk(targets, W).reshape(-1, W)
    idx = torch.randperm(W, generator=torch.Generator().manual_seed(5))[:columns]
    nidx = torch.randint(-1, 6, (dense_RW.shape[0],), generator=torch.Generator().manual_seed(6))
    nidx[nidx == 4] = -1  # chunk 4 has no row: zeros
    sizes = torch.bincount(nidx[nidx >= 0], minlength=6).float()
    lp_RX = torch.log_softmax(dense_RW[:, idx] / 1.5, dim=-1)
    want = torch.zeros(6, columns).index_add_(0, nidx.clamp_min(0), lp_RX * (nidx >= 0)[:, None])
    want /= sizes.clamp_min(1)[:, None]
    sparse = SparseTeacher.from_targets(targets, W)
    got = sparse.chunk_mean_log_softmax(nidx, sizes, 1.5, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4], torch.zeros(columns))


# K = 2 over 33 rows: ~60 distinct ids, under vocab_topk = 64 (columns tied at the top fill:
# torch.topk sees the same maxima); K = 16: more ids than the columns kept; K = W: no rest;
# vocab_topk None: every column
@pytest.mark.parametrize("k", [2, 16, W])
@pytest.mark.parametrize("vocab_topk,topk_columns", [(64, "valid"), (64, "all"), (None, "valid")])
@pytest.mark.parametrize("backend", ["reference", "auto", "kernel"])
def test_pkl_from_targets_equals_pkl_from_their_fp32_decode_on_every_backend(
    k, vocab_topk, topk_columns, backend, monkeypatch
):
    if backend == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, targets, batch = _case(k)
    dense = decode_topk(targets, W)
    want = _pkl(zs, dense, batch, backend, vocab_topk, topk_columns=topk_columns)
    sparse = SparseTeacher.from_targets(targets, W)
    got = _pkl(zs, sparse, batch, backend, vocab_topk, topk_columns=topk_columns)
    assert want[0].item() > 0
    if backend == "kernel":  # the same columns; the teacher's chunk means summed in another order
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-8)
    else:  # the reference's and the CPU path's: the kept columns' values themselves
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor W wide (the teacher vocab) an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == W:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_pkl_from_targets_makes_no_tensor_of_the_dense_logits_size(backend, monkeypatch):
    if backend == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, targets, batch = _case(8)
    sparse = SparseTeacher.from_targets(targets, W)
    B, U, _ = sparse.shape
    with _LargestTensor() as seen:
        _pkl(zs, sparse, batch, backend, 64)
    V = zs.shape[-1]
    assert seen.most <= V * W < B * U * W  # the projection's [V, W] is the largest W wide
    with _LargestTensor() as seen:
        _pkl(zs, decode_topk(targets, W), batch, backend, 64)
    assert seen.most >= B * U * W  # the dense path, for contrast


@pytest.mark.parametrize("mode,vocab_topk", [("gold", 64), ("xtoken", 64)])
def test_modes_that_read_whole_rows_get_the_targets_decoded(mode, vocab_topk):
    zs, targets, batch = _case(8)
    want = _pkl(zs, decode_topk(targets, W), batch, "auto", vocab_topk, mode=mode)
    got = _pkl(zs, SparseTeacher.from_targets(targets, W), batch, "auto", vocab_topk, mode=mode)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_targets_of_another_vocab_or_shape_are_refused_in_one_line():
    ids, logprobs, rest, lse = _targets(8)
    with pytest.raises(ValueError, match=r"^top-k ids outside \[0, 300\)"):
        SparseTeacher.from_targets(TopK(ids, logprobs, rest, lse), 300)
    with pytest.raises(ValueError, match=r"^top-k targets of shapes"):
        SparseTeacher.from_targets(TopK(ids, logprobs, rest[:, :3], lse), W)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [2, 16])
def test_pkl_from_targets_equals_pkl_from_their_fp32_decode_on_the_gpus_kernels(k):
    zs, targets, batch = _case(k)
    zs = zs.cuda()
    batch = {key: v.cuda() if torch.is_tensor(v) else v for key, v in batch.items()}
    targets = TopK(*(t.cuda() for t in targets))
    want = _pkl(zs, decode_topk(targets, W), batch, "kernel", 64)
    got = _pkl(zs, SparseTeacher.from_targets(targets, W), batch, "kernel", 64)
    assert want[0].item() > 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-8)
    # trainer.compute.deterministic: the targets' path has deterministic algorithms too
    torch.use_deterministic_algorithms(True)
    try:
        again = _pkl(zs, SparseTeacher.from_targets(targets, W), batch, "kernel", 64)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(again[0], got[0], rtol=1e-6, atol=0.0)
