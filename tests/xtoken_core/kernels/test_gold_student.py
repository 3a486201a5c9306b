"""gold_student backward kernel vs autograd of the chunk means (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, kd_logits, kd_rows
from xtoken_core.kernels import gold_student
from xtoken_core.kernels import logit_rows as kf

pytest.importorskip("triton")


@pytest.mark.parametrize("parts", ["both", "common-only", "uncommon-only"])
def test_gold_backward_matches_autograd_of_the_weighted_chunk_means(parts):
    B, T, V, N, temp = 2, 9, 45, 5, 1.4
    z = kd_logits(B, T, V, torch.float32, seed=11)
    nidx, order, offsets = kd_rows(B, T, N, seed=12)
    gen = torch.Generator().manual_seed(13)
    perm = torch.randperm(V, generator=gen).to(DEVICE)
    common, uncommon = perm[:20], perm[20:40]  # ids perm[40:] get no gradient
    g_common = torch.randn(N, common.numel(), generator=gen).to(DEVICE)
    g_unc = torch.randn(N, uncommon.numel(), generator=gen).to(DEVICE)
    gscale = torch.tensor([0.7, -1.3], device=DEVICE)
    cpos = torch.full((V,), -1, dtype=torch.int32, device=DEVICE)
    G = torch.zeros(N, V, device=DEVICE)  # the dense chunk gradient the compact blocks encode
    if parts != "uncommon-only":
        cpos[common] = torch.arange(common.numel(), dtype=torch.int32, device=DEVICE)
        G[:, common] = gscale[0] * g_common
    if parts != "common-only":
        cpos[uncommon] = -2 - torch.arange(uncommon.numel(), dtype=torch.int32, device=DEVICE)
        G[:, uncommon] = gscale[1] * g_unc
    sizes = (offsets[1:] - offsets[:-1]).float()
    lse = kf.row_logsumexp(z, nidx, temp)
    dz = gold_student.gold_backward(
        z, lse, nidx, g_common if parts != "uncommon-only" else None,
        g_unc if parts != "common-only" else None, cpos, G.sum(-1),
        1.0 / (temp * sizes.clamp_min(1)), gscale, temp,
    )  # fmt: skip
    z64 = z.detach().double().requires_grad_()
    logp = torch.log_softmax(z64 / temp, -1).reshape(B * T, V)
    onehot = (nidx.view(1, -1) == torch.arange(N, device=DEVICE).view(-1, 1)).double()
    means = onehot @ logp / sizes.clamp_min(1).double().view(-1, 1)
    (means * G.double()).sum().backward()
    torch.testing.assert_close(dz.double(), z64.grad, rtol=1e-5, atol=1e-7)
