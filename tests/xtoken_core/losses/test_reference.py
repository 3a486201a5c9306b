"""Reference loss building blocks: chunk helpers, Fp32SparseMM, DP reduction, gradchecks."""

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
    sparse_projection_from_topk,
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


def test_teacher_columns_are_the_topk_by_max_logit_over_chunked_positions():
    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0], [9.0, 0.0, 0.0, 0.0]]])
    # Position 1 has no chunk: its 9.0 on column 0 must not count.
    idx = reference.select_teacher_columns(logits, torch.tensor([[0, -1]]), 2)
    assert idx.tolist() == [1, 3]
    assert reference.select_teacher_columns(logits, torch.tensor([[0, -1]]), 10).tolist() == [
        0,
        1,
        2,
        3,
    ]


def test_restricted_projection_keeps_only_the_selected_columns_in_order():
    indices = torch.tensor([[0, 2], [3, -1], [1, 2]])
    likelihoods = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    M = sparse_projection_from_topk(
        indices, likelihoods, student_vocab_size=4, teacher_vocab_size=4
    )
    sub = reference.restrict_columns(M, torch.tensor([2, 3]))
    assert sub.to_dense().tolist() == [[0.5, 0.0], [0.0, 1.0], [0.75, 0.0], [0.0, 0.0]]


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


def test_pkl_kl_of_a_hand_computed_chunk():
    # Teacher chunk log-probs log([0.5, 0.25, 0.25]); student projection q = [2, 1, 1] / 4 after
    # renormalization -> identical: KL 0. Student [0.25, 0.25, 0.5]: KL = 0.25 * log 2.
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    same = reference.pkl_chunk_kl(
        teacher, torch.tensor([[2.0, 1.0, 1.0]], dtype=torch.float64), False
    )
    assert same.item() == pytest.approx(0.0, abs=1e-15)
    other = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)
    fwd = reference.pkl_chunk_kl(teacher, other, False).item()
    rev = reference.pkl_chunk_kl(teacher, other, True).item()
    assert fwd == pytest.approx(
        0.5 * torch.log(torch.tensor(2.0)).item() - 0.25 * torch.log(torch.tensor(2.0)).item()
    )
    assert rev == pytest.approx(0.25 * torch.log(torch.tensor(2.0)).item())


def test_gold_terms_of_a_hand_computed_chunk():
    # Common pair (student 0 <-> teacher 1); uncommon student {1, 2}, teacher {0, 2}.
    student = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[0.1, 0.4, 0.5]], dtype=torch.float64))
    exact = {
        "common_student": torch.tensor([0]),
        "common_teacher": torch.tensor([1]),
        "uncommon_student": torch.tensor([1, 2]),
        "uncommon_teacher": torch.tensor([0, 2]),
    }
    kl, l1 = reference.gold_chunk_terms(teacher, student, exact, uncommon_topk=8, reverse_kl=False)
    assert kl.item() == pytest.approx(0.4 * (torch.log(torch.tensor(0.4 / 0.5))).item())
    assert l1.item() == pytest.approx(abs(0.3 - 0.5) + abs(0.2 - 0.1))
    _, l1_top1 = reference.gold_chunk_terms(
        teacher, student, exact, uncommon_topk=1, reverse_kl=False
    )
    assert l1_top1.item() == pytest.approx(0.2)
    kl_rev, _ = reference.gold_chunk_terms(
        teacher, student, exact, uncommon_topk=8, reverse_kl=True
    )
    assert kl_rev.item() == pytest.approx(0.5 * torch.log(torch.tensor(0.5 / 0.4)).item())


def _tiny_case(seed):
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


@pytest.mark.parametrize("reverse", [False, True])
def test_pkl_reference_gradcheck(reverse):
    zs, zt, s_ids, t_ids, valid, M, _ = _tiny_case(3)

    def f(z):
        return reference.pkl_kd_loss(
            z, zt, s_ids, t_ids, valid, M, temperature=1.5, vocab_topk=4, reverse_kl=reverse
        ).kd

    assert torch.autograd.gradcheck(f, (zs,))


@pytest.mark.parametrize("reverse", [False, True])
def test_gold_reference_gradcheck(reverse):
    zs, zt, s_ids, t_ids, valid, _, exact = _tiny_case(4)

    def f(z):
        return reference.gold_kd_loss(
            z, zt, s_ids, t_ids, valid, exact, temperature=2.0, uncommon_topk=2, reverse_kl=reverse
        ).kd

    assert torch.autograd.gradcheck(f, (zs,))


def test_student_ce_reference_gradcheck_and_counts():
    zs, *_ = _tiny_case(5)
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


@pytest.mark.parametrize("vocab_topk", [None, 4])
def test_pkl_reference_of_an_empty_batch_is_a_zero_with_a_gradient(vocab_topk):
    zs, zt, s_ids, t_ids, valid, M, _ = _tiny_case(3)
    zs0 = zs[:0].detach().requires_grad_()
    terms = reference.pkl_kd_loss(
        zs0,
        zt[:0],
        s_ids[:0],
        t_ids[:0],
        valid[:0],
        M,
        temperature=1.0,
        vocab_topk=vocab_topk,
        reverse_kl=False,
    )
    assert terms.kd.item() == 0.0 and terms.num_valid.item() == 0
    terms.kd.backward()
    assert zs0.grad.shape == zs0.shape
    cols = reference.select_teacher_columns(zt[:0], t_ids[:0], vocab_topk)
    k = vocab_topk or zt.shape[-1]
    assert cols.numel() == k and bool((cols.diff() > 0).all())  # k distinct ids, ascending
