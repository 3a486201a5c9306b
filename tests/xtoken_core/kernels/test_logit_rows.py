"""logit_rows row kernels vs plain PyTorch formulas (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, compile_for_hopper, kd_logits, kd_rows
from xtoken_core.kernels import logit_rows as kf
from xtoken_core.kernels import topm_l1 as tm

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pad", [0, 5])
def test_row_logsumexp_matches_torch_and_is_inf_on_unused_rows(dtype, pad):
    z = kd_logits(2, 9, 77, dtype, seed=1, pad=pad)
    nidx, _, _ = kd_rows(2, 9, 4, seed=2)
    lse = kf.row_logsumexp(z, nidx, 1.3)
    ref = torch.logsumexp(z.double() / 1.3, -1).reshape(-1)
    used = nidx >= 0
    torch.testing.assert_close(lse[used].double(), ref[used], rtol=1e-6, atol=1e-5)
    assert bool(torch.isinf(lse[~used]).all()) and bool((lse[~used] > 0).all())


@pytest.mark.parametrize("pad", [0, 5])
def test_row_logsumexp_of_every_row_with_row_sums(pad):
    z = kd_logits(2, 9, 77, torch.bfloat16, seed=1, pad=pad).clone()
    z[1, 4, 10] = float("inf")
    sums = torch.empty(18, device=DEVICE)
    lse = kf.row_logsumexp(z, None, 1.3, row_sum_R=sums)
    ref = torch.logsumexp(z.double() / 1.3, -1).reshape(-1)
    finite = torch.arange(18, device=DEVICE) != 13  # the inf row: its sum is what counts
    torch.testing.assert_close(lse[finite].double(), ref[finite], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sums.double(), z.double().sum(-1).reshape(-1), rtol=1e-5, atol=1e-3)
    assert torch.isinf(sums[13]) and int(torch.isfinite(sums).sum()) == 17
    with pytest.raises(ValueError, match="row_sum_R must be"):
        kf.row_logsumexp(z, None, 1.3, row_sum_R=sums[:3])
    with pytest.raises(ValueError, match=r"must be \[B, T, V\]"):
        kf.row_logsumexp(z[0], None, 1.3)


@pytest.mark.parametrize("with_cols", [False, True])
def test_chunk_mean_columns_matches_the_mean_of_gathered_log_probs(with_cols):
    B, T, V, N = 2, 11, 53, 6
    z = kd_logits(B, T, V, torch.bfloat16, seed=3, pad=3)
    nidx, order, offsets = kd_rows(B, T, N, seed=4)
    cols = torch.tensor([50, 3, 17, 0, 44, 29, 8], device=DEVICE) if with_cols else None
    lse = kf.row_logsumexp(z, nidx, 0.7)
    out = kf.chunk_mean_columns(z, lse, order, offsets, 0.7, cols)
    logp = torch.log_softmax(z.double() / 0.7, -1).reshape(B * T, V)
    if cols is not None:
        logp = logp[:, cols]
    ref = torch.zeros(N, logp.shape[1], dtype=torch.float64, device=DEVICE)
    for n in range(N):
        rows = (nidx == n).nonzero().flatten()
        if rows.numel():
            ref[n] = logp[rows].mean(0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=2e-5)


@pytest.mark.parametrize("with_cols", [False, True])
def test_chunk_mean_columns_counts_the_coarse_histograms_of_its_rows(with_cols):
    B, T, V, N = 2, 11, 1500, 6
    z = kd_logits(B, T, V, torch.bfloat16, seed=3)
    nidx, order, offsets = kd_rows(B, T, N, seed=4)
    cols = (
        torch.randperm(V, generator=torch.Generator().manual_seed(0))[:1100] if with_cols else None
    )
    cols = None if cols is None else cols.to(DEVICE)
    lse = kf.row_logsumexp(z, nidx, 0.7)
    hist_NK = torch.zeros((N, tm.COARSE_BINS), dtype=torch.int32, device=DEVICE)
    out = kf.chunk_mean_columns(z, lse, order, offsets, 0.7, cols, hist_NK=hist_NK)
    want = torch.zeros((2, N, tm.COARSE_BINS), dtype=torch.int32, device=DEVICE)
    X = out.shape[1]
    tm._hist_kernel[(N, 2, 1)](
        out, out, X, X, X, X, want, N, 2048, K=tm.COARSE_BINS, BASE=tm.COARSE_BASE,
        SHIFT=tm.COARSE_SHIFT, BLOCK=2048,
    )  # fmt: skip
    assert torch.equal(hist_NK, want[0])
    with pytest.raises(ValueError, match="hist_NK must be"):
        kf.chunk_mean_columns(z, lse, order, offsets, 0.7, cols, hist_NK=hist_NK[:2])


def test_row_and_chunk_kernels_compile_for_hopper_without_local_memory(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    types = {"z_ptr": "*bf16", "lse_R_ptr": "*fp32", "out_ptr": "*fp32", "hist_ptr": "*i32"}
    types.update(dict.fromkeys(["order_ptr", "offsets_N1_ptr", "cols_X_ptr"], "*i64"))
    types["inv_temp"] = "fp32"
    for hist in (False, True):
        usage = compile_for_hopper(
            kf._chunk_cols_kernel,
            types,
            {
                "HAS_COLS": True,
                "HIST": hist,
                "HIST_BINS": tm.COARSE_BINS,
                "HIST_BASE": tm.COARSE_BASE,
                "HIST_SHIFT": tm.COARSE_SHIFT,
                "BLOCK_X": kf.KERNEL_CONFIG["cols_block_x"],
            },
        )
        assert "LOCAL:0" in usage, usage
    lse_types = {"z_ptr": "*bf16", "nidx_R_ptr": "*i64", "lse_R_ptr": "*fp32", "sum_R_ptr": "*fp32"}
    lse_types["scale2"] = "fp32"
    for all_rows in (False, True):
        for sums in (False, True):
            usage = compile_for_hopper(
                kf._row_lse_kernel,
                lse_types,
                {"ALL_ROWS": all_rows, "SUMS": sums, "BLOCK_V": kf.KERNEL_CONFIG["lse_block_v"]},
            )
            assert "LOCAL:0" in usage, usage


def test_column_max_equals_masked_amax_exactly():
    B, T, W = 2, 13, 301
    z = kd_logits(B, T, W, torch.bfloat16, seed=5, pad=2)
    used = torch.where(torch.rand(B * T) < 0.6, 0, -1).to(DEVICE)
    got = kf.column_max(z, used)
    mask = (used >= 0).view(B, T, 1)
    ref = z.masked_fill(~mask, float("-inf")).amax(dim=(0, 1)).float()
    assert torch.equal(got, ref)


def test_column_max_of_no_used_row_is_minus_inf():
    z = kd_logits(1, 5, 40, torch.float32, seed=6)
    got = kf.column_max(z, torch.full((5,), -1, device=DEVICE))
    assert bool(torch.isneginf(got).all())


@pytest.mark.parametrize("with_cols", [False, True])
def test_chunk_mean_log_softmax_columns_is_the_mean_of_the_log_softmax_over_those_columns(
    with_cols, monkeypatch
):
    monkeypatch.setitem(kf.KERNEL_CONFIG, "lsm_block_x", 16)  # several column blocks
    B, T, V, N = 2, 11, 53, 6
    z = kd_logits(B, T, V, torch.bfloat16, seed=7, pad=3)
    nidx, order, offsets = kd_rows(B, T, N, seed=8)
    cols = torch.tensor([50, 3, 17, 0, 44, 29, 8, 9, 10, 31, 2, 5, 1, 40, 41, 42, 52, 20, 21])
    cols = cols.to(DEVICE) if with_cols else None
    out = kf.chunk_mean_log_softmax_columns(z, order, offsets, 0.7, cols)
    zc = z.double().reshape(B * T, V)
    logp = torch.log_softmax((zc if cols is None else zc[:, cols]) / 0.7, -1)
    ref = torch.zeros(N, logp.shape[1], dtype=torch.float64, device=DEVICE)
    for n in range(N):
        rows = (nidx == n).nonzero().flatten()
        if rows.numel():
            ref[n] = logp[rows].mean(0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=2e-5)


@pytest.mark.gpu
def test_cuda_topk_selects_the_same_ids_sorted_or_not_under_ties():
    # P-KL's kernel path asks torch.topk for an unsorted selection: on CUDA the selected set (ties
    # included) must not depend on ``sorted``. bf16 maxima tie a lot.
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(131072, generator=gen, device="cuda") * 3).to(torch.bfloat16).float()
    for k in (8192, 1000, 77):
        a = torch.sort(torch.topk(x, k).indices).values
        b = torch.sort(torch.topk(x, k, sorted=False).indices).values
        assert torch.equal(a, b)


def test_chunk_mean_log_softmax_columns_with_a_device_n_skips_the_extra_slots():
    B, T, V, N = 2, 11, 53, 6
    z = kd_logits(B, T, V, torch.bfloat16, seed=9)
    _, order, offsets = kd_rows(B, T, N, seed=10)
    cols = torch.tensor([50, 3, 17, 0, 44], device=DEVICE)
    want = kf.chunk_mean_log_softmax_columns(z, order, offsets, 0.7, cols)
    garbage = torch.tensor([-3, 10**6], device=DEVICE)  # never read: programs n >= N stop
    got = kf.chunk_mean_log_softmax_columns(
        z, order, torch.cat([offsets, garbage]), 0.7, cols, torch.tensor([N], device=DEVICE)
    )
    assert got.shape == (N + 2, cols.numel()) and torch.equal(got[:N], want)


@pytest.mark.parametrize(("K", "W"), [(1, 1), (7, 50), (300, 301), (37, 9000), (0, 5)])
def test_ascending_ids_equals_sort_of_distinct_ids(K, W):
    gen = torch.Generator().manual_seed(K + W)
    ids = torch.randperm(W, generator=gen)[:K].to(DEVICE)
    out = kf.ascending_ids(ids, W)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.sort(ids).values.to(torch.int64))


def test_ascending_ids_of_topk_indices_under_ties():
    # the fused P-KL use: the indices of an unsorted topk over bf16-rounded maxima (many ties)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3000, generator=gen) * 2).to(torch.bfloat16).float().to(DEVICE)
    top = torch.topk(x, 700, sorted=False).indices
    assert torch.equal(kf.ascending_ids(top, 3000), torch.sort(top).values)
