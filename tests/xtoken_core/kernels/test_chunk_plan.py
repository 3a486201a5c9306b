"""chunk_plan chunk plan vs the PyTorch composition it replaces (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE
from xtoken_core.kernels import chunk_plan
from xtoken_core.losses.alignment import chunk_rows, chunk_validity, shift_chunk_ids

pytest.importorskip("triton")


def _ids(B, L, C, gen, lo=-1, hi=None):
    """Arbitrary (not monotone) ids in [lo, hi), many -1."""
    hi = C if hi is None else hi
    ids = torch.randint(lo, hi, (B, L), generator=gen)
    ids[torch.rand(B, L, generator=gen) < 0.2] = -1
    return ids


def _expected(s_raw, t_raw, pair_valid, C, **masks):
    s_ids = shift_chunk_ids(s_raw.clamp(-1, C - 1))
    t_ids = shift_chunk_ids(t_raw.clamp(-1, C - 1))
    valid = chunk_validity(s_ids, t_ids, pair_valid, **masks)
    N = int(valid.sum())
    return s_ids, t_ids, valid, N, chunk_rows(s_ids, valid, N), chunk_rows(t_ids, valid, N)


def _assert_plan(plan, s_raw, t_raw, pair_valid, C, **masks):
    s_ids, t_ids, valid, N, s_rows, t_rows = _expected(s_raw, t_raw, pair_valid, C, **masks)
    assert torch.equal(plan.student_chunk_id_BT.cpu(), s_ids)
    assert torch.equal(plan.teacher_chunk_id_BU.cpu(), t_ids)
    assert torch.equal(plan.valid_BC.cpu(), valid)
    stats = plan.stats_5.tolist()
    assert stats == [s_raw.min(), s_raw.max(), t_raw.min(), t_raw.max(), N]
    for side, want in ((0, s_rows), (1, t_rows)):
        nidx, order, offsets, sizes = (x.cpu() for x in plan.rows(side, N))
        assert torch.equal(nidx, want.nidx_R)
        assert torch.equal(order, want.order_R)  # the same stable sort, rows of none last
        assert torch.equal(offsets, want.offsets_N1)
        assert torch.equal(sizes, want.sizes_N)


def _runs(B, L, C):
    """Aligner-like ids: runs of 1-3 positions in increasing chunk order, -1 past C."""
    lengths = torch.arange(L) % 3 + 1
    ids = torch.repeat_interleave(torch.arange(L), lengths)[:L]
    return torch.where(ids < C, ids, -1).expand(B, L).clone()


@pytest.mark.parametrize("B,T,U,C", [(1, 9, 7, 5), (3, 37, 29, 23), (2, 70, 81, 19)])
@pytest.mark.parametrize("small_blocks", [False, True], ids=["default", "blocks-16"])
def test_plan_equals_shift_validity_and_stable_row_sort(B, T, U, C, small_blocks, monkeypatch):
    if small_blocks:  # several slot blocks, row tiles and slot steps at these sizes
        for key in ("block", "rows_block_t", "rows_block_c"):
            monkeypatch.setitem(chunk_plan.PLAN_CONFIG, key, 16)
    gen = torch.Generator().manual_seed(B * T + C)
    s_raw, t_raw = _ids(B, T, C, gen), _ids(B, U, C, gen)
    pair_valid = torch.rand(B, C, generator=gen) < 0.8
    plan = chunk_plan.plan_chunks(s_raw.to(DEVICE), t_raw.to(DEVICE), pair_valid.to(DEVICE))
    _assert_plan(plan, s_raw, t_raw, pair_valid, C)
    s_raw, t_raw = _runs(B, T, C), _runs(B, U, C)
    plan = chunk_plan.plan_chunks(s_raw.to(DEVICE), t_raw.to(DEVICE), pair_valid.to(DEVICE))
    _assert_plan(plan, s_raw, t_raw, pair_valid, C)


def test_plan_applies_the_sample_mask_and_exact_match_only():
    B, T, U, C = 3, 21, 25, 11
    gen = torch.Generator().manual_seed(5)
    s_raw, t_raw = _ids(B, T, C, gen), _ids(B, U, C, gen)
    pair_valid = torch.rand(B, C, generator=gen) < 0.9
    correct = torch.rand(B, C, generator=gen) < 0.6
    sample_mask = torch.tensor([1, 0, 1])
    plan = chunk_plan.plan_chunks(
        s_raw.to(DEVICE),
        t_raw.to(DEVICE),
        pair_valid.to(DEVICE),
        sample_mask_B=sample_mask.to(DEVICE),
        pair_is_correct_BC=correct.to(DEVICE),
        exact_token_match_only=True,
    )
    masks = dict(sample_mask_B=sample_mask, pair_is_correct_BC=correct, exact_token_match_only=True)
    _assert_plan(plan, s_raw, t_raw, pair_valid, C, **masks)
    assert not bool(plan.valid_BC[1].any())


def test_out_of_range_ids_are_clamped_and_reported_in_the_stats():
    B, T, U, C = 2, 13, 11, 6
    gen = torch.Generator().manual_seed(8)
    s_raw, t_raw = _ids(B, T, C, gen, lo=-3), _ids(B, U, C, gen, hi=C + 4)
    pair_valid = torch.ones(B, C, dtype=torch.bool)
    plan = chunk_plan.plan_chunks(s_raw.to(DEVICE), t_raw.to(DEVICE), pair_valid.to(DEVICE))
    assert plan.stats_5[0].item() < -1 and plan.stats_5[3].item() >= C
    _assert_plan(plan, s_raw, t_raw, pair_valid, C)


def test_no_valid_chunk_gives_n_zero_and_every_row_outside():
    B, T, U, C = 2, 8, 9, 4
    gen = torch.Generator().manual_seed(9)
    s_raw, t_raw = _ids(B, T, C, gen), _ids(B, U, C, gen)
    pair_valid = torch.zeros(B, C, dtype=torch.bool)
    plan = chunk_plan.plan_chunks(s_raw.to(DEVICE), t_raw.to(DEVICE), pair_valid.to(DEVICE))
    assert plan.stats_5[4].item() == 0
    _assert_plan(plan, s_raw, t_raw, pair_valid, C)


def test_exact_match_only_without_pair_is_correct_is_rejected():
    ids = torch.zeros(1, 4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="pair_is_correct"):
        chunk_plan.plan_chunks(
            ids, ids, torch.ones(1, 2, dtype=torch.bool, device=DEVICE), exact_token_match_only=True
        )


@pytest.mark.gpu
def test_cuda_plan_at_the_benchmark_size_equals_the_torch_composition():
    B, T, U, C = 2, 4096, 4001, 3276
    gen = torch.Generator().manual_seed(11)
    s_raw, t_raw = _runs(B, T, C), _runs(B, U, C)
    s_raw[1, 100:140] = torch.randint(-1, C, (40,), generator=gen)  # some out-of-order ids
    pair_valid = torch.rand(B, C, generator=gen) < 0.9
    plan = chunk_plan.plan_chunks(s_raw.cuda(), t_raw.cuda(), pair_valid.cuda())
    _assert_plan(plan, s_raw, t_raw, pair_valid, C)
