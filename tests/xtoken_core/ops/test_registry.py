"""Op registry: priority lists, lazy loading, fall-through on failing backends, describe."""

from __future__ import annotations

import logging

import pytest
import torch

from xtoken_core.ops import registry as reg
from xtoken_core.ops.embedding import NativeEmbeddingOp
from xtoken_core.ops.registry import OpBackend, OpRegistry, OpUnavailableError

MISSING_MODULE_TARGET = "xtoken_no_such_backend_module_for_tests:FastOp"


class _Working:
    def __init__(self, name):
        self.name = name


def _raise_at_construct():
    raise RuntimeError("no device for this backend")


def _registry_with(*backends_and_targets, order):
    registry = OpRegistry()
    for backend, target in backends_and_targets:
        registry.register("demo", backend, target)
    registry.set_priority("demo", "cpu", order)
    return registry


def test_default_registry_on_cpu_picks_torch_for_every_builtin_op():
    registry = reg.build_default_registry()
    chosen = registry.chosen_backends("cpu")
    assert chosen == {"embedding": OpBackend.TORCH, "fused_indices_to_multihot": OpBackend.TORCH}
    assert isinstance(registry.get("embedding", "cpu"), NativeEmbeddingOp)


def test_cuda_priority_prefers_triton_for_fused_indices_when_triton_imports():
    pytest.importorskip("triton")
    registry = reg.build_default_registry()
    assert registry.chosen_backends("cuda")["fused_indices_to_multihot"] == OpBackend.TRITON
    assert registry.chosen_backends("rocm")["embedding"] == OpBackend.TORCH


def test_get_returns_the_same_cached_instance():
    registry = reg.build_default_registry()
    assert registry.get("embedding", "cpu") is registry.get("embedding", "cpu")


def test_backend_that_fails_to_import_falls_through_to_the_next(caplog):
    registry = _registry_with(
        (OpBackend.CUDA, MISSING_MODULE_TARGET),
        (OpBackend.TORCH, lambda: _Working("torch")),
        order=[OpBackend.CUDA, OpBackend.TORCH],
    )
    with caplog.at_level(logging.WARNING, logger=reg.__name__):
        op = registry.get("demo", "cpu")
    assert op.name == "torch"
    resolution = registry.resolve("demo", "cpu")
    assert resolution.backend == OpBackend.TORCH
    assert resolution.skipped[0].backend == OpBackend.CUDA
    assert "ModuleNotFoundError" in resolution.skipped[0].reason
    assert any("falling through" in r.getMessage() for r in caplog.records)


def test_backend_that_raises_at_construction_falls_through():
    registry = _registry_with(
        (OpBackend.TRITON, _raise_at_construct),
        (OpBackend.TORCH, lambda: _Working("torch")),
        order=[OpBackend.TRITON, OpBackend.TORCH],
    )
    assert registry.get("demo", "cpu").name == "torch"
    assert "no device for this backend" in registry.resolve("demo", "cpu").skipped[0].reason


def test_fall_through_is_logged_once_per_op_backend_and_platform(caplog):
    registry = _registry_with(
        (OpBackend.CUDA, MISSING_MODULE_TARGET),
        (OpBackend.TORCH, lambda: _Working("torch")),
        order=[OpBackend.CUDA, OpBackend.TORCH],
    )
    with caplog.at_level(logging.WARNING, logger=reg.__name__):
        registry.get("demo", "cpu")
        # Re-registering forgets the cached choice, so resolution runs again.
        registry.register("demo", OpBackend.TORCH, lambda: _Working("torch2"))
        assert registry.get("demo", "cpu").name == "torch2"
    warnings = [r for r in caplog.records if "falling through" in r.getMessage()]
    assert len(warnings) == 1


def test_first_working_backend_in_priority_order_wins():
    registry = _registry_with(
        (OpBackend.TRITON, lambda: _Working("triton")),
        (OpBackend.TORCH, lambda: _Working("torch")),
        order=[OpBackend.TORCH, OpBackend.TRITON],
    )
    assert registry.get("demo", "cpu").name == "torch"
    registry.set_priority("demo", "cpu", [OpBackend.TRITON, OpBackend.TORCH])
    assert registry.get("demo", "cpu").name == "triton"


def test_backends_are_constructed_lazily_on_first_get():
    constructed = []
    registry = _registry_with(
        (OpBackend.TORCH, lambda: constructed.append("torch") or _Working("torch")),
        order=[OpBackend.TORCH],
    )
    assert constructed == []
    registry.get("demo", "cpu")
    registry.get("demo", "cpu")
    assert constructed == ["torch"]


def test_unlisted_priority_is_skipped_as_not_registered():
    registry = _registry_with(
        (OpBackend.TORCH, lambda: _Working("torch")), order=[OpBackend.HIP, OpBackend.TORCH]
    )
    resolution = registry.resolve("demo", "cpu")
    assert resolution.backend == OpBackend.TORCH
    assert [(s.backend, s.reason) for s in resolution.skipped] == [
        (OpBackend.HIP, "not registered")
    ]


def test_no_usable_backend_raises_with_every_reason():
    registry = _registry_with(
        (OpBackend.CUDA, MISSING_MODULE_TARGET),
        (OpBackend.TRITON, _raise_at_construct),
        order=[OpBackend.CUDA, OpBackend.TRITON],
    )
    with pytest.raises(OpUnavailableError, match="cuda: ModuleNotFoundError") as info:
        registry.get("demo", "cpu")
    assert "triton: RuntimeError: no device" in str(info.value)
    assert registry.chosen_backends("cpu") == {"demo": None}


def test_describe_lists_the_chosen_and_skipped_backends():
    registry = reg.build_default_registry()
    registry.register("embedding", OpBackend.CUDA, MISSING_MODULE_TARGET)
    registry.set_priority("embedding", "cpu", [OpBackend.CUDA, OpBackend.TORCH])
    text = registry.describe("cpu")
    assert "platform cpu" in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "-> torch" in lines["embedding"]
    assert "skipped: cuda (ModuleNotFoundError" in lines["embedding"]
    assert "-> torch" in lines["fused_indices_to_multihot"]


def test_unknown_op_platform_backend_and_target_raise_value_error():
    registry = reg.build_default_registry()
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        registry.get("nope", "cpu")
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        registry.get("embedding", "tpu")
    with pytest.raises(ValueError, match="unknown backend 'mlx'"):
        registry.register("embedding", "mlx", "a.b:C")
    registry.register("demo", OpBackend.TORCH, "no_colon_here")
    registry.set_priority("demo", "cpu", [OpBackend.TORCH])
    assert "package.module:Attr" in registry.resolve("demo", "cpu").skipped[0].reason


def test_registered_fused_indices_op_converts_the_documented_example():
    op = reg.build_default_registry().get("fused_indices_to_multihot", "cpu")
    multihot, probs = op(torch.tensor([[0, 1], [1, 2]]), torch.tensor([[0.1, 0.2], [0.3, 0.4]]), 4)
    assert multihot.tolist() == [[True, True, False, False], [False, True, True, False]]
    assert torch.equal(probs, torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.0, 0.3, 0.4, 0.0]]))


def test_module_level_helpers_use_the_process_registry():
    platform = reg.current_platform()
    assert platform in reg.PLATFORMS
    assert set(reg.chosen_backends()) == {"embedding", "fused_indices_to_multihot"}
    assert reg.get_op("embedding") is reg.REGISTRY.get("embedding", platform)
    assert f"platform {platform}" in reg.describe()
