"""Ops with swappable backends: the registry and the native embedding op."""

from xtoken_core.ops.embedding import NativeEmbeddingOp
from xtoken_core.ops.registry import (
    REGISTRY,
    OpBackend,
    OpRegistry,
    OpUnavailableError,
    chosen_backends,
    describe,
    get_op,
)

__all__ = [
    "REGISTRY",
    "NativeEmbeddingOp",
    "OpBackend",
    "OpRegistry",
    "OpUnavailableError",
    "chosen_backends",
    "describe",
    "get_op",
]
