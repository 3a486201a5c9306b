"""row_ce: the student CE kernels vs the fp64 PyTorch reference (interpreted on CPU)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE
from xtoken_core.kernels import row_ce
from xtoken_core.losses import student_ce
from xtoken_core.losses.backends import reference

pytest.importorskip("triton")

#: Bounds every comparison with the fp64 reference keeps (the kernels accumulate in fp32).
LOSS_REL_ERR = 1e-3
GRAD_COSINE = 0.999

SHAPES = [(1, 7, 67), (2, 9, 1007), (3, 13, 129)]  # odd T, odd V (1007 = 1000 + 7)


def _inputs(B, T, V, dtype, seed, pad=0):
    """Logits ``[B, T, V]`` (a vocab-sliced view when pad > 0), ids with about a third of the
    targets at their row's argmax, a token mask with a padded tail, the last sample masked."""
    gen = torch.Generator().manual_seed(seed)
    # sliced on the device: a copy of a sliced view to another device is made contiguous
    z = (torch.randn(B, T, V + pad, generator=gen) * 3).to(dtype).to(DEVICE)[..., :V]
    ids = torch.randint(0, V, (B, T), generator=gen)
    top = z[:, :-1].float().argmax(-1).cpu()
    pick = torch.rand(B, T - 1, generator=gen) < 0.35
    ids[:, 1:] = torch.where(pick, top, ids[:, 1:])
    token_mask = torch.rand(B, T, generator=gen) > 0.2
    token_mask[0, -2:] = False  # padding at the end of a row
    sample_mask = torch.ones(B, dtype=torch.bool)
    if B > 1:
        sample_mask[-1] = False
    return z, ids.to(DEVICE), token_mask.to(DEVICE), sample_mask.to(DEVICE)


def _kernel(z, ids, token_mask, sample_mask, **kw):
    x = z.detach().requires_grad_()  # a new leaf with the strides of z
    nll, correct, n = row_ce.row_cross_entropy(x, ids, token_mask, sample_mask, **kw)
    nll.backward()
    return nll.detach(), correct, n, x.grad


def _fp64_reference(z, ids, token_mask, sample_mask):
    x = z.detach().double().requires_grad_()
    nll, correct, n = reference.student_ce_loss(x, ids, token_mask, sample_mask)
    nll.backward()
    return nll.detach(), correct, n, x.grad


def _cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_loss_gradient_and_accuracy_match_the_fp64_reference(dtype, shape):
    """Loss relative error <= 1e-3 and gradient cosine >= 0.999 against the fp64 reference on
    the same (rounded) logits; correct and token counts equal; gradient in the logits' dtype."""
    z, ids, token_mask, sample_mask = _inputs(*shape, dtype, seed=sum(shape))
    nll, correct, n, grad = _kernel(z, ids, token_mask, sample_mask)
    nll_r, correct_r, n_r, grad_r = _fp64_reference(z, ids, token_mask, sample_mask)
    assert nll.dtype == torch.float32 and grad.dtype == dtype and grad.shape == z.shape
    assert abs(nll.double() - nll_r).item() <= LOSS_REL_ERR * abs(nll_r).item()
    assert _cosine(grad, grad_r) >= GRAD_COSINE
    assert correct.item() == correct_r.item() > 0
    assert n.item() == n_r.item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocks_smaller_than_the_vocab_give_the_same_result(dtype, monkeypatch):
    """The online logsumexp and the argmax across blocks, the backward over several programs:
    loss relative error <= 1e-3, gradient cosine >= 0.999 against the fp64 reference."""
    monkeypatch.setitem(row_ce.CE_CONFIG, "fwd_block_v", 64)
    monkeypatch.setitem(row_ce.CE_CONFIG, "bwd_block_v", 32)
    monkeypatch.setitem(row_ce.CE_CONFIG, "bwd_blocks", 3)
    z, ids, token_mask, sample_mask = _inputs(2, 11, 1007, dtype, seed=4)
    nll, correct, n, grad = _kernel(z, ids, token_mask, sample_mask)
    nll_r, correct_r, n_r, grad_r = _fp64_reference(z, ids, token_mask, sample_mask)
    assert abs(nll.double() - nll_r).item() <= LOSS_REL_ERR * abs(nll_r).item()
    assert _cosine(grad, grad_r) >= GRAD_COSINE
    assert (correct.item(), n.item()) == (correct_r.item(), n_r.item())


@pytest.mark.parametrize("block", [1024, 16])
def test_ties_count_the_first_index_as_torch_argmax(block, monkeypatch):
    # the row max twice, in one block or across blocks: only a target at the first one is correct
    monkeypatch.setitem(row_ce.CE_CONFIG, "fwd_block_v", block)
    V = 100
    z = torch.zeros(1, 5, V)
    ids = torch.zeros(1, 5, dtype=torch.long)
    for t, (first, second, target) in enumerate([(3, 70, 3), (3, 70, 70), (40, 41, 40), (8, 9, 9)]):
        z[0, t, first] = z[0, t, second] = 5.0
        ids[0, t + 1] = target
    z, ids = z.to(DEVICE), ids.to(DEVICE)
    _, correct, n, _ = _kernel(z, ids, None, None)
    _, correct_r, _, _ = _fp64_reference(z, ids, None, None)
    assert correct.item() == correct_r.item() == 2 and n.item() == 4


def test_rows_that_do_not_count_get_a_zero_gradient():
    z, ids, token_mask, sample_mask = _inputs(3, 9, 67, torch.float32, seed=5)
    _, _, _, grad = _kernel(z, ids, token_mask, sample_mask)
    counted = torch.zeros(3, 9, dtype=torch.bool, device=DEVICE)
    counted[:, :-1] = token_mask[:, 1:] & sample_mask.view(-1, 1)
    assert bool((grad[~counted] == 0).all())
    assert bool((grad[counted].abs().sum(-1) > 0).all())
    # a counted row's gradient is softmax - onehot: it sums to 0
    torch.testing.assert_close(grad[counted].sum(-1), torch.zeros_like(grad[counted][:, 0]))


def test_given_row_logsumexps_give_the_same_result():
    from xtoken_core.kernels.logit_rows import row_logsumexp

    z, ids, token_mask, sample_mask = _inputs(2, 9, 1007, torch.bfloat16, seed=6)
    lse_R = row_logsumexp(z, None, 1.0)
    own = _kernel(z, ids, token_mask, sample_mask)
    given = _kernel(z, ids, token_mask, sample_mask, lse_R=lse_R)
    for a, b in zip(own, given, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_vocab_sliced_and_transposed_logits_match_contiguous_ones():
    z, ids, token_mask, sample_mask = _inputs(2, 9, 67, torch.float32, seed=7, pad=5)
    assert z.stride(1) == 72  # a row-strided view (lm_head padding sliced off)
    want = _kernel(z.contiguous(), ids, token_mask, sample_mask)
    for view in (z, z.transpose(1, 2).contiguous().transpose(1, 2)):
        got = _kernel(view, ids, token_mask, sample_mask)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_masks_of_other_dtypes_and_no_masks_count_as_the_reference():
    z, ids, token_mask, sample_mask = _inputs(2, 9, 67, torch.float32, seed=8)
    want = _kernel(z, ids, token_mask, sample_mask)
    got = _kernel(z, ids.int(), token_mask.float(), sample_mask.long())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, correct, n, _ = _kernel(z, ids, None, None)
    _, correct_r, n_r, _ = _fp64_reference(z, ids, None, None)
    assert (correct.item(), n.item()) == (correct_r.item(), n_r.item()) and n.item() == 2 * 8


def test_two_runs_are_bitwise_equal():
    z, ids, token_mask, sample_mask = _inputs(2, 9, 1007, torch.bfloat16, seed=9)
    first = _kernel(z, ids, token_mask, sample_mask)
    second = _kernel(z, ids, token_mask, sample_mask)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_an_empty_batch_gives_zeros_and_an_empty_gradient():
    z = torch.zeros(0, 5, 67, device=DEVICE)
    nll, correct, n, grad = _kernel(
        z, torch.zeros(0, 5, dtype=torch.long, device=DEVICE), None, None
    )
    assert (nll.item(), correct.item(), n.item()) == (0.0, 0.0, 0.0) and grad.shape == z.shape


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"ids": (2, 8)}, r"input_ids is \(2, 8\)"),
        ({"token_mask": (2, 8)}, r"token_mask is \(2, 8\)"),
        ({"sample_mask": (3,)}, r"sample_mask is \(3,\)"),
        ({"lse_R": (17,)}, r"lse_R must be \[18\] fp32"),
    ],
)
def test_mismatched_shapes_are_rejected_naming_the_tensor(bad, match):
    z = torch.zeros(2, 9, 67, device=DEVICE)
    shapes = {"ids": (2, 9), "token_mask": (2, 9), "sample_mask": (2,), "lse_R": (18,)}
    shapes.update(bad)
    with pytest.raises(ValueError, match=match):
        row_ce.row_cross_entropy(
            z,
            torch.zeros(shapes["ids"], dtype=torch.long, device=DEVICE),
            torch.ones(shapes["token_mask"], dtype=torch.bool, device=DEVICE),
            torch.ones(shapes["sample_mask"], dtype=torch.bool, device=DEVICE),
            lse_R=torch.zeros(shapes["lse_R"], device=DEVICE),
        )


def test_student_ce_without_triton_is_the_reference(no_interpreter):
    z, ids, token_mask, sample_mask = _inputs(2, 9, 67, torch.bfloat16, seed=10)
    got = student_ce(z, ids, token_mask, sample_mask)
    want = reference.student_ce_loss(z, ids, token_mask, sample_mask)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_student_ce_takes_the_kernels_under_the_interpreter_and_keeps_fp64_on_the_reference():
    z, ids, token_mask, sample_mask = _inputs(2, 9, 67, torch.float32, seed=11)
    got = student_ce(z, ids, token_mask, sample_mask)
    kernel = row_ce.row_cross_entropy(z, ids, token_mask, sample_mask)
    for a, b in zip(got, kernel, strict=True):
        assert torch.equal(a, b)
    nll64, _, _ = student_ce(z.double(), ids, token_mask, sample_mask)
    assert nll64.dtype == torch.float64


# --------------------------------------------------------------------------- full size, CUDA


def _fp64_in_chunks(z_BTV, ids_BT, token_mask_BT, sample_mask_B, grad_BTV, rows=256):
    """fp64 reference of the nll sum, the counts, and the cosine of ``grad_BTV`` with the fp64
    gradient, a block of rows at a time (the whole fp64 ``[B*T, V]`` would be 5 GB)."""
    B, T, V = z_BTV.shape
    target_BT = torch.full((B, T), -1, dtype=torch.long, device=z_BTV.device)
    counted_BT = token_mask_BT[:, 1:].bool() & sample_mask_B.bool().view(-1, 1)
    target_BT[:, :-1] = torch.where(counted_BT, ids_BT[:, 1:], -1)
    z_RV, g_RV, target_R = z_BTV.reshape(-1, V), grad_BTV.reshape(-1, V), target_BT.reshape(-1)
    nll = correct = dot = g_sq = r_sq = 0.0
    for r0 in range(0, B * T, rows):
        z = z_RV[r0 : r0 + rows].double()
        y = target_R[r0 : r0 + rows]
        c = y >= 0
        safe = y.clamp_min(0).view(-1, 1)
        lse = torch.logsumexp(z, -1)
        nll += float(((lse - z.gather(1, safe).squeeze(1)) * c).sum())
        correct += float(((z.argmax(-1) == y) & c).sum())
        ref = torch.softmax(z, -1)
        ref.scatter_add_(1, safe, -torch.ones_like(safe, dtype=ref.dtype))
        ref *= c.view(-1, 1)
        g = g_RV[r0 : r0 + rows].double()
        dot += float((g * ref).sum())
        g_sq += float((g * g).sum())
        r_sq += float((ref * ref).sum())
    cosine = dot / (g_sq**0.5 * r_sq**0.5)
    return nll, correct, float((target_R >= 0).sum()), cosine


@pytest.mark.gpu
def test_full_size_bf16_on_cuda_matches_fp64_and_stays_under_three_logits_of_memory():
    """B*T = 4096, V = 151936, bf16: loss relative error <= 1e-3, gradient cosine >= 0.999 vs an
    fp64 reference made in row blocks; correct and token counts equal; peak memory of the
    forward + backward (the logits included) below 3x the logits' bytes."""
    B, T, V = 2, 2048, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    ids[:, 1:] = torch.where(ids[:, 1:] % 3 == 0, z[:, :-1].argmax(-1), ids[:, 1:])
    token_mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    token_mask[0, -300:] = False
    sample_mask = torch.ones(B, dtype=torch.bool, device="cuda")
    x = z.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    nll, correct, n = student_ce(x, ids, token_mask, sample_mask)
    nll.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    logits_bytes = z.numel() * z.element_size()
    assert peak < 3 * logits_bytes, (peak, logits_bytes)
    assert x.grad.dtype == torch.bfloat16
    nll_r, correct_r, n_r, cosine = _fp64_in_chunks(
        z.detach(), ids, token_mask, sample_mask, x.grad
    )
    assert abs(nll.item() - nll_r) <= LOSS_REL_ERR * abs(nll_r)
    assert cosine >= GRAD_COSINE, cosine
    assert (correct.item(), n.item()) == (correct_r, n_r) and correct_r > 0


@pytest.mark.gpu
def test_cuda_kernels_compile_once_however_the_batch_sizes_vary():
    # new lengths, batch sizes and target counts every step must not compile a kernel again
    import triton

    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for i, (B, T) in enumerate([(2, 515), (1, 512), (3, 301), (4, 16), (1, 1), (2, 333)]):
            z, ids, token_mask, sample_mask = _inputs(B + 1, T + 3, 20016, torch.bfloat16, seed=i)
            # views at data-dependent offsets, as a trainer's slices of a padded batch are
            _kernel(z[1:, 3:], ids[1:, 3:], token_mask[1:, 3:], sample_mask[1:])
            torch.cuda.synchronize()
            if i == 0:
                compiled.clear()  # the first batch compiles every kernel once
        assert compiled == []
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook


def test_kernels_compile_for_hopper_without_local_memory(monkeypatch):
    # the compiled (not interpreted) kernels, for sm_90 with Triton's ptxas: no GPU needed
    from tests.xtoken_core.kernels.conftest import compile_for_hopper

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fwd_types = {"z_ptr": "*bf16", "ids_ptr": "*i64", "tmask_ptr": "*i1", "smask_ptr": "*i1"}
    fwd_types.update(lse_R_ptr="*fp32", target_R_ptr="*i32", stats_R3_ptr="*fp32")
    for masks in (False, True):
        for given in (False, True):
            usage = compile_for_hopper(
                row_ce._ce_fwd_kernel,
                fwd_types,
                {
                    "HAS_TOKEN_MASK": masks,
                    "HAS_SAMPLE_MASK": masks,
                    "LSE_GIVEN": given,
                    "BLOCK_V": row_ce.CE_CONFIG["fwd_block_v"],
                },
            )
            assert "LOCAL:0" in usage, usage
    bwd_types = {"z_ptr": "*bf16", "lse_R_ptr": "*fp32", "target_R_ptr": "*i32"}
    bwd_types.update(g_ptr="*fp32", dz_ptr="*bf16", scale2="fp32")
    usage = compile_for_hopper(
        row_ce._ce_bwd_kernel,
        bwd_types,
        {"BLOCK_V": row_ce.CE_CONFIG["bwd_block_v"], "BLOCKS": row_ce.CE_CONFIG["bwd_blocks"]},
    )
    assert "LOCAL:0" in usage, usage
