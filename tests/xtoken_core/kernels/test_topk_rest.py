"""A row's log-partition and the log of its mass outside the top K in one pass
(xtoken_core.kernels.topk_rest), against float64 sums, on small shapes; interpreted on a CPU; and
the top-K encode that uses it against the encode through PyTorch ops."""

import pytest
import torch

from tests.xtoken_core.kernels.conftest import DEVICE
from xtoken_core.kernels.topk_rest import row_lse_rest
from xtoken_core.wire.topk import encode_topk

pytest.importorskip("triton")


def _want(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the log-sum-exp of the row and of the row without its top-k ids."""
    z64 = z.double().cpu()
    lse = torch.logsumexp(z64, -1)
    idx = torch.topk(z64, k, -1).indices
    rest = torch.logsumexp(z64.scatter(-1, idx, float("-inf")), -1) - lse
    return lse, rest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("W", "k"), [(37, 1), (37, 8), (5000, 32)])  # one block, several
def test_the_log_partition_and_the_rest_equal_float64_sums(dtype, W, k):
    gen = torch.Generator().manual_seed(W + k)
    z = (torch.randn(6, W, generator=gen) * 4).to(dtype).to(DEVICE)
    top = torch.topk(z, k, -1).values
    lse, rest = row_lse_rest(z, top)
    want_lse, want_rest = _want(z, k)
    assert lse.dtype == rest.dtype == torch.float32
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=2e-5)
    torch.testing.assert_close(rest.cpu().double(), want_rest, rtol=0, atol=2e-4)


def test_ties_at_the_kth_value_left_out_of_the_top_k_count_in_the_rest():
    # bf16 rows with many equal values: the K-th value is shared by ids inside and outside
    z = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, -2.0], [2.0, 2.0, 2.0, 0.5, 0.5, 0.5]])
    z = z.to(torch.bfloat16).to(DEVICE)
    for k in (1, 2, 3, 4):
        lse, rest = row_lse_rest(z, torch.topk(z, k, -1).values)
        want_lse, want_rest = _want(z, k)
        torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=1e-5)
        torch.testing.assert_close(rest.cpu().double(), want_rest, rtol=0, atol=1e-5)


def test_the_rest_stays_exact_when_the_top_k_hold_nearly_all_the_mass():
    z = torch.full((2, 300), -40.0)
    z[:, :4] = torch.tensor([10.0, 9.0, 8.0, 7.0])
    lse, rest = row_lse_rest(z.to(DEVICE), torch.topk(z, 4, -1).values.to(DEVICE))
    _, want_rest = _want(z, 4)
    assert float(want_rest[0]) < -40  # ~1e-22 of the mass: log(1 - sum p) would give 0 or -inf
    torch.testing.assert_close(rest.cpu().double(), want_rest, rtol=1e-5, atol=0)


def test_no_mass_outside_the_top_k_is_minus_infinity():
    z = torch.tensor([[5.0, 4.0, float("-inf"), float("-inf")], [1.0, 2.0, 3.0, 4.0]]).to(DEVICE)
    lse, rest = row_lse_rest(z, torch.topk(z, 2, -1).values)
    assert float(rest[0]) == float("-inf") and torch.isfinite(lse).all()
    _, rest_all = row_lse_rest(z, torch.topk(z, 4, -1).values)  # K covers the row
    assert float(rest_all[1]) == float("-inf")
    nothing = torch.full((1, 5), float("-inf"), device=DEVICE)  # a vocab slice all masked
    lse, rest = row_lse_rest(nothing, torch.topk(nothing, 2, -1).values)
    assert float(lse[0]) == float(rest[0]) == float("-inf")


@pytest.mark.usefixtures("no_interpreter")
def test_the_cpu_reference_path_equals_float64_sums_too():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 300, generator=gen) * 4
    z[0, 5:] = float("-inf")  # no rest
    lse, rest = row_lse_rest(z, torch.topk(z, 5, -1).values)
    want_lse, want_rest = _want(z, 5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    torch.testing.assert_close(rest.double(), want_rest, rtol=0, atol=2e-4)


def test_rows_and_top_values_that_do_not_pair_up_are_refused():
    z = torch.zeros(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits \[n, W\] and their top values"):
        row_lse_rest(z, torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="K=11"):
        row_lse_rest(z, torch.zeros(3, 11, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_encode_through_the_kernel_equals_the_encode_through_torch_ops(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(2, 5, 300, generator=gen) * 3).to(dtype).to(DEVICE)
    fused = encode_topk(z, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the PyTorch path, on a CPU
    if torch.cuda.is_available():
        pytest.skip("the PyTorch path is only taken without CUDA")
    plain = encode_topk(z, 16)
    assert torch.equal(fused.ids_NK, plain.ids_NK)
    for a, b in zip(fused[1:], plain[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.gpu
def test_a_teacher_sized_block_matches_float64_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(256, 129_280, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    top = torch.topk(z, 64, -1).values
    lse, rest = row_lse_rest(z, top)
    want_lse, want_rest = _want(z, 64)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(rest.cpu().double(), want_rest, rtol=0, atol=1e-3)
