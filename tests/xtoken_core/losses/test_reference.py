"""The shared reference pieces: chunk helpers, validity, Fp32SparseMM, DP reduction, the CE and
the combination."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.losses import reference
from xtoken_core.losses.utils import (
    Fp32SparseMM,
    chunk_mean_scatter,
    chunk_sizes,
    dp_all_reduce_sum,
    shift_chunk_ids,
)


def test_shift_moves_each_chunk_id_one_position_left_and_ends_with_minus_one():
    chunk_id = torch.tensor([[0, 0, 1, 2, -1], [3, 4, 4, 4, 5]])
    assert shift_chunk_ids(chunk_id).tolist() == [[0, 1, 2, -1, -1], [4, 4, 4, 5, -1]]


def test_chunk_average_is_the_mean_over_the_chunk_positions():
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [7.0, 7.0]]])
    chunk_id = torch.tensor([[0, 0, -1, 2]])
    avg, sizes = reference.chunk_average_log_probs(x, chunk_id, 3)
    assert avg.tolist() == [[[2.0, 3.0], [0.0, 0.0], [7.0, 7.0]]]
    assert sizes.tolist() == [[2.0, 0.0, 1.0]]
    assert chunk_sizes(chunk_id, 3).tolist() == [[2.0, 0.0, 1.0]]


def test_scatter_chunk_mean_equals_the_one_hot_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    chunk_id = torch.randint(-1, 4, (2, 9), generator=g)
    expected, _ = reference.chunk_average_log_probs(x, chunk_id, 4)
    torch.testing.assert_close(chunk_mean_scatter(x, chunk_id, 4), expected)


def test_valid_chunk_needs_both_sides_non_empty_and_pair_valid():
    s_sizes = torch.tensor([[1.0, 0.0, 2.0, 1.0]])
    t_sizes = torch.tensor([[1.0, 1.0, 0.0, 3.0]])
    pair_valid = torch.tensor([[True, True, True, False]])
    assert reference.valid_chunk_mask(s_sizes, t_sizes, pair_valid).tolist() == [
        [True, False, False, False]
    ]


def test_chunk_validity_drops_masked_samples_and_incorrect_pairs_on_request():
    ids = torch.tensor([[0, 0, 1, 2], [0, 1, 1, 2]])  # shifted ids
    pair_valid = torch.ones(2, 3, dtype=torch.bool)
    is_correct = torch.tensor([[True, False, True], [True, True, True]])
    sample_mask = torch.tensor([1, 0])
    valid = reference.chunk_validity(ids, ids, pair_valid, sample_mask_B=sample_mask)
    assert valid.tolist() == [[True, True, True], [False, False, False]]
    exact = reference.chunk_validity(
        ids, ids, pair_valid, pair_is_correct_BC=is_correct, exact_token_match_only=True
    )
    assert exact.tolist() == [[True, False, True], [True, True, True]]
    with pytest.raises(ValueError, match="pair_is_correct"):
        reference.chunk_validity(ids, ids, pair_valid, exact_token_match_only=True)


def test_fp32_sparse_mm_stays_fp32_under_bf16_autocast_and_gives_no_gradient_to_the_matrix():
    g = torch.Generator().manual_seed(1)
    dense_M = torch.rand(6, 4, generator=g) * (torch.rand(6, 4, generator=g) > 0.5)
    sparse_M = dense_M.to_sparse().coalesce()
    x = torch.randn(6, 3, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Fp32SparseMM.apply(sparse_M, x.to(torch.bfloat16))
        assert out.dtype == torch.float32
        out.pow(2).sum().backward()
    torch.testing.assert_close(out, dense_M.t() @ x.to(torch.bfloat16).float())
    expected = dense_M @ (2 * (dense_M.t() @ x.to(torch.bfloat16).float()))
    torch.testing.assert_close(x.grad, expected, rtol=1e-2, atol=1e-2)
    assert not sparse_M.requires_grad


def test_fp32_sparse_mm_gradcheck_in_float64():
    g = torch.Generator().manual_seed(2)
    M = torch.rand(5, 3, generator=g, dtype=torch.float64) * (torch.rand(5, 3, generator=g) > 0.4)
    x = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d: Fp32SparseMM.apply(M.to_sparse(), d), (x,))


def test_dp_all_reduce_sum_is_a_fresh_float32_copy_without_distributed():
    local = torch.tensor(7, dtype=torch.int64)
    out = dp_all_reduce_sum(local)
    assert out.dtype == torch.float32 and out.item() == 7.0
    out += 1
    assert local.item() == 7
    assert dp_all_reduce_sum(3).item() == 3.0


def test_combine_losses_static_and_dynamic():
    kd, ce = torch.tensor(4.0), torch.tensor(2.0)
    assert (
        reference.combine_losses(kd, ce, kl_weight=0.5, ce_weight=2.0, dynamic_scaling=False) == 6.0
    )
    dyn = reference.combine_losses(kd, ce, kl_weight=1.0, ce_weight=1.0, dynamic_scaling=True)
    assert dyn.item() == 4.0  # 0.5 * 4 + 2
    zero_kd = reference.combine_losses(
        torch.tensor(0.0), ce, kl_weight=1.0, ce_weight=1.0, dynamic_scaling=True
    )
    assert zero_kd.item() == 2.0


def tiny_case(seed):
    """A small fp64 case: ``(zs, zt, s_ids, t_ids, valid, M, exact)``."""
    g = torch.Generator().manual_seed(seed)
    Bn, Tn, Un, Vn, Wn, Cn = 2, 5, 4, 6, 5, 3
    s_ids = torch.tensor([[0, 0, 1, 2, -1], [0, 1, 1, 2, 2]])
    t_ids = torch.tensor([[0, 1, 1, 2], [0, 1, 2, -1]])
    valid = torch.ones(Bn, Cn, dtype=torch.bool)
    zs = torch.randn(Bn, Tn, Vn, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(Bn, Un, Wn, generator=g, dtype=torch.float64)
    dense = torch.rand(Vn, Wn, generator=g, dtype=torch.float64) + 0.05
    exact = {
        "common_student": torch.tensor([0, 2]),
        "common_teacher": torch.tensor([1, 0]),
        "uncommon_student": torch.tensor([1, 3, 4, 5]),
        "uncommon_teacher": torch.tensor([2, 3, 4]),
    }
    return zs, zt, s_ids, t_ids, valid, dense.to_sparse().coalesce(), exact


def test_student_ce_reference_gradcheck_and_counts():
    zs, *_ = tiny_case(5)
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]])
    token_mask = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
    sample_mask = torch.tensor([1, 0])
    nll, correct, n = reference.student_ce_loss(zs, ids, token_mask, sample_mask)
    assert n.item() == 3
    expected = -sum(torch.log_softmax(zs[0, p].detach(), 0)[ids[0, p + 1]] for p in (0, 1, 3))
    assert nll.item() == pytest.approx(expected.item())
    assert torch.autograd.gradcheck(
        lambda z: reference.student_ce_loss(z, ids, token_mask, sample_mask)[0], (zs,)
    )
