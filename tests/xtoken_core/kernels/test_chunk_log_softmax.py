"""chunk_avg_log_softmax: Triton forward/backward vs the PyTorch references (interpreted on CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.kernels import chunk_log_softmax as cls

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-5, rtol=1e-5)}
# Gradients are rounded to the logits dtype: allow one bf16 ulp.
GRAD_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def _inputs(B, T, V, C, dtype, seed, contiguous_runs=False):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 4).to(dtype)
    if contiguous_runs:  # what the aligner produces: sorted runs of ids, -1 padding at the end
        lengths = torch.randint(1, 4, (B, T), generator=gen)
        cid = torch.repeat_interleave(torch.arange(T), lengths[0])[:T].repeat(B, 1)
        cid = torch.where(cid < C, cid, torch.full_like(cid, -1))
        cid[:, -2:] = -1
    else:
        cid = torch.randint(-1, C, (B, T), generator=gen)
    cid[:, 0] = -1
    cid[cid == C // 2] = -1  # chunk C // 2 is empty everywhere
    return logits.to(DEVICE), cid.to(DEVICE)


def _run_both(logits, cid, C, temperature, grad_seed=7):
    x = logits.detach().clone().requires_grad_()
    avg, sizes = cls.chunk_avg_log_softmax(x, cid, C, temperature)
    gen = torch.Generator().manual_seed(grad_seed)
    g = torch.randn(avg.shape, generator=gen).to(DEVICE)
    (avg * g).sum().backward()
    xr = logits.detach().clone().requires_grad_()
    avg_r, sizes_r = cls.chunk_avg_log_softmax_reference(xr, cid, C, temperature)
    (avg_r * g).sum().backward()
    return (avg, sizes, x.grad), (avg_r, sizes_r, xr.grad)


SHAPES = [(1, 7, 67, 3), (2, 37, 300, 13), (2, 19, 129, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_forward_and_backward_match_reference(dtype, shape, temperature):
    B, T, V, C = shape
    logits, cid = _inputs(B, T, V, C, dtype, seed=sum(shape))
    (avg, sizes, grad), (avg_r, sizes_r, grad_r) = _run_both(logits, cid, C, temperature)
    assert avg.dtype == torch.float32 and avg.shape == (B, C, V)
    torch.testing.assert_close(sizes, sizes_r, atol=0, rtol=0)
    torch.testing.assert_close(avg, avg_r, **TOL[dtype])
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad, grad_r, **GRAD_TOL[dtype])


def test_contiguous_runs_match_reference():
    logits, cid = _inputs(2, 33, 101, 11, torch.float32, seed=3, contiguous_runs=True)
    (avg, sizes, grad), (avg_r, sizes_r, grad_r) = _run_both(logits, cid, 11, 0.8)
    torch.testing.assert_close(sizes, sizes_r, atol=0, rtol=0)
    torch.testing.assert_close(avg, avg_r, **TOL[torch.float32])
    torch.testing.assert_close(grad, grad_r, **GRAD_TOL[torch.float32])


def test_empty_chunks_give_zero_rows_and_size_zero():
    B, T, V, C = 2, 11, 70, 7
    logits, cid = _inputs(B, T, V, C, torch.float32, seed=5)
    avg, sizes = cls.chunk_avg_log_softmax(logits, cid, C)
    empty = sizes == 0
    assert bool(empty[:, C // 2].all())
    assert bool((avg[empty] == 0).all())
    assert bool((avg[~empty] < 0).all())  # log-probabilities of non-empty chunks


def test_positions_outside_every_chunk_get_zero_gradient():
    logits, cid = _inputs(2, 23, 90, 9, torch.bfloat16, seed=11)
    x = logits.clone().requires_grad_()
    avg, _ = cls.chunk_avg_log_softmax(x, cid, 9, 1.3)
    avg.sum().backward()  # an expanded (stride-0) gradient
    assert bool((x.grad[cid < 0] == 0).all())
    assert bool((x.grad[cid >= 0] != 0).any())


def test_gradient_matches_float64_autograd():
    logits, cid = _inputs(1, 17, 83, 5, torch.float32, seed=2)
    x = logits.clone().requires_grad_()
    avg, _ = cls.chunk_avg_log_softmax(x, cid, 5, 2.5)
    g = torch.randn_like(avg)
    (avg * g).sum().backward()
    x64 = logits.double().requires_grad_()
    lp = torch.log_softmax(x64 / 2.5, -1)
    onehot_BCT = (cid[:, None, :] == torch.arange(5, device=DEVICE)[None, :, None]).double()
    avg64 = torch.bmm(onehot_BCT, lp) / onehot_BCT.sum(-1, keepdim=True).clamp(min=1)
    (avg64 * g.double()).sum().backward()
    err = (x.grad.double() - x64.grad).norm() / x64.grad.norm()
    assert err < 1e-5


def test_matches_one_hot_bmm_reference_of_losses():
    reference = pytest.importorskip("xtoken_core.losses.reference")
    logits, cid = _inputs(2, 29, 150, 9, torch.float32, seed=13)
    avg, sizes = cls.chunk_avg_log_softmax(logits, cid, 9, 1.5)
    lp = torch.log_softmax(logits.float() / 1.5, -1)
    avg_r, sizes_r = reference.chunk_average_log_probs(lp, cid, 9)
    torch.testing.assert_close(sizes, sizes_r.float(), atol=0, rtol=0)
    torch.testing.assert_close(avg, avg_r, atol=2e-5, rtol=1e-5)


def test_row_strided_logits_view_matches_contiguous():
    logits, cid = _inputs(2, 13, 96, 5, torch.float32, seed=17)
    view = logits[:, :, :77]  # a teacher vocab slice: rows are strided, last dim contiguous
    x = view.clone().requires_grad_()
    (avg, sizes, grad), (avg_r, _, grad_r) = _run_both(view, cid, 5, 1.0)
    torch.testing.assert_close(avg, avg_r, **TOL[torch.float32])
    torch.testing.assert_close(grad, grad_r, **GRAD_TOL[torch.float32])
    assert x.shape == grad.shape


def test_bf16_output_dtype_is_honoured():
    logits, cid = _inputs(1, 9, 70, 4, torch.bfloat16, seed=19)
    avg, _ = cls.chunk_avg_log_softmax(logits, cid, 4, out_dtype=torch.bfloat16)
    avg_r, _ = cls.chunk_avg_log_softmax_reference(logits, cid, 4)
    assert avg.dtype == torch.bfloat16
    torch.testing.assert_close(avg.float(), avg_r, atol=5e-2, rtol=1e-2)


def test_two_runs_are_bitwise_equal():
    logits, cid = _inputs(2, 31, 130, 7, torch.bfloat16, seed=23)
    outs = [_run_both(logits, cid, 7, 1.3)[0] for _ in range(2)]
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)


def test_out_of_range_chunk_ids_raise():
    # Ids passed on the CPU are checked on the host before they move to the logits' device.
    logits = torch.randn(1, 5, 20, device=DEVICE)
    with pytest.raises(ValueError, match="num_chunks"):
        cls.chunk_avg_log_softmax(logits, torch.tensor([[0, 1, 4, -1, 0]]), 3)
    with pytest.raises(ValueError, match="num_chunks"):
        cls.chunk_avg_log_softmax(logits, torch.tensor([[0, -2, 1, 1, 0]]), 3)


@pytest.mark.gpu
def test_device_ids_out_of_range_count_as_minus_one_unless_checked(monkeypatch):
    logits = torch.randn(1, 5, 20, device="cuda")
    bad = torch.tensor([[0, 1, 4, -2, 0]], device="cuda")
    avg, sizes = cls.chunk_avg_log_softmax(logits, bad, 3)
    avg_r, sizes_r = cls.chunk_avg_log_softmax_reference(
        logits, torch.tensor([[0, 1, -1, -1, 0]], device="cuda"), 3
    )
    torch.testing.assert_close(sizes, sizes_r, atol=0, rtol=0)
    torch.testing.assert_close(avg, avg_r, **TOL[torch.float32])
    monkeypatch.setitem(cls.KERNEL_CONFIG, "check_device_ids", True)
    with pytest.raises(ValueError, match="num_chunks"):
        cls.chunk_avg_log_softmax(logits, bad, 3)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf")])
def test_non_positive_temperature_raises(temperature):
    logits = torch.randn(1, 5, 20, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        cls.chunk_avg_log_softmax(logits, torch.zeros(1, 5, dtype=torch.long), 1, temperature)


def test_mismatched_chunk_id_shape_raises():
    with pytest.raises(ValueError, match="chunk_id_BT shape"):
        cls.chunk_avg_log_softmax(torch.randn(1, 5, 20), torch.zeros(1, 4, dtype=torch.long), 2)


def test_cpu_fallback_without_interpreter_is_the_reference(no_interpreter):
    logits, cid = _inputs(1, 12, 50, 4, torch.float32, seed=29)
    x = logits.clone().requires_grad_()
    avg, sizes = cls.chunk_avg_log_softmax(x, cid, 4, 1.2)
    avg.sum().backward()
    avg_r, sizes_r = cls.chunk_avg_log_softmax_reference(logits, cid, 4, 1.2)
    assert torch.equal(avg, avg_r) and torch.equal(sizes, sizes_r)
    assert bool((x.grad[cid < 0] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_full_size_matches_reference_on_gpu(dtype):
    B, T, V, C = 2, 2048, 151936, 1640
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(B, T, V, device="cuda", generator=gen) * 4).to(dtype)
    cid = torch.sort(torch.randint(0, C, (B, T), device="cuda", generator=gen), dim=1).values
    cid[:, -100:] = -1
    (avg, sizes, grad), (avg_r, sizes_r, grad_r) = _run_both(logits, cid, C, 1.5)
    torch.testing.assert_close(sizes, sizes_r, atol=0, rtol=0)
    torch.testing.assert_close(avg, avg_r, atol=1e-4, rtol=1e-5)
    rel = (grad.double() - grad_r.double()).norm() / grad_r.double().norm()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2)
    again = _run_both(logits, cid, C, 1.5)[0]
    assert torch.equal(again[0], avg) and torch.equal(again[2], grad)


def _need_kernels():
    if not cls.use_triton(torch.empty(0, device=DEVICE)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def _assert_same_segments(cid, C):
    seg_r, order_r, offsets_r, sizes_r = cls._segments(cid, C, check=False)
    seg, order, offsets, sizes = cls._segments_device(cid, C)
    assert torch.equal(seg, seg_r)
    assert torch.equal(order, order_r)  # rows outside every chunk come last, in row order
    assert torch.equal(offsets, offsets_r)
    assert torch.equal(sizes, sizes_r.to(torch.float32))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 40),
    C=st.integers(0, 9),
    sorted_runs=st.booleans(),
    int32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_segment_kernel_equals_sort_based_segments_for_any_ids(B, T, C, sorted_runs, int32, seed):
    """Unsorted ids, -1, out-of-range ids, empty chunks: the one-launch counting sort gives the
    sort-based structure exactly (so the forward's fixed-order sums are bitwise unchanged)."""
    _need_kernels()
    gen = torch.Generator().manual_seed(seed)
    cid = torch.randint(-3, C + 3, (B, T), generator=gen)
    if sorted_runs:
        cid = cid.sort(dim=1).values
    cid = cid.to(torch.int32 if int32 else torch.long).to(DEVICE)
    _assert_same_segments(cid, C)


def test_segment_kernel_spans_several_row_blocks():
    _need_kernels()
    gen = torch.Generator().manual_seed(3)
    cid = torch.randint(-1, 6, (2, 700), generator=gen).to(DEVICE)  # R = 1400 > BLOCK_R = 1024
    _assert_same_segments(cid, 6)


def test_large_work_falls_back_to_sort_based_segments(monkeypatch):
    _need_kernels()
    monkeypatch.setattr(cls, "SEGMENTS_KERNEL_MAX_WORK", 0)
    cid = torch.tensor([[2, -1, 0, 2, 5]], device=DEVICE)
    seg, order, offsets, sizes = cls._segments_device(cid, 3)
    assert seg.tolist() == [2, -1, 0, 2, -1]
    assert offsets.tolist() == [0, 1, 1, 3]
    assert order[:3].tolist() == [2, 0, 3]
    assert sizes.dtype == torch.float32 and sizes.tolist() == [1.0, 0.0, 2.0]


def test_segment_building_dispatches_no_torch_compute_op():
    """The segment structure is one Triton launch: only allocations and views go through
    torch (the interpreter's own host copies are not counted)."""
    _need_kernels()
    from torch.utils._python_dispatch import TorchDispatchMode

    allowed = {"empty", "slice", "new_empty", "set_", "copy_", "view"}

    class _Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cid = torch.tensor([[0, 0, 1, -1], [1, 2, 2, -1]], device=DEVICE)
    with _Ops() as ops:
        cls._segments_device(cid, 3)
    assert ops.names and set(ops.names) <= allowed, ops.names
    with _Ops() as ops:
        cls._segments(cid, 3, check=False)
    assert {"sort", "searchsorted"} <= set(ops.names)  # what the launch replaces
