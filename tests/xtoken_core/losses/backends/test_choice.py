"""The backend a loss chooses once, where it is built, and the one each call takes."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.backends.cpu import CpuBackend
from xtoken_core.losses.backends.kernel import KernelBackend
from xtoken_core.losses.backends.reference import ReferenceBackend


def _loss(**overrides) -> CrossTokenizerLoss:
    return CrossTokenizerLoss(CrossTokenizerLossConfig(projection=make_projection(), **overrides))


def _backend(fn: CrossTokenizerLoss, zs: torch.Tensor, zt: torch.Tensor):
    return fn.backend_for(zs, [zt])


def test_the_reference_backend_takes_fp64_calls_and_backend_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, zt = make_logits(0)  # float64
    for setting in ("kernel", "auto"):
        assert type(_backend(_loss(backend=setting), zs.detach(), zt)) is ReferenceBackend
    zs32, zt32 = zs.detach().float(), zt.float()
    assert type(_backend(_loss(backend="reference"), zs32, zt32)) is ReferenceBackend


def test_auto_without_cuda_takes_the_cpu_path_for_cpu_logits():
    if torch.cuda.is_available():
        pytest.skip("auto takes the kernels where CUDA is available")
    zs, zt = make_logits(0)
    fn = _loss(backend="auto")
    assert isinstance(fn.backend, CpuBackend)
    assert isinstance(_backend(fn, zs.detach().float(), zt.to(torch.bfloat16)), CpuBackend)


def test_the_kernel_backend_takes_fp32_where_triton_runs(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, zt = make_logits(0)
    fn = _loss(backend="kernel")
    assert isinstance(_backend(fn, zs.detach().float(), zt.float()), KernelBackend)


def test_the_backend_is_chosen_once_from_the_setting_and_the_machine():
    pytest.importorskip("triton")
    assert isinstance(_loss(backend="reference").backend, ReferenceBackend)
    assert isinstance(_loss(backend="kernel").backend, KernelBackend)  # CUDA or the interpreter
    on_cuda = KernelBackend if torch.cuda.is_available() else CpuBackend
    assert isinstance(_loss(backend="auto").backend, on_cuda)
