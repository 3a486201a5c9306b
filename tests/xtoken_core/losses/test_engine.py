"""The engine seam: the engine a loss chooses once, and the one each call takes."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.cpu_engine import CpuEngine
from xtoken_core.losses.engine import ReferenceEngine
from xtoken_core.losses.kernel_engine import KernelEngine


def _loss(**overrides) -> CrossTokenizerLoss:
    return CrossTokenizerLoss(CrossTokenizerLossConfig(projection=make_projection(), **overrides))


def _engine(fn: CrossTokenizerLoss, zs: torch.Tensor, zt: torch.Tensor):
    return fn.engine_for(zs, [zt])


def test_the_reference_engine_takes_fp64_calls_and_backend_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, zt = make_logits(0)  # float64
    for backend in ("kernel", "auto"):
        engine = _engine(_loss(backend=backend), zs.detach(), zt)
        assert type(engine) is ReferenceEngine
    zs32, zt32 = zs.detach().float(), zt.float()
    assert type(_engine(_loss(backend="reference"), zs32, zt32)) is ReferenceEngine


def test_auto_without_cuda_takes_the_cpu_path_for_cpu_logits():
    if torch.cuda.is_available():
        pytest.skip("auto takes the kernels where CUDA is available")
    zs, zt = make_logits(0)
    fn = _loss(backend="auto")
    assert isinstance(fn.engine, CpuEngine)
    assert isinstance(_engine(fn, zs.detach().float(), zt.to(torch.bfloat16)), CpuEngine)


def test_the_kernel_engine_takes_fp32_where_triton_runs(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, zt = make_logits(0)
    fn = _loss(backend="kernel")
    assert isinstance(_engine(fn, zs.detach().float(), zt.float()), KernelEngine)


def test_the_engine_is_chosen_once_from_the_backend_and_the_machine():
    pytest.importorskip("triton")
    assert isinstance(_loss(backend="reference").engine, ReferenceEngine)
    assert isinstance(_loss(backend="kernel").engine, KernelEngine)  # CUDA or the interpreter
    on_cuda = KernelEngine if torch.cuda.is_available() else CpuEngine
    assert isinstance(_loss(backend="auto").engine, on_cuda)
