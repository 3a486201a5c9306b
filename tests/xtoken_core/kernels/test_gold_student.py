"""gold_student backward kernel vs autograd of the chunk means (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, kd_logits, kd_rows
from xtoken_core.kernels import gold_student, topm_l1
from xtoken_core.kernels import logit_rows as kf

pytest.importorskip("triton")


@pytest.mark.parametrize(
    "tiles",
    [{}, {"gbwd_block_v": 16, "gbwd_blocks": 2}],
    ids=["one-block", "blocks-of-16-two-a-program"],
)
@pytest.mark.parametrize("parts", ["both", "common-only", "uncommon-only", "uncommon-referred"])
def test_gold_backward_matches_autograd_of_the_weighted_chunk_means(monkeypatch, parts, tiles):
    # The uncommon chunk gradient is the top-m L1's, from its sign tables: counted, or (rows the
    # counts cannot do) the reference's kept per element. With blocks of 16 columns, a program
    # takes two of the three a row has: the second program's second block is past the row.
    for key, value in tiles.items():
        monkeypatch.setitem(kf.KERNEL_CONFIG, key, value)
    B, T, V, N, temp = 2, 9, 45, 5, 1.4
    z = kd_logits(B, T, V, torch.float32, seed=11)
    nidx, order, offsets = kd_rows(B, T, N, seed=12)
    gen = torch.Generator().manual_seed(13)
    perm = torch.randperm(V, generator=gen).to(DEVICE)
    common, uncommon = perm[:20], perm[20:40]  # ids perm[40:] get no gradient
    g_common = torch.randn(N, common.numel(), generator=gen).to(DEVICE)
    s_unc = torch.log_softmax(torch.randn(N, uncommon.numel(), generator=gen) * 2, -1).to(DEVICE)
    # a teacher near the student: open bins, and fine bins resolved element by element
    near = s_unc.cpu()[:, torch.randperm(20, generator=gen)[:16]]
    t_unc = (near + 1e-4 * torch.randn(N, 16, generator=gen)).to(DEVICE)
    if parts == "uncommon-referred":
        signs = topm_l1._reference_signs(s_unc, t_unc, 6)
    else:
        signs = topm_l1.topm_l1_signs(s_unc, t_unc, 6)
    g_unc = topm_l1.topm_gradient(s_unc, signs.state_NA)
    torch.testing.assert_close(g_unc, topm_l1.topm_l1_reference(s_unc, t_unc, 6)[1])
    gscale = torch.tensor([0.7, -1.3], device=DEVICE)
    cpos = torch.full((V,), -1, dtype=torch.int32, device=DEVICE)
    G = torch.zeros(N, V, device=DEVICE)  # the dense chunk gradient the compact blocks encode
    if parts != "uncommon-only" and parts != "uncommon-referred":
        cpos[common] = torch.arange(common.numel(), dtype=torch.int32, device=DEVICE)
        G[:, common] = gscale[0] * g_common
    if parts != "common-only":
        cpos[uncommon] = -2 - torch.arange(uncommon.numel(), dtype=torch.int32, device=DEVICE)
        G[:, uncommon] = gscale[1] * g_unc
    sizes = (offsets[1:] - offsets[:-1]).float()
    lse = kf.row_logsumexp(z, nidx, temp)
    gsum_N2 = torch.stack([G[:, common].sum(-1), G[:, uncommon].sum(-1)], 1) / gscale  # unscaled
    dz = gold_student.gold_backward(
        z, lse, nidx, g_common if parts in ("both", "common-only") else None,
        (s_unc, signs.state_NA) if parts != "common-only" else None, cpos, gsum_N2,
        sizes, gscale[0], gscale[1], temp,
    )  # fmt: skip
    z64 = z.detach().double().requires_grad_()
    logp = torch.log_softmax(z64 / temp, -1).reshape(B * T, V)
    onehot = (nidx.view(1, -1) == torch.arange(N, device=DEVICE).view(-1, 1)).double()
    means = onehot @ logp / sizes.clamp_min(1).double().view(-1, 1)
    (means * G.double()).sum().backward()
    torch.testing.assert_close(dz.double(), z64.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "sums_tile",
    [{"chunks": 16, "blocks": 64}, {"chunks": 2, "blocks": 2}],
    ids=["one-step", "steps"],
)
@pytest.mark.parametrize("reverse_kl", [False, True], ids=["fwd-kl", "rev-kl"])
def test_gold_common_matches_the_chunk_mean_kl_over_several_column_blocks(
    monkeypatch, reverse_kl, sums_tile
):
    from types import SimpleNamespace

    monkeypatch.setitem(kf.KERNEL_CONFIG, "gcom_block_c", 16)  # 45 common columns: 3 blocks
    # the per-chunk sums over the 3 blocks' partials in one step, or in steps of 2 blocks
    monkeypatch.setattr(gold_student, "SUMS_TILE", sums_tile)
    B, T, U, V, W, N, temp = 2, 9, 7, 61, 53, 5, 1.3
    zs = kd_logits(B, T, V, torch.float32, seed=21, pad=3)  # a vocab-sliced view
    zt = kd_logits(B, U, W, torch.float32, seed=22)
    s_nidx, s_order, s_off = kd_rows(B, T, N, seed=23)
    t_nidx, t_order, t_off = kd_rows(B, U, N, seed=24)
    gen = torch.Generator().manual_seed(25)
    cs = torch.randperm(V, generator=gen)[:45].to(DEVICE)
    ct = torch.randperm(W, generator=gen)[:45].to(DEVICE)
    zs[0, :, cs[7]] = zs[0, :, cs[40]] = 50.0  # a tie for the argmax across blocks: first wins
    zt[0, :, ct[7]] = 50.0  # (so the agreement says which of the two won)
    lse_s, lse_t = kf.row_logsumexp(zs, s_nidx, temp), kf.row_logsumexp(zt, t_nidx, temp)
    g, stats = gold_student.gold_common(
        zs, lse_s, SimpleNamespace(order_R=s_order, offsets_N1=s_off), cs,
        zt, lse_t, SimpleNamespace(order_R=t_order, offsets_N1=t_off), ct, temp, reverse_kl,
    )  # fmt: skip

    def means(z, nidx, cols):
        lp = torch.log_softmax(z.double() / temp, -1).reshape(-1, z.shape[-1])[:, cols]
        onehot = (nidx.view(1, -1) == torch.arange(N, device=DEVICE).view(-1, 1)).double()
        return onehot @ lp / onehot.sum(1, keepdim=True).clamp_min(1)

    s, u = means(zs, s_nidx, cs), means(zt, t_nidx, ct)
    if reverse_kl:
        kl, g_ref = (s.exp() * (s - u)).sum(-1), (s - u + 1) * s.exp()
    else:
        kl, g_ref = (u.exp() * (u - s)).sum(-1), -u.exp()
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats[:, 0].double(), kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[:, 1].double(), g_ref.sum(-1), rtol=1e-5, atol=1e-6)
    agree = (s.argmax(-1) == u.argmax(-1)).double()
    assert torch.equal(stats[:, 2].double(), agree)


@pytest.mark.parametrize("slices", [[1], [2, 1], [None]], ids=["1+rest", "2+1", "all-at-once"])
def test_common_kl_launched_in_slices_matches_one_launch(monkeypatch, slices):
    # the top-m fills its host waits with slices of the common KL's column blocks
    from types import SimpleNamespace

    monkeypatch.setitem(kf.KERNEL_CONFIG, "gcom_block_c", 16)  # 45 common columns: 3 blocks
    B, T, V, N, temp = 2, 9, 61, 5, 1.3
    zs = kd_logits(B, T, V, torch.float32, seed=31)
    zt = kd_logits(B, T, V, torch.float32, seed=32)
    nidx, order, off = kd_rows(B, T, N, seed=33)
    rows = SimpleNamespace(order_R=order, offsets_N1=off)
    gen = torch.Generator().manual_seed(34)
    cs = torch.randperm(V, generator=gen)[:45].to(DEVICE)
    ct = torch.randperm(V, generator=gen)[:45].to(DEVICE)
    lse_s, lse_t = kf.row_logsumexp(zs, nidx, temp), kf.row_logsumexp(zt, nidx, temp)
    args = (zs, lse_s, rows, cs, zt, lse_t, rows, ct, temp, False)
    g_ref, stats_ref = gold_student.gold_common(*args)
    common = gold_student.CommonKL(*args)
    for blocks in slices:
        common.launch(blocks)
    g, stats = common.result()
    assert common.launched == common.n_blocks == 3
    assert torch.equal(g, g_ref) and torch.equal(stats, stats_ref)
