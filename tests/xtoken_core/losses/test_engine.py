"""The engine seam: the engine a loss chooses once, and the one each call takes."""

from __future__ import annotations

import pytest
import torch

from tests.xtoken_core.losses.test_loss import make_logits, make_projection
from xtoken_core.losses import CrossTokenizerLoss, CrossTokenizerLossConfig
from xtoken_core.losses.engine import ReferenceEngine
from xtoken_core.losses.kernel_engine import KernelEngine


def _loss(**overrides) -> CrossTokenizerLoss:
    return CrossTokenizerLoss(CrossTokenizerLossConfig(projection=make_projection(), **overrides))


def _engine(fn: CrossTokenizerLoss, zs: torch.Tensor, zt: torch.Tensor):
    return fn.engine_for(zs, [zt])


def test_the_reference_engine_takes_fp64_and_cpu_calls(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    zs, zt = make_logits(0)  # float64
    assert isinstance(_engine(_loss(backend="kernel"), zs, zt), ReferenceEngine)
    zs32, zt32 = zs.detach().float(), zt.float()
    assert isinstance(_engine(_loss(backend="auto"), zs32, zt32), ReferenceEngine)  # no CUDA
    assert isinstance(_engine(_loss(backend="reference"), zs32, zt32), ReferenceEngine)


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
    on_cuda = KernelEngine if torch.cuda.is_available() else ReferenceEngine
    assert isinstance(_loss(backend="auto").engine, on_cuda)
