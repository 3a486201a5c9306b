"""Every mode's kernel path (``kernel_kd_loss``) against its reference (``reference_kd_loss``)."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.data.projection import Projection, exact_token_map_from_topk
from xtoken_core.losses import CrossTokenizerLossConfig
from xtoken_core.losses.alignment import chunk_validity, shift_chunk_ids
from xtoken_core.losses.backends.kernel import kernels_run_on
from xtoken_core.losses.inputs import LossInputs
from xtoken_core.losses.modes import gold, pkl

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, U, V, W, C, K = 2, 23, 19, 61, 53, 12, 3


@pytest.fixture(autouse=True)
def _interpreter_without_cuda(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _chunk_ids(Bn, Tn, Cn, gen):
    rows = []
    for _ in range(Bn):
        lengths = torch.randint(1, 3, (Tn,), generator=gen)
        cid = torch.repeat_interleave(torch.arange(Tn), lengths)[:Tn]
        cid = torch.where(cid < Cn, cid, torch.full_like(cid, -1))
        cid[-2:] = -1
        rows.append(cid)
    return shift_chunk_ids(torch.stack(rows))


def _projection(Vn, Wn, gen, n_exact=20):
    """Rows < n_exact one-hot (common vocab), the rest K random teacher ids."""
    indices = torch.randint(0, Wn, (Vn, K), generator=gen)
    likelihoods = torch.rand(Vn, K, generator=gen) + 0.1
    likelihoods /= likelihoods.sum(1, keepdim=True)
    indices[:n_exact, 0], indices[:n_exact, 1:] = torch.arange(n_exact), -1
    likelihoods[:n_exact, 0], likelihoods[:n_exact, 1:] = 1.0, 0.0
    return indices, likelihoods


def _case(seed, dtype, Bn=B, Tn=T, Un=U, Vn=V, Wn=W, Cn=C, valid_p=0.8):
    gen = torch.Generator().manual_seed(seed)
    s_ids, t_ids = _chunk_ids(Bn, Tn, Cn, gen), _chunk_ids(Bn, Un, Cn, gen)
    valid = chunk_validity(s_ids, t_ids, torch.rand(Bn, Cn, generator=gen) < valid_p)
    indices, likelihoods = _projection(Vn, Wn, gen)
    zs = (3 * torch.randn(Bn, Tn, Vn, generator=gen)).to(dtype)
    zt = (3 * torch.randn(Bn, Un, Wn, generator=gen)).to(dtype)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(zs), to(zt), to(s_ids), to(t_ids), to(valid), to(indices), to(likelihoods)


#: the module of each mode's reference and kernel path
MODULES = {"pkl": pkl, "gold": gold, "xtoken": gold}


def _run(path, mode, zs, zt, s_ids, t_ids, valid, indices, likelihoods, **kw):
    """The KD terms and the logits' gradient of ``path`` ("reference" or "kernel")."""
    kd_loss = getattr(MODULES[mode], f"{path}_kd_loss")
    x = zs.detach().clone().requires_grad_()
    inputs = LossInputs(x, zt, s_ids, t_ids, valid)
    config = CrossTokenizerLossConfig(
        mode=mode,
        temperature=kw.get("temperature", 1.7),
        reverse_kl=kw.get("reverse_kl", False),
        vocab_topk=kw.get("vocab_topk", 17),
    )
    config.uncommon_topk = kw.get("uncommon_topk", 9)  # 0 too, which a run config refuses
    Vn, Wn = zs.shape[-1], zt.shape[-1]
    if mode == "pkl":
        M = Projection.from_topk(indices, likelihoods, zs.device).sparse(Vn, Wn)
        terms = kd_loss(inputs, M, config)
    else:
        exact = kw.get("exact") or exact_token_map_from_topk(
            indices, likelihoods, xtoken_loss=mode == "xtoken", teacher_vocab_size=Wn
        )
        terms = kd_loss(inputs, exact, config)
    terms.kd.backward()
    return terms, x.grad


def _assert_match(mode, case, grad_tol, **kw):
    assert kernels_run_on(case[0], case[1])
    ref, g_ref = _run("reference", mode, *case, **kw)
    got, g_got = _run("kernel", mode, *case, **kw)
    for name in ("kd", "kl", "l1", "num_valid"):
        torch.testing.assert_close(
            getattr(got, name).float(), getattr(ref, name).float(), rtol=2e-5, atol=1e-6
        )
    assert got.correct.item() == ref.correct.item()
    assert g_got.dtype == case[0].dtype and g_got.shape == case[0].shape
    torch.testing.assert_close(g_got.float(), g_ref.float(), **grad_tol)


@pytest.mark.parametrize("reverse_kl", [False, True], ids=["fwd-kl", "rev-kl"])
@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_fp32_values_gradients_and_metrics_match_the_reference(mode, reverse_kl):
    case = _case(1, torch.float32)
    _assert_match(mode, case, dict(rtol=1e-4, atol=1e-6), reverse_kl=reverse_kl)


@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_bf16_logits_match_the_reference_within_bf16_rounding(mode):
    case = _case(2, torch.bfloat16)
    ref, g_ref = _run("reference", mode, *case, temperature=2.0)
    got, g_got = _run("kernel", mode, *case, temperature=2.0)
    torch.testing.assert_close(got.kd, ref.kd, rtol=1e-4, atol=1e-6)
    rel = (g_got.float() - g_ref.float()).norm() / g_ref.float().norm()
    assert rel < 1e-2, rel


def test_pkl_with_every_teacher_column_matches_the_reference():
    case = _case(3, torch.float32)
    _assert_match("pkl", case, dict(rtol=1e-4, atol=1e-6), vocab_topk=None)


def test_no_valid_chunk_gives_zero_loss_and_zero_gradient():
    for mode in ("pkl", "gold"):
        case = list(_case(4, torch.float32))
        case[4] = torch.zeros_like(case[4])
        terms, grad = _run("kernel", mode, *case)
        assert terms.kd.item() == 0.0 and terms.num_valid.item() == 0
        assert bool((grad == 0).all())


def test_gold_with_empty_common_vocab_or_empty_top_m_matches_the_reference():
    case = _case(5, torch.float32)
    Vn, Wn = case[0].shape[-1], case[1].shape[-1]
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    no_common = {
        "common_student": empty,
        "common_teacher": empty,
        "uncommon_student": torch.arange(Vn, device=DEVICE),
        "uncommon_teacher": torch.arange(Wn, device=DEVICE),
    }
    _assert_match("gold", case, dict(rtol=1e-4, atol=1e-6), exact=no_common)
    _assert_match("gold", case, dict(rtol=1e-4, atol=1e-6), uncommon_topk=0)


def test_projection_tables_are_built_once_per_projection():
    indices, likelihoods = _projection(V, W, torch.Generator().manual_seed(6))
    projection = Projection.from_topk(indices, likelihoods, DEVICE)
    M = projection.sparse(V, W)
    first = projection.kernel_tables(V, W)
    assert projection.kernel_tables(V, W) is first
    dense = M.to_dense()
    ell = torch.zeros(V, W, device=DEVICE)
    rows = torch.arange(V, device=DEVICE).view(-1, 1).expand_as(first.ell_t_SP)
    has = first.ell_t_SP >= 0
    ell.index_put_((rows[has], first.ell_t_SP[has].long()), first.ell_w_SP[has], accumulate=True)
    assert torch.equal(ell, dense)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pkl", "gold", "xtoken"])
def test_cuda_bf16_at_a_vocab_scale_size_matches_the_reference(mode):
    case = _case(7, torch.bfloat16, Bn=2, Tn=515, Un=509, Vn=20011, Wn=18013, Cn=400)
    ref, g_ref = _run("reference", mode, *case, temperature=2.0, vocab_topk=1500, uncommon_topk=512)
    got, g_got = _run("kernel", mode, *case, temperature=2.0, vocab_topk=1500, uncommon_topk=512)
    torch.testing.assert_close(got.kd, ref.kd, rtol=1e-4, atol=1e-6)
    rel = (g_got.float() - g_ref.float()).norm() / g_ref.float().norm()
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_cuda_kernels_compile_once_however_the_batch_sizes_vary(mode):
    # a training run meets new lengths and chunk counts every step; a kernel specialized on one
    # (an int that is 1 or a multiple of 16, a buffer carved at an offset that is 16-byte aligned
    # or not) compiles again in that step: 3-5 s, seen as a 0.37x pipeline at 1x4096 (P-KL)
    import triton

    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        # vocab sizes are multiples of 16 as real ones are (Qwen3 151,936, Mistral 32,768), so a
        # batch stride T * V is too; B * T >= 512 keeps the blocks sized by it at their cap
        sizes = [(515, 509, 400), (512, 496, 32), (301, 288, 17), (640, 600, 33), (333, 517, 160)]
        for i, (Tn, Un, Cn) in enumerate(sizes):
            case = _case(30 + i, torch.bfloat16, Bn=2, Tn=Tn, Un=Un, Vn=20016, Wn=18016, Cn=Cn)
            _run("kernel", mode, *case, vocab_topk=1500, uncommon_topk=512)
            torch.cuda.synchronize()
            if i == 0:
                compiled.clear()  # the first batch compiles every kernel once
        assert compiled == []
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook


@pytest.mark.gpu
def test_cuda_gold_compiles_its_top_m_counts_at_the_first_batch_even_when_its_rows_are_flat(
    monkeypatch,
):
    # a young model's rows are flat: every row goes to the top-k reference and the counting
    # kernels are not needed; the first later batch with a row they can do must not compile
    # them mid-run (2.4 s on a step at 4x2048 with an empty Triton cache)
    import triton

    from xtoken_core.kernels import topm_l1

    for name in ("_count_kernel", "_fine_plan_kernel", "_mark_kernel", "_resolve_kernel"):
        monkeypatch.setattr(getattr(topm_l1, name), "_by_mode", {})  # compiled afresh here
    monkeypatch.setattr(topm_l1, "_COUNTS_COMPILED", set())
    compiled = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["fn"].name)
    )
    flat = _case(40, torch.bfloat16, Bn=2, Tn=515, Un=509, Vn=20016, Wn=18016, Cn=400)
    flat = (flat[0] * 0.001, flat[1] * 0.001, *flat[2:])  # one coarse bin per row: no counts
    _run("kernel", "gold", *flat, vocab_topk=1500, uncommon_topk=512)
    torch.cuda.synchronize()
    compiled.clear()
    peaked = _case(41, torch.bfloat16, Bn=2, Tn=515, Un=509, Vn=20016, Wn=18016, Cn=400)
    ref, _ = _run("reference", "gold", *peaked, vocab_topk=1500, uncommon_topk=512)
    got, _ = _run("kernel", "gold", *peaked, vocab_topk=1500, uncommon_topk=512)
    torch.cuda.synchronize()
    assert compiled == []
    torch.testing.assert_close(got.kd, ref.kd, rtol=1e-4, atol=1e-6)
