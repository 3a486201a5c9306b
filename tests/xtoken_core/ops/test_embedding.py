"""NativeEmbeddingOp: exact gather, fp32 path, purity, used-row gradients, deterministic backward."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.ops import embedding as emb
from xtoken_core.ops.embedding import NativeEmbeddingOp, segment_sum_rows

ID_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _table(vocab=37, hidden=11, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=gen).to(dtype).to(device)


def _ids(shape, vocab, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=gen).to(device)


@contextlib.contextmanager
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_forward_is_bitwise_direct_indexing_in_weight_dtype(dtype):
    weight = _table(dtype=dtype)
    ids = _ids((3, 5), 37)
    out = NativeEmbeddingOp().forward(ids, weight)
    assert out.dtype == dtype
    assert out.shape == (3, 5, 11)
    assert torch.equal(out, weight[ids])


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_every_integer_id_dtype_gives_the_same_rows(id_dtype):
    weight = _table(vocab=100)
    ids = _ids((4, 6), 100)
    out = NativeEmbeddingOp().forward(ids.to(id_dtype), weight)
    assert torch.equal(out, weight[ids])
    out32 = NativeEmbeddingOp().forward_fp32(ids.to(id_dtype), weight.bfloat16())
    assert torch.equal(out32, weight.bfloat16()[ids].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_fp32_returns_fp32_rows_equal_to_upcast_gather(dtype):
    weight = _table(dtype=dtype)
    ids = _ids((2, 9), 37, seed=1)
    out = NativeEmbeddingOp().forward_fp32(ids, weight)
    assert out.dtype == torch.float32
    assert torch.equal(out, weight[ids].float())


def test_forward_fp32_upcasts_in_chunks_with_same_result(monkeypatch):
    weight = _table(dtype=torch.bfloat16)
    ids = _ids((7, 13), 37, seed=2)
    # Three rows of bf16 per chunk: many chunks, one partial at the end.
    monkeypatch.setattr(emb, "_UPCAST_CHUNK_BYTES", 3 * 11 * 2)
    out = NativeEmbeddingOp().forward_fp32(ids, weight)
    assert torch.equal(out, weight[ids].float())


def test_forward_fp32_never_upcasts_the_whole_table(monkeypatch):
    weight = _table(vocab=1000, dtype=torch.bfloat16)
    ids = _ids((5,), 1000, seed=3)
    calls = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    real_float = torch.Tensor.float
    monkeypatch.setattr(
        torch.Tensor, "float", lambda self: calls.append(tuple(self.shape)) or real_float(self)
    )
    NativeEmbeddingOp().forward_fp32(ids, weight)
    assert (1000, 11) not in calls


def test_op_is_pure_inputs_unchanged_after_forward_and_backward():
    weight = _table(dtype=torch.bfloat16).requires_grad_(True)
    ids = _ids((3, 4), 37, seed=4).to(torch.int32)
    ids_before, weight_before = ids.clone(), weight.detach().clone()
    versions = (ids._version, weight._version)
    op = NativeEmbeddingOp()
    (op.forward_fp32(ids, weight).sum() + op.forward(ids, weight).float().sum()).backward()
    assert torch.equal(ids, ids_before) and ids.dtype == torch.int32
    assert torch.equal(weight.detach(), weight_before)
    assert (ids._version, weight._version) == versions


def test_gradient_reaches_only_used_rows_and_matches_reference():
    weight = _table(vocab=50, dtype=torch.float64).requires_grad_(True)
    ids = torch.tensor([[3, 7, 3, 49], [0, 7, 7, 3]])
    grad_out = torch.randn(2, 4, 11, dtype=torch.float64)
    NativeEmbeddingOp().forward(ids, weight).backward(grad_out)
    ref = weight.detach().clone().requires_grad_(True)
    emb.embedding_reference(ids, ref).backward(grad_out)
    used = torch.zeros(50, dtype=torch.bool)
    used[ids.flatten()] = True
    assert torch.equal(weight.grad[~used], torch.zeros(int((~used).sum()), 11, dtype=torch.float64))
    torch.testing.assert_close(weight.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert weight.grad.layout == torch.strided


def test_sparse_gradient_holds_only_used_rows():
    weight = _table(vocab=30).requires_grad_(True)
    ids = torch.tensor([5, 2, 5, 29, 2, 2])
    grad_out = torch.randn(6, 11)
    NativeEmbeddingOp(sparse_grad=True).forward_fp32(ids, weight).backward(grad_out)
    grad = weight.grad
    assert grad.layout == torch.sparse_coo
    # One stored row per distinct id (autograd may drop the coalesced flag when it stores .grad).
    assert grad._nnz() == 3
    assert grad.coalesce().indices().flatten().tolist() == [2, 5, 29]
    dense = weight.detach().clone().requires_grad_(True)
    NativeEmbeddingOp().forward_fp32(ids, dense).backward(grad_out)
    assert torch.equal(grad.to_dense(), dense.grad)


def test_bf16_table_gets_bf16_gradient_accumulated_in_fp32():
    weight = _table(vocab=4, dtype=torch.bfloat16).requires_grad_(True)
    ids = torch.zeros(512, dtype=torch.long)  # one row hit 512 times
    grad_out = torch.full((512, 11), 0.01, dtype=torch.float32)
    NativeEmbeddingOp().forward_fp32(ids, weight).backward(grad_out)
    assert weight.grad.dtype == torch.bfloat16
    expected = torch.tensor(512 * 0.01, dtype=torch.float32).bfloat16()
    assert torch.equal(weight.grad[0], expected.expand(11))


def test_backward_is_bitwise_reproducible_under_deterministic_algorithms():
    vocab, hidden = 64, 33
    ids = _ids((8, 257), 9, seed=5)  # only 9 distinct ids: heavy collisions
    grad_out = torch.randn(8, 257, hidden, generator=torch.Generator().manual_seed(6))
    grads = []
    with _deterministic():
        for _ in range(2):
            weight = _table(vocab=vocab, hidden=hidden, seed=7).requires_grad_(True)
            NativeEmbeddingOp().forward_fp32(ids, weight).backward(grad_out)
            grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1])
    exact = torch.zeros(vocab, hidden, dtype=torch.float64)
    exact.index_add_(0, ids.flatten(), grad_out.reshape(-1, hidden).double())
    torch.testing.assert_close(grads[0].double(), exact, rtol=1e-5, atol=1e-5)


def test_segment_sum_result_does_not_depend_on_the_order_of_rows_with_distinct_ids():
    # Sums of integers are exact in fp32, so the tree order must reproduce them exactly.
    ids = torch.tensor([4, 1, 4, 4, 0, 1, 4, 4, 4])
    rows = torch.arange(9 * 3, dtype=torch.float32).reshape(9, 3)
    unique, sums = segment_sum_rows(ids, rows)
    assert unique.tolist() == [0, 1, 4]
    expected = torch.stack([rows[ids == v].sum(0) for v in (0, 1, 4)])
    assert torch.equal(sums, expected)


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, 6), min_size=0, max_size=70),
    hidden=st.integers(1, 5),
)
def test_segment_sum_matches_float64_sums(ids, hidden):
    ids_M = torch.tensor(ids, dtype=torch.long)
    rows_MH = torch.randn(len(ids), hidden, generator=torch.Generator().manual_seed(len(ids)))
    unique, sums = segment_sum_rows(ids_M, rows_MH)
    assert unique.tolist() == sorted(set(ids))
    for u, row in zip(unique.tolist(), sums):
        torch.testing.assert_close(
            row.double(), rows_MH[ids_M == u].double().sum(0), rtol=1e-6, atol=1e-6
        )


def test_rows_of_a_sample_do_not_depend_on_the_rest_of_the_batch():
    weight = _table(vocab=80, dtype=torch.bfloat16)
    batch = _ids((6, 10), 80, seed=8)
    op = NativeEmbeddingOp()
    full = op.forward_fp32(batch, weight)
    assert torch.equal(op.forward_fp32(batch[2:3], weight), full[2:3])
    padded = torch.cat([batch[2:3, :7], torch.zeros(1, 5, dtype=torch.long)], dim=1)
    assert torch.equal(op.forward_fp32(padded, weight)[:, :7], full[2:3, :7])


def test_empty_ids_give_empty_rows_and_zero_gradient():
    weight = _table().requires_grad_(True)
    out = NativeEmbeddingOp().forward(torch.empty(0, 3, dtype=torch.int32), weight)
    assert out.shape == (0, 3, 11)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize(
    "bad,match", [(torch.tensor([1, 12, 3]), "max id 12"), (torch.tensor([-1, 2]), "min id -1")]
)
def test_out_of_range_ids_raise_value_error_naming_max_id_and_vocab(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        NativeEmbeddingOp().forward(bad, _table(vocab=10))
    assert "vocab size 10" in str(info.value)


def test_non_integer_ids_raise_value_error():
    with pytest.raises(ValueError, match="integer dtype"):
        NativeEmbeddingOp().forward(torch.tensor([1.0, 2.0]), _table())


def test_non_2d_weight_raises_value_error():
    with pytest.raises(ValueError, match="2-D"):
        NativeEmbeddingOp().forward(torch.tensor([1]), torch.zeros(4, 3, 2))


@pytest.mark.gpu
def test_real_qwen3_shape_on_gpu_gathers_boundary_ids_and_upcasts_only_rows():
    vocab, hidden = 151_936, 4_096
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, vocab - 1, 17, 0]], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = NativeEmbeddingOp().forward_fp32(ids, weight)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.equal(out, weight[ids.long()].float())
    assert extra < 64 * 1024 * 1024  # the fp32 table copy would be 2.3 GiB


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_reproducible_with_collisions():
    weight = torch.randn(1000, 256, device="cuda", requires_grad=True)
    ids = torch.randint(0, 7, (4096,), device="cuda")
    grad_out = torch.randn(4096, 256, device="cuda")
    grads = []
    with _deterministic():
        for _ in range(3):
            weight.grad = None
            NativeEmbeddingOp().forward_fp32(ids, weight).backward(grad_out)
            grads.append(weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])
