"""Sorted top-m L1 from counts (kernels.topm_l1) against the torch.topk reference."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE, compile_for_hopper
from xtoken_core.kernels import topm_l1 as tm


def _rows(N, A, B, seed, *, similar=False, ties=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.log_softmax(torch.randn(N, A, generator=gen) * 2, -1)
    if similar:  # the teacher close to the student: D keeps crossing zero
        b = a[:, torch.randperm(A, generator=gen)[:B]] + 1e-3 * torch.randn(N, B, generator=gen)
    else:
        b = torch.log_softmax(torch.randn(N, B, generator=gen) * 1.5, -1)
    if ties:  # a run of equal values on each side
        a[:, :ties] = a[:, :1]
        b[:, :ties] = b[:, :1]
    return a.to(DEVICE), b.to(DEVICE)


@pytest.fixture
def counts_only(monkeypatch):
    """Fail the test if topm_l1 falls back to the reference (the counts must do the rows)."""

    def refuse(*args):
        raise AssertionError("topm_l1 fell back to the reference")

    monkeypatch.setattr(tm, "_reference_signs", refuse)


def _check(a, b, m, **kw):
    l1_ref, g_ref, gsum_ref = tm.topm_l1_reference(a, b, m)
    l1, g, gsum = tm.topm_l1(a, b, m, **kw)
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "N, A, B, m", [(3, 200, 150, 40), (2, 300, 120, 120), (4, 90, 250, 1), (2, 64, 64, 64)]
)
def test_topm_l1_matches_topk_reference(N, A, B, m, counts_only):
    a, b = _rows(N, A, B, seed=N + A + m)
    _check(a, b, m)


def test_topm_l1_resolves_a_teacher_close_to_the_student(counts_only):
    a, b = _rows(3, 256, 200, seed=7, similar=True)
    _check(a, b, 100)


def test_topm_l1_pools_only_the_open_bins(counts_only):
    # 11,000 elements a row, at most 2,000 pool slots a row: only the bins around the m-th
    # values and where D changes sign are copied out and refined, the rest is decided by counts
    gen = torch.Generator().manual_seed(13)
    a = torch.log_softmax(torch.randn(2, 6000, generator=gen) * 3, -1).to(DEVICE)
    b = torch.log_softmax(torch.randn(2, 5000, generator=gen) * 1.5, -1).to(DEVICE)
    _check(a, b, 700, max_open_row=2000)


def test_topm_l1_copies_open_elements_out_across_many_steps_and_programs(monkeypatch, counts_only):
    # the count pass's steps take places in a row's records one after another (the student's
    # side, then the teacher's after the student's open elements) and the mark pass reads them
    # back in several programs a row: the same result as one step and one program would give
    monkeypatch.setitem(tm.PASS_TILES, "block", 32)
    monkeypatch.setitem(tm.MARK_TILES, "block", 16)
    monkeypatch.setitem(tm.MARK_TILES, "records", 48)
    a, b = _rows(3, 700, 500, seed=21, similar=True)
    _check(a, b, 300)


@pytest.mark.gpu
def test_topm_l1_signs_are_the_same_bits_on_every_call():
    # one program a row side takes its records' places in column order: nothing depends on
    # the order the GPU runs the programs in (rows long enough for thousands of open elements)
    a, b = _rows(64, 40000, 30000, seed=3, similar=True)
    first = tm.topm_l1_signs(a, b, 4096)
    for _ in range(3):
        again = tm.topm_l1_signs(a, b, 4096)
        for x, y in zip(again, first, strict=True):
            assert torch.equal(x, y)


def test_topm_l1_takes_the_coarse_histograms_from_the_caller(monkeypatch, counts_only):
    a, b = _rows(3, 300, 200, seed=9)
    hist_2NK = torch.zeros((2, 3, tm.COARSE_BINS), dtype=torch.int32, device=DEVICE)
    tm._hist_kernel[(3, 2, 1)](
        a, b, 300, 200, 300, 200, hist_2NK, 3, 1024, K=tm.COARSE_BINS, BASE=tm.COARSE_BASE,
        SHIFT=tm.COARSE_SHIFT, BLOCK=512,
    )  # fmt: skip

    def refuse(*args, **kwargs):
        raise AssertionError("topm_l1 counted histograms it was given")

    monkeypatch.setattr(tm, "_hist_kernel", refuse)
    _check(a, b, 70, hist_2NK=hist_2NK)
    with pytest.raises(ValueError, match="hist_2NK must be"):
        tm.topm_l1(a, b, 70, hist_2NK=hist_2NK[:, :2])


def test_topm_l1_writes_the_gradient_over_its_input(counts_only):
    a, b = _rows(2, 200, 180, seed=3)
    l1_ref, g_ref, _ = tm.topm_l1_reference(a, b, 50)
    l1, g, _ = tm.topm_l1(a, b, 50, out_g=a)
    assert g.data_ptr() == a.data_ptr()
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)


def test_topm_l1_leaves_its_inputs_as_they_were(counts_only):
    a, b = _rows(2, 200, 180, seed=4)
    a_before, b_before = a.clone(), b.clone()
    _check(a, b, 50)
    torch.testing.assert_close(a, a_before, rtol=0, atol=0)
    torch.testing.assert_close(b, b_before, rtol=0, atol=0)


def test_topm_l1_resolves_ties_within_a_fine_bin(counts_only):
    # which of equal values is "first" is arbitrary: the gradients agree as multisets per row
    a, b = _rows(2, 128, 128, seed=5, ties=40)
    l1_ref, g_ref, gsum_ref = tm.topm_l1_reference(a, b, 60)
    l1, g, gsum = tm.topm_l1(a, b, 60)
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g.sort(-1).values, g_ref.sort(-1).values, rtol=1e-6, atol=0)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)


def test_topm_l1_falls_back_when_a_row_needs_too_large_a_pool(monkeypatch):
    calls = []
    reference = tm._reference_signs
    monkeypatch.setattr(tm, "_reference_signs", lambda *args: calls.append(1) or reference(*args))
    a, b = _rows(2, 128, 128, seed=5, ties=40)
    l1_ref, _, gsum_ref = tm.topm_l1_reference(a, b, 60)
    l1, g, gsum = tm.topm_l1(a, b, 60, max_open_row=8)
    assert calls == [1]
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)


class _CountLaunches:
    """Stands in for ``_count_kernel``: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_topm_l1_compiles_its_counts_kernels_when_every_row_goes_to_the_reference(monkeypatch):
    # a young model's flat rows all go to the reference: the counts' kernels run once anyway,
    # on two rows of the same widths, so that they compile in that (a run's first) step and not in
    # the first later step with a row they can do
    monkeypatch.setattr(tm, "_COUNTS_COMPILED", set())
    launches = _CountLaunches(tm._count_kernel)
    monkeypatch.setattr(tm, "_count_kernel", launches)
    a, b = _rows(2, 128, 128, seed=5, ties=40)
    l1_ref, _, gsum_ref = tm.topm_l1_reference(a, b, 60)
    l1, _, gsum = tm.topm_l1(a, b, 60, max_open_row=8)  # every row needs too large a pool
    assert [grid[0] for grid in launches.grids] == [2]  # the warm-up's two rows
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)
    tm.topm_l1(a, b, 60, max_open_row=8)
    tm.topm_l1(a[:, :100], b[:, :90], 60, max_open_row=8)  # other widths: once more
    assert [grid[0] for grid in launches.grids] == [2, 2]


def test_topm_l1_needs_no_warm_up_after_its_counts_have_run(monkeypatch):
    monkeypatch.setattr(tm, "_COUNTS_COMPILED", set())
    launches = _CountLaunches(tm._count_kernel)
    monkeypatch.setattr(tm, "_count_kernel", launches)
    a, b = _rows(3, 128, 128, seed=5, ties=40)
    tm.topm_l1(a, b, 60)  # rows the counts do
    tm.topm_l1(a, b, 60, max_open_row=8)  # then none
    assert [grid[0] for grid in launches.grids] == [3]


@pytest.mark.parametrize("why", ["ties larger than the list", "top-m below the range"])
def test_topm_l1_sends_only_the_rows_it_cannot_do_to_the_reference(monkeypatch, why):
    rows_seen = []
    reference = tm._reference_signs
    monkeypatch.setattr(
        tm, "_reference_signs", lambda a, *rest: rows_seen.append(a.shape[0]) or reference(a, *rest)
    )
    a, b = _rows(3, 128, 128, seed=5)
    if why == "ties larger than the list":  # an open bin of > B / 2 elements in row 1
        a[1, :70] = a[1, :1]
        b[1, :70] = b[1, :1]
    else:  # row 1 has fewer than m values above -248 nats
        a[1, 20:] = -300.0
    l1_ref, g_ref, gsum_ref = tm.topm_l1_reference(a, b, 60)
    l1, g, gsum = tm.topm_l1(a, b, 60, out_g=a)
    assert rows_seen == [1]
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g[[0, 2]], g_ref[[0, 2]], rtol=1e-6, atol=0)
    torch.testing.assert_close(g[1].sort().values, g_ref[1].sort().values, rtol=1e-6, atol=0)


def test_topm_l1_places_rows_across_steps_with_rows_sent_to_the_reference(monkeypatch):
    # the rows' places in the open tables are running sums over the rows done by the counts,
    # carried across the places pass's steps; the row sums are made in blocks of rows
    monkeypatch.setattr(tm, "PLACES_BLOCK", 4)
    monkeypatch.setattr(tm, "SUMS_BLOCK", 2)
    rows_seen = []
    reference = tm._reference_signs
    monkeypatch.setattr(
        tm, "_reference_signs", lambda a, *rest: rows_seen.append(a.shape[0]) or reference(a, *rest)
    )
    a, b = _rows(11, 160, 140, seed=17, similar=True)
    a[[1, 6], 20:] = -300.0  # fewer than m values above -248 nats: the reference's rows
    l1_ref, g_ref, gsum_ref = tm.topm_l1_reference(a, b, 60)
    l1, g, gsum = tm.topm_l1(a, b, 60)
    assert rows_seen == [2]
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gsum, gsum_ref, rtol=1e-5, atol=1e-7)
    done = [n for n in range(11) if n not in (1, 6)]
    torch.testing.assert_close(g[done], g_ref[done], rtol=1e-6, atol=0)


def test_topm_l1_refuses_m_outside_the_rows():
    a, b = _rows(1, 10, 8, seed=0)
    with pytest.raises(ValueError, match="m=9"):
        tm.topm_l1(a, b, 9)


def test_topm_l1_matches_the_reference_with_zero_probabilities():
    # log-probs of -inf (probability 0) in a row: the result still equals the reference
    a, b = _rows(2, 100, 90, seed=11)
    a[0, :50] = float("-inf")
    for got, want in zip(tm.topm_l1(a, b, 30), tm.topm_l1_reference(a, b, 30)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_topm_l1_kernels_compile_for_hopper_without_local_memory(monkeypatch):
    # The interpreter runs what the compiler may refuse (a loop-carried value changing shape);
    # this compiles every kernel for an H100 here, without a GPU, and refuses spills.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f32, i32, i64 = "*fp32", "*i32", "*i64"
    pointers = {
        **dict.fromkeys(["a_ptr", "b_ptr", "g_ptr", "part_ptr"], f32),
        **dict.fromkeys(["list_val_ptr", "out_ptr", "rec_val_ptr"], f32),
        **dict.fromkeys(["hist_ptr", "top_ptr", "cls_ptr", "loc_ptr", "opens_ptr"], i32),
        **dict.fromkeys(["info_ptr", "pidx_ptr", "fhist_ptr", "foffs_ptr", "list_key_ptr"], i32),
        **dict.fromkeys(["ocap_ptr", "rec_key_ptr"], i32),
        **dict.fromkeys(["qbase_ptr", "nlist_ptr", "lbase_ptr", "obase_ptr"], i64),
        "fcode_ptr": "*u8",
        "state_ptr": "*i8",
        **dict.fromkeys(["res_ptr", "sums_ptr", "part2_ptr"], "*fp64"),
        **dict.fromkeys(["l1_ptr", "gsum_ptr"], f32),
        "sizes_ptr": i64,
    }
    bins = {"K": tm.COARSE_BINS, "BASE": tm.COARSE_BASE, "SHIFT": tm.COARSE_SHIFT}
    fine = {**bins, "FSHIFT": tm.FINE_SHIFT}
    kernels = [
        (tm._hist_kernel, {**bins, "BLOCK": 1024}),
        (tm._plan_kernel, {"K": tm.COARSE_BINS, "BELOW": tm.BELOW_BIN}),
        (tm._count_kernel, {**fine, "BLOCK": 1024}),
        (tm._fine_plan_kernel, {"K": tm.COARSE_BINS}),
        (tm._mark_kernel, {**fine, "COL_BITS": tm._COL_BITS, "BLOCK": 1024}),
        (tm._resolve_kernel, {"K": tm.COARSE_BINS, "COL_BITS": tm._COL_BITS, **tm.RESOLVE_TILES}),
        (tm._places_kernel, {"BLOCK": tm.PLACES_BLOCK}),
        (tm._row_sums_kernel, {"BLOCK": tm.SUMS_BLOCK}),
    ]
    for lazy, constexprs in kernels:
        usage = compile_for_hopper(lazy, pointers, constexprs)
        assert "LOCAL:0" in usage and "STACK:0" in usage, (lazy.__name__, usage)


def test_topm_l1_signs_queues_the_callers_work_before_its_one_host_wait(counts_only):
    # before_wait runs once (the coarse plan's readback); work it queues that writes elsewhere
    # leaves the result as without it
    a, b = _rows(3, 256, 200, seed=7, similar=True)
    plain = tm.topm_l1_signs(a, b, 100)
    side = torch.zeros(4, device=DEVICE)
    calls = []

    def queue_other_work():
        calls.append(1)
        side.add_(torch.randn(4, device=DEVICE))

    signs = tm.topm_l1_signs(a, b, 100, before_wait=queue_other_work)
    assert len(calls) == 1
    for x, y in zip(signs, plain, strict=True):
        assert torch.equal(x, y)
