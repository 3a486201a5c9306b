"""project_by_gather: Triton gathers vs fp32 sparse.mm and a float64 dense product."""

import pytest
import torch

from xtoken_core.kernels import projection_gather as pg

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _matrix(S, K, W, J, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, W, (S, K), generator=gen)
    indices[torch.rand(S, K, generator=gen) < 0.3] = -1
    indices[1, : min(K, 2)] = 3  # a repeated (s, t) entry: summed like a coalesced matrix
    likelihoods = torch.rand(S, K, generator=gen)
    likelihoods[0, 0] = 0.0  # explicit zero weight: dropped
    perm = torch.randperm(W, generator=gen)
    idx = torch.cat([torch.tensor([3]), perm[perm != 3][: J - 1]])  # column 3 is selected
    return indices.to(device), likelihoods.to(device), idx.to(device)


def _dense_restricted(indices, likelihoods, idx):
    S, K = indices.shape
    W = int(max(indices.max(), idx.max())) + 1
    dense = torch.zeros(S, W, dtype=torch.float64, device=indices.device)
    keep = indices >= 0
    rows = torch.arange(S, device=indices.device)[:, None].expand(S, K)[keep]
    dense.index_put_((rows, indices[keep]), likelihoods[keep].double(), accumulate=True)
    return dense[:, idx]


def _probs(N, S, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(N, S, generator=gen) * 3, -1).to(dtype).to(DEVICE)


SHAPES = [(67, 3, 53, 17, 7), (301, 5, 257, 41, 37), (129, 1, 90, 33, 20)]  # S, K, W, J, N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_sparse_mm_reference(dtype, shape):
    S, K, W, J, N = shape
    indices, likelihoods, idx = _matrix(S, K, W, J, seed=sum(shape))
    index = pg.build_gather_index(indices, likelihoods, idx)
    p = _probs(N, S, dtype, seed=N)
    x = p.clone().requires_grad_()
    q = pg.project_by_gather(x, index)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    (q * g).sum().backward()
    xr = p.clone().requires_grad_()
    q_ref = pg.project_reference(xr, index)
    (q_ref * g).sum().backward()
    assert q.dtype == torch.float32 and q.shape == (N, J)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)
    q64 = p.double() @ _dense_restricted(indices, likelihoods, idx)
    torch.testing.assert_close(q.double(), q64, atol=1e-6, rtol=1e-5)
    assert x.grad.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(x.grad, xr.grad.to(dtype), **tol)
    dp64 = g.double() @ _dense_restricted(indices, likelihoods, idx).t()
    torch.testing.assert_close(x.grad.double(), dp64, **tol)


def test_matches_fp32_sparse_mm_of_losses():
    utils = pytest.importorskip("xtoken_core.losses.utils")
    indices, likelihoods, idx = _matrix(150, 4, 120, 29, seed=3)
    index = pg.build_gather_index(indices, likelihoods, idx)
    p = _probs(23, 150, torch.float32, seed=4)
    q = pg.project_by_gather(p, index)
    q_ref = utils.Fp32SparseMM.apply(index.sparse_matrix(), p.t()).t()
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-5)


def test_rows_without_selected_entries_get_zero_gradient():
    indices, likelihoods, idx = _matrix(90, 3, 200, 9, seed=5)
    index = pg.build_gather_index(indices, likelihoods, idx)
    x = _probs(11, 90, torch.bfloat16, seed=6).requires_grad_()
    pg.project_by_gather(x, index).sum().backward()
    touched = torch.zeros(90, dtype=torch.bool, device=DEVICE)
    touched[index.col_rows_E.long()] = True
    assert bool((x.grad[:, ~touched] == 0).all())
    assert bool((x.grad[:, touched] != 0).any())


def test_index_structure_is_consistent():
    indices, likelihoods, idx = _matrix(301, 5, 257, 41, seed=7)
    index = pg.build_gather_index(indices, likelihoods, idx)
    E = index.col_rows_E.numel()
    assert index.col_ptr_J1[0] == 0 and index.col_ptr_J1[-1] == E
    assert bool((index.col_ptr_J1[1:] >= index.col_ptr_J1[:-1]).all())
    assert int((index.ell_cols_SK >= 0).sum()) == E  # the same entries in both layouts
    assert index.ell_cols_SK.shape[1] <= indices.shape[1]
    assert bool((index.col_w_E != 0).all())


def test_two_runs_are_bitwise_equal():
    indices, likelihoods, idx = _matrix(211, 4, 180, 37, seed=9)
    p = _probs(29, 211, torch.bfloat16, seed=10)
    outs = []
    for _ in range(2):
        x = p.clone().requires_grad_()
        q = pg.project_by_gather(x, (indices, likelihoods, idx))
        (q * torch.linspace(-1, 1, q.numel(), device=DEVICE).view_as(q)).sum().backward()
        outs.append((q, x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_an_index_built_after_an_in_place_change_follows_it():
    indices, likelihoods, idx = _matrix(50, 2, 40, 8, seed=11)
    first = pg.build_gather_index(indices, likelihoods, idx)
    likelihoods.mul_(2.0)
    second = pg.build_gather_index(indices, likelihoods, idx)
    assert second is not first
    torch.testing.assert_close(second.col_w_E, first.col_w_E * 2)


def test_repeated_selected_columns_raise():
    indices, likelihoods, _ = _matrix(20, 2, 30, 5, seed=12)
    with pytest.raises(ValueError, match="repeated"):
        pg.build_gather_index(indices, likelihoods, torch.tensor([1, 2, 1], device=DEVICE))


def test_probability_width_must_match_matrix_rows():
    indices, likelihoods, idx = _matrix(20, 2, 30, 5, seed=13)
    with pytest.raises(ValueError, match="S=20"):
        pg.project_by_gather(torch.rand(3, 21, device=DEVICE), (indices, likelihoods, idx))


def test_cpu_fallback_without_interpreter_is_the_reference(no_interpreter):
    indices, likelihoods, idx = _matrix(60, 3, 50, 11, seed=14, device="cpu")
    index = pg.build_gather_index(indices, likelihoods, idx)
    p = torch.softmax(torch.randn(9, 60), -1)
    torch.testing.assert_close(pg.project_by_gather(p, index), pg.project_reference(p, index))


def test_long_columns_cut_into_pieces_and_chunked_rows_match_reference(monkeypatch):
    # piece_len 2 makes most columns "heavy" (partials summed in order); a tiny chunk budget
    # makes the forward transpose p in several chunks of rows.
    indices, likelihoods, idx = _matrix(301, 5, 40, 23, seed=21)
    index = pg.build_gather_index(indices, likelihoods, idx, piece_len=2)
    assert index.heavy_cols_H.numel() > 0 and index.num_partials > index.heavy_cols_H.numel()
    monkeypatch.setitem(pg.KERNEL_CONFIG, "fwd_chunk_bytes", 301 * 4 * 8)  # 8 rows a chunk
    monkeypatch.setitem(pg.KERNEL_CONFIG, "fwd_block_n", 8)
    p = _probs(37, 301, torch.float32, seed=22)
    q = pg.project_by_gather(p, index)
    q64 = p.double() @ _dense_restricted(indices, likelihoods, idx)
    torch.testing.assert_close(q.double(), q64, atol=1e-6, rtol=1e-5)


def test_pieces_cover_every_column_in_runs_of_at_most_piece_len():
    indices, likelihoods, idx = _matrix(301, 5, 40, 23, seed=23)
    index = pg.build_gather_index(indices, likelihoods, idx, piece_len=3)
    J = index.num_cols
    start, end = index.piece_start_P.long(), index.piece_end_P.long()
    dest = index.piece_dest_P.long()
    assert bool(((end - start) <= 3).all()) and bool((end >= start).all())
    # Pieces tile the entries in column order, without gaps or overlaps.
    assert int(start[0]) == 0 and int(end[-1]) == index.col_rows_E.numel()
    assert torch.equal(start[1:], end[:-1])
    # A light column writes its own row; partial rows are numbered densely from J on.
    sizes = index.col_ptr_J1[1:] - index.col_ptr_J1[:-1]
    j_P = torch.repeat_interleave(torch.arange(J, device=DEVICE), ((sizes + 2) // 3).clamp(min=1))
    light = dest < J
    assert torch.equal(dest[light], j_P[light])
    partial = dest[dest >= J] - J
    assert torch.equal(partial, torch.arange(index.num_partials, device=DEVICE))
    ptr = index.heavy_ptr_H1.long()
    assert int(ptr[-1]) == index.num_partials
    assert torch.equal(index.heavy_cols_H.long(), torch.nonzero(sizes > 3).flatten())
    assert torch.equal(j_P[~light].unique(), index.heavy_cols_H.long())


def test_strided_rows_of_p_match_contiguous():
    # fused.py passes probs[:, :rows]: a column slice, rows strided past S.
    indices, likelihoods, idx = _matrix(67, 3, 53, 17, seed=25)
    index = pg.build_gather_index(indices, likelihoods, idx)
    wide = _probs(13, 80, torch.bfloat16, seed=26)
    x = wide[:, :67].clone().requires_grad_()
    xs = wide.clone().requires_grad_()
    q = pg.project_by_gather(x, index)
    qs = pg.project_by_gather(xs[:, :67], index)
    assert torch.equal(q, qs)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    q.backward(g)
    qs.backward(g)
    assert torch.equal(xs.grad[:, :67], x.grad) and bool((xs.grad[:, 67:] == 0).all())


def test_selected_ids_past_the_matrix_width_are_empty_columns():
    indices, likelihoods, _ = _matrix(40, 3, 30, 5, seed=27)
    idx = torch.tensor([2, 500, 7, 31], device=DEVICE)  # 500 and 31 are used by no row
    index = pg.build_gather_index(indices, likelihoods, idx)
    p = _probs(6, 40, torch.float32, seed=28)
    q = pg.project_by_gather(p, index)
    assert bool((q[:, [1, 3]] == 0).all())
    q64 = p.double() @ _dense_restricted(indices, likelihoods, idx)
    torch.testing.assert_close(q.double(), q64, atol=1e-6, rtol=1e-5)


def test_new_selection_reusing_the_sorted_matrix_equals_a_fresh_build():
    indices, likelihoods, idx = _matrix(120, 4, 90, 20, seed=29)
    matrix = pg.teacher_major(indices, likelihoods)  # the (t, s)-sorted entries of M, once
    pg.build_gather_index(indices, likelihoods, idx, matrix=matrix)
    idx2 = torch.flip(idx, [0])[:15]
    cached = pg.build_gather_index(indices, likelihoods, idx2, matrix=matrix)
    fresh = pg.build_gather_index(indices, likelihoods, idx2)
    for name in ("col_ptr_J1", "col_rows_E", "col_w_E", "ell_cols_SK", "ell_w_SK"):
        assert torch.equal(getattr(cached, name), getattr(fresh, name)), name


@pytest.mark.gpu
def test_full_size_matches_reference_and_is_deterministic_on_gpu():
    S, K, W, J, N = 151936, 8, 128256, 8192, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    indices = torch.randint(0, W, (S, K), device="cuda", generator=gen)
    indices[torch.rand(S, K, device="cuda", generator=gen) < 0.4] = -1
    likelihoods = torch.rand(S, K, device="cuda", generator=gen)
    idx = torch.randperm(W, device="cuda", generator=gen)[:J]
    index = pg.build_gather_index(indices, likelihoods, idx)
    p = torch.softmax(torch.randn(N, S, device="cuda", generator=gen), -1).to(torch.bfloat16)
    x = p.clone().requires_grad_()
    q = pg.project_by_gather(x, index)
    g = torch.randn_like(q)
    (q * g).sum().backward()
    xr = p.clone().requires_grad_()
    q_ref = pg.project_reference(xr, index)
    (q_ref * g).sum().backward()
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-4)
    rel = (x.grad.double() - xr.grad.double()).norm() / xr.grad.double().norm()
    assert rel < 1e-2
    x2 = p.clone().requires_grad_()
    q2 = pg.project_by_gather(x2, index)
    (q2 * g).sum().backward()
    assert torch.equal(q2, q) and torch.equal(x2.grad, x.grad)
