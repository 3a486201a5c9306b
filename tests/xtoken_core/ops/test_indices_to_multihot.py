"""fused_indices_to_multihot: Triton kernels vs the PyTorch reference, forward and backward."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xtoken_core.ops import indices_to_multihot as fi

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter_on_cpu():
    """Run the Triton kernels in the interpreter when there is no GPU (restored afterwards)."""
    if DEVICE == "cuda":
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


def _routing(
    n, k, e, *, seed, index_dtype=torch.int64, probs_dtype=torch.float32, low=-1, high=None
):
    gen = torch.Generator().manual_seed(seed)
    high = e + 2 if high is None else high
    indices = torch.randint(low, high, (n, k), generator=gen).to(index_dtype)
    probs = torch.rand(n, k, generator=gen).to(probs_dtype)
    return indices.to(DEVICE), probs.to(DEVICE)


def _reference_grad(indices, probs, e, grad_probs_NE):
    leaf = probs.detach().clone().requires_grad_(True)
    _, probs_NE, _ = fi.indices_to_multihot_reference(indices, leaf, e)
    (grad,) = torch.autograd.grad(probs_NE, leaf, grad_probs_NE)
    return grad


def _triton_grad(indices, probs, e, grad_probs_NE):
    leaf = probs.detach().clone().requires_grad_(True)
    _, probs_NE = fi.IndicesToMultihot.apply(indices, leaf, e)
    (grad,) = torch.autograd.grad(probs_NE, leaf, grad_probs_NE)
    return grad


def _assert_matches_reference(indices, probs, e, *, seed=0):
    ref = fi.indices_to_multihot_reference(indices, probs, e)
    out = fi.indices_to_multihot_forward(indices, probs, e)
    for name, r, o in zip(("multihot", "probs", "position"), ref, out):
        assert o.dtype == r.dtype, name
        assert o.shape == r.shape, name
        # A copy of values: bitwise equal, whatever the dtype.
        assert torch.equal(o, r), f"{name} differs from the reference"
    gen = torch.Generator().manual_seed(seed + 1)
    grad_probs_NE = torch.randn(indices.shape[0], e, generator=gen).to(probs.dtype).to(DEVICE)
    grad_ref = _reference_grad(indices, probs, e, grad_probs_NE)
    grad_tri = _triton_grad(indices, probs, e, grad_probs_NE)
    assert grad_tri.dtype == probs.dtype
    assert torch.equal(grad_tri, grad_ref)


def test_documented_example_converts_indices_and_probs():
    indices = torch.tensor([[0, 1], [1, 2]], device=DEVICE)
    probs = torch.tensor([[0.1, 0.2], [0.3, 0.4]], device=DEVICE)
    multihot, probs_NE, position = fi.indices_to_multihot_forward(indices, probs, 4)
    assert multihot.tolist() == [[True, True, False, False], [False, True, True, False]]
    assert torch.equal(
        probs_NE, torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.0, 0.3, 0.4, 0.0]], device=DEVICE)
    )
    assert position.tolist() == [[0, 1, -1, -1], [-1, 0, 1, -1]]


def test_documented_backward_example_gathers_grad_to_slots():
    indices = torch.tensor([[0, 1], [1, 2]], device=DEVICE)
    _, _, position = fi.indices_to_multihot_forward(indices, torch.ones(2, 2, device=DEVICE), 4)
    grad_NE = torch.tensor([[0.7, 0.8, 0.0, 0.0], [0.0, 0.1, 0.9, 0.0]], device=DEVICE)
    grad_NK = fi.indices_to_multihot_backward(grad_NE, indices, position)
    assert torch.equal(grad_NK, torch.tensor([[0.7, 0.8], [0.1, 0.9]], device=DEVICE))


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "n,k,e",
    [(1, 1, 1), (7, 1, 5), (33, 3, 7), (19, 6, 130), (64, 8, 256), (5, 2, 1)],
)
def test_kernel_matches_reference_over_dtype_and_shape_grid(n, k, e, index_dtype, probs_dtype):
    indices, probs = _routing(
        n, k, e, seed=n * 1000 + k * 10 + e, index_dtype=index_dtype, probs_dtype=probs_dtype
    )
    _assert_matches_reference(indices, probs, e)


def test_k1_routes_each_token_to_one_expert():
    indices = torch.tensor([[2], [0], [-1], [5]], device=DEVICE)
    probs = torch.tensor([[0.5], [0.25], [0.75], [1.0]], device=DEVICE)
    multihot, probs_NE, _ = fi.indices_to_multihot_forward(indices, probs, 3)
    assert multihot.sum(dim=1).tolist() == [1, 1, 0, 0]
    assert probs_NE.tolist() == [[0, 0, 0.5], [0.25, 0, 0], [0, 0, 0], [0, 0, 0]]
    _assert_matches_reference(indices, probs, 3)


def test_single_local_expert_keeps_only_index_zero():
    indices = torch.tensor([[0, 3], [1, 0], [-1, 2]], device=DEVICE)
    probs = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], device=DEVICE)
    multihot, probs_NE, position = fi.indices_to_multihot_forward(indices, probs, 1)
    assert multihot.tolist() == [[True], [True], [False]]
    assert torch.equal(probs_NE, torch.tensor([[0.1], [0.4], [0.0]], device=DEVICE))
    assert position.tolist() == [[0], [1], [-1]]


def test_empty_input_gives_empty_outputs_and_gradient():
    indices = torch.empty(0, 4, dtype=torch.long, device=DEVICE)
    probs = torch.empty(0, 4, device=DEVICE, requires_grad=True)
    multihot, probs_NE = fi.IndicesToMultihot.apply(indices, probs, 6)
    assert multihot.shape == (0, 6) and multihot.dtype == torch.bool
    assert probs_NE.shape == (0, 6)
    probs_NE.sum().backward()
    assert probs.grad.shape == (0, 4)


def test_all_indices_minus_one_route_nothing_and_get_zero_grad():
    indices = torch.full((9, 3), -1, device=DEVICE)
    probs = torch.rand(9, 3, device=DEVICE, requires_grad=True)
    multihot, probs_NE = fi.IndicesToMultihot.apply(indices, probs, 5)
    assert not multihot.any()
    assert torch.equal(probs_NE, torch.zeros(9, 5, device=DEVICE))
    (probs_NE * torch.rand(9, 5, device=DEVICE)).sum().backward()
    assert torch.equal(probs.grad, torch.zeros(9, 3, device=DEVICE))


def test_indices_at_or_past_num_experts_are_not_local():
    indices = torch.tensor([[4, 1, 7], [0, 4, 100]], device=DEVICE)
    probs = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.5, 0.6]], device=DEVICE, requires_grad=True)
    multihot, probs_NE = fi.IndicesToMultihot.apply(indices, probs, 4)
    assert multihot.tolist() == [[False, True, False, False], [True, False, False, False]]
    probs_NE.sum().backward()
    assert probs.grad.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_duplicate_expert_in_a_row_first_slot_wins_value_and_gradient():
    indices = torch.tensor([[2, 2, 0], [1, 3, 1]], device=DEVICE)
    probs = torch.tensor([[0.3, 0.6, 0.1], [0.2, 0.5, 0.7]], device=DEVICE)
    multihot, probs_NE, position = fi.indices_to_multihot_forward(indices, probs, 4)
    assert position.tolist() == [[2, -1, 0, -1], [-1, 0, -1, 1]]
    assert torch.equal(probs_NE[0], torch.tensor([0.1, 0.0, 0.3, 0.0], device=DEVICE))
    assert torch.equal(probs_NE[1], torch.tensor([0.0, 0.2, 0.0, 0.5], device=DEVICE))
    grad = _triton_grad(indices, probs, 4, torch.ones(2, 4, device=DEVICE))
    assert grad.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    _assert_matches_reference(indices, probs, 4)


def test_gradient_is_none_safe_when_only_multihot_is_used():
    indices, probs = _routing(6, 2, 3, seed=3)
    probs.requires_grad_(True)
    multihot, probs_NE = fi.IndicesToMultihot.apply(indices, probs, 3)
    (probs_NE.sum() * 0 + multihot.float().sum() * 0).backward()
    assert torch.equal(probs.grad, torch.zeros_like(probs))


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(0, 40),
    k=st.integers(1, 9),
    e=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_on_random_routing(n, k, e, seed):
    indices, probs = _routing(n, k, e, seed=seed, low=-3, high=e + 3)
    _assert_matches_reference(indices, probs, e, seed=seed)


def test_public_function_matches_reference_and_its_gradient():
    indices, probs = _routing(23, 4, 9, seed=11)
    leaf = probs.clone().requires_grad_(True)
    multihot, probs_NE = fi.fused_indices_to_multihot(indices, leaf, 9)
    ref_multihot, ref_probs, _ = fi.indices_to_multihot_reference(indices, probs, 9)
    assert torch.equal(multihot, ref_multihot)
    assert torch.equal(probs_NE, ref_probs)
    grad_NE = torch.randn(23, 9, device=DEVICE)
    (grad,) = torch.autograd.grad(probs_NE, leaf, grad_NE)
    assert torch.equal(grad, _reference_grad(indices, probs, 9, grad_NE))


def test_registry_ops_agree():
    indices, probs = _routing(11, 3, 6, seed=5)
    torch_out = fi.TorchIndicesToMultihotOp()(indices, probs, 6)
    triton_out = fi.TritonIndicesToMultihotOp()(indices, probs, 6)
    assert all(torch.equal(a, b) for a, b in zip(torch_out, triton_out))


@pytest.mark.parametrize(
    "indices,probs,e,match",
    [
        (torch.zeros(3, dtype=torch.long), torch.zeros(3), 4, "2-D"),
        (torch.zeros(3, 2), torch.zeros(3, 2), 4, "integer dtype"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3), 4, "must equal indices shape"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), 4, "floating"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), 0, ">= 1, got 0"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), 2.0, "must be an int"),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(indices, probs, e, match):
    with pytest.raises(ValueError, match=match):
        fi.fused_indices_to_multihot(indices, probs, e)
    with pytest.raises(ValueError, match=match):
        fi.indices_to_multihot_forward(indices, probs, e)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,e", [(4096, 2, 8), (65536, 8, 256), (3001, 7, 97)])
def test_kernel_matches_reference_at_full_size_on_gpu(n, k, e):
    indices, probs = _routing(n, k, e, seed=n + k + e)
    _assert_matches_reference(indices, probs, e)


@pytest.mark.gpu
def test_public_function_takes_the_triton_path_on_gpu():
    indices, probs = _routing(128, 2, 8, seed=1)
    probs.requires_grad_(True)
    _, probs_NE = fi.fused_indices_to_multihot(indices, probs, 8)
    assert probs_NE.grad_fn is not None and "IndicesToMultihot" in type(probs_NE.grad_fn).__name__
