"""Op registry: per-platform backend priority lists, lazy backend imports, fall-through.

An op (``"embedding"``, ``"fused_indices_to_multihot"``) has one implementation per backend
(:class:`OpBackend`), each named by a lazy target ``"package.module:Attr"`` (imported only when the
op is first asked for) or by a zero-argument factory. Each platform (``cuda``, ``rocm``, ``cpu``)
has a priority list per op. :meth:`OpRegistry.get` walks that list: a backend that is not
registered, fails to import, or raises while being constructed is skipped (logged once, reason
kept) and the next one is tried. The first that constructs is cached and returned;
:meth:`OpRegistry.describe` and :meth:`OpRegistry.chosen_backends` say what was chosen and why the
others were skipped.
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PRIORITIES",
    "PLATFORMS",
    "REGISTRY",
    "BackendSkip",
    "OpBackend",
    "OpRegistry",
    "OpUnavailableError",
    "Resolution",
    "build_default_registry",
    "chosen_backends",
    "current_platform",
    "describe",
    "get_op",
]

PLATFORMS = ("cuda", "rocm", "cpu")


class OpBackend(enum.StrEnum):
    """Families of op implementations, from most specialised to the always-there fallback."""

    CUDA = "cuda"  # a compiled CUDA C++ extension
    HIP = "hip"  # a compiled ROCm/HIP extension
    TRITON = "triton"  # Triton kernels (CUDA and ROCm)
    TORCH = "torch"  # native PyTorch ops: the reference, on every platform


class OpUnavailableError(RuntimeError):
    """No backend of an op's priority list could be imported and constructed (not retryable)."""


@dataclass(frozen=True)
class BackendSkip:
    """A backend that was passed over, and why."""

    backend: OpBackend
    reason: str


@dataclass
class Resolution:
    """The outcome of resolving one op on one platform."""

    op: str
    platform: str
    backend: OpBackend | None
    instance: object | None
    skipped: list[BackendSkip] = field(default_factory=list)


Target = str | Callable[[], object]


def current_platform() -> str:
    """The platform of the default device: ``"rocm"``, ``"cuda"`` or ``"cpu"``.

    Returns:
        One of :data:`PLATFORMS`.
    """
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def _load(target: Target) -> object:
    """Import a ``"module:Attr"`` target (or take a factory) and construct it with no arguments."""
    if callable(target):
        return target()
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"backend target {target!r} must look like 'package.module:Attr'")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory()


class OpRegistry:
    """Maps op names to backend implementations and per-platform priority lists.

    Thread-safe; each (op, platform) is resolved once and cached.
    """

    def __init__(self) -> None:
        self._targets: dict[str, dict[OpBackend, Target]] = {}
        self._priorities: dict[str, dict[str, tuple[OpBackend, ...]]] = {}
        self._resolved: dict[tuple[str, str], Resolution] = {}
        self._warned: set[tuple[str, str, OpBackend]] = set()
        self._lock = threading.RLock()

    def register(self, op: str, backend: OpBackend, target: Target) -> None:
        """Register one backend implementation of an op.

        Args:
            op: op name, e.g. ``"embedding"``.
            backend: the backend family it belongs to.
            target: ``"package.module:Attr"`` imported lazily, or a zero-argument factory; the
                result of calling ``Attr()`` is the op instance.

        Raises:
            ValueError: when ``backend`` is not an :class:`OpBackend`.
        """
        backend = self._as_backend(backend)
        with self._lock:
            self._targets.setdefault(op, {})[backend] = target
            self._forget(op)

    def set_priority(self, op: str, platform: str, backends: Iterable[OpBackend]) -> None:
        """Set the order in which an op's backends are tried on a platform.

        Args:
            op: op name.
            platform: one of :data:`PLATFORMS`.
            backends: most preferred first.

        Raises:
            ValueError: on an unknown platform or backend.
        """
        self._check_platform(platform)
        order = tuple(self._as_backend(b) for b in backends)
        with self._lock:
            self._priorities.setdefault(op, {})[platform] = order
            self._forget(op)

    def ops(self) -> list[str]:
        """Names of every op that has a backend or a priority list, sorted."""
        with self._lock:
            return sorted(set(self._targets) | set(self._priorities))

    def resolve(self, op: str, platform: str | None = None) -> Resolution:
        """Resolve an op on a platform (cached), without raising when nothing is usable.

        Args:
            op: op name.
            platform: one of :data:`PLATFORMS`; default :func:`current_platform`.

        Returns:
            The :class:`Resolution`; ``backend`` is None when every candidate was skipped.

        Raises:
            ValueError: on an unknown op or platform.
        """
        platform = current_platform() if platform is None else platform
        self._check_platform(platform)
        with self._lock:
            if op not in self._targets and op not in self._priorities:
                raise ValueError(f"unknown op {op!r}; registered ops: {self.ops()}")
            key = (op, platform)
            if key not in self._resolved:
                self._resolved[key] = self._resolve_uncached(op, platform)
            return self._resolved[key]

    def get(self, op: str, platform: str | None = None) -> object:
        """The op instance of the first usable backend in the platform's priority list.

        Args:
            op: op name.
            platform: one of :data:`PLATFORMS`; default :func:`current_platform`.

        Returns:
            The constructed op (cached: the same object on every call).

        Raises:
            ValueError: on an unknown op or platform.
            OpUnavailableError: when no backend in the list could be used (lists the reasons).
        """
        resolution = self.resolve(op, platform)
        if resolution.backend is None:
            reasons = "; ".join(f"{s.backend.value}: {s.reason}" for s in resolution.skipped)
            raise OpUnavailableError(
                f"no usable backend for op {op!r} on {resolution.platform} "
                f"(tried: {reasons or 'none listed'}); install a backend or add "
                f"OpBackend.TORCH to its priority list"
            )
        return resolution.instance

    def chosen_backends(self, platform: str | None = None) -> dict[str, OpBackend | None]:
        """Resolve every op and say which backend each got (None: nothing usable).

        Args:
            platform: one of :data:`PLATFORMS`; default :func:`current_platform`.

        Returns:
            ``{op name: chosen OpBackend or None}``.
        """
        return {op: self.resolve(op, platform).backend for op in self.ops()}

    def describe(self, platform: str | None = None) -> str:
        """A small table: per op, the chosen backend and the skipped ones with their reasons.

        Args:
            platform: one of :data:`PLATFORMS`; default :func:`current_platform`.

        Returns:
            Multi-line text, one line per op.
        """
        platform = current_platform() if platform is None else platform
        lines = [f"op registry, platform {platform}:"]
        for op in self.ops():
            res = self.resolve(op, platform)
            chosen = res.backend.value if res.backend is not None else "NONE"
            line = f"  {op:<28} -> {chosen}"
            if res.skipped:
                skipped = ", ".join(f"{s.backend.value} ({s.reason})" for s in res.skipped)
                line += f"   skipped: {skipped}"
            lines.append(line)
        return "\n".join(lines)

    # -- internals ----------------------------------------------------------------------------

    def _resolve_uncached(self, op: str, platform: str) -> Resolution:
        order = self._priorities.get(op, {}).get(platform)
        if order is None:
            # No list for this platform: fall back to the portable reference if it exists.
            order = (OpBackend.TORCH,)
        result = Resolution(op=op, platform=platform, backend=None, instance=None)
        for backend in order:
            target = self._targets.get(op, {}).get(backend)
            if target is None:
                result.skipped.append(BackendSkip(backend, "not registered"))
                continue
            try:
                instance = _load(target)
            except Exception as exc:  # any failure at import or construction falls through
                reason = f"{type(exc).__name__}: {exc}"
                result.skipped.append(BackendSkip(backend, reason))
                self._warn_once(op, platform, backend, reason)
                continue
            result.backend, result.instance = backend, instance
            logger.info("[ops] %s on %s -> %s backend", op, platform, backend.value)
            break
        return result

    def _warn_once(self, op: str, platform: str, backend: OpBackend, reason: str) -> None:
        key = (op, platform, backend)
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "[ops] %s: backend %s unavailable on %s, falling through (%s)",
            op,
            backend.value,
            platform,
            reason,
        )

    def _forget(self, op: str) -> None:
        for key in [k for k in self._resolved if k[0] == op]:
            del self._resolved[key]

    @staticmethod
    def _check_platform(platform: str) -> None:
        if platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; use one of {PLATFORMS}")

    @staticmethod
    def _as_backend(backend) -> OpBackend:
        try:
            return OpBackend(backend)
        except ValueError:
            raise ValueError(
                f"unknown backend {backend!r}; use one of {[b.value for b in OpBackend]}"
            ) from None


# Per-platform priority lists of the built-in ops: most preferred first, TORCH always last.
DEFAULT_PRIORITIES: dict[str, dict[str, tuple[OpBackend, ...]]] = {
    "embedding": {
        "cuda": (OpBackend.TORCH,),
        "rocm": (OpBackend.TORCH,),
        "cpu": (OpBackend.TORCH,),
    },
    "fused_indices_to_multihot": {
        "cuda": (OpBackend.TRITON, OpBackend.TORCH),
        "rocm": (OpBackend.TRITON, OpBackend.TORCH),
        "cpu": (OpBackend.TORCH,),
    },
}

_DEFAULT_TARGETS: dict[str, dict[OpBackend, str]] = {
    "embedding": {OpBackend.TORCH: "xtoken_core.ops.embedding:NativeEmbeddingOp"},
    "fused_indices_to_multihot": {
        OpBackend.TRITON: "xtoken_core.ops.indices_to_multihot:TritonIndicesToMultihotOp",
        OpBackend.TORCH: "xtoken_core.ops.indices_to_multihot:TorchIndicesToMultihotOp",
    },
}


def build_default_registry() -> OpRegistry:
    """A fresh registry holding the built-in ops and their default priority lists.

    Returns:
        A new :class:`OpRegistry` (nothing imported yet).
    """
    registry = OpRegistry()
    for op, targets in _DEFAULT_TARGETS.items():
        for backend, target in targets.items():
            registry.register(op, backend, target)
    for op, per_platform in DEFAULT_PRIORITIES.items():
        for platform, order in per_platform.items():
            registry.set_priority(op, platform, order)
    return registry


REGISTRY = build_default_registry()


def get_op(op: str, platform: str | None = None) -> object:
    """The op instance chosen by the process-wide registry (see :meth:`OpRegistry.get`)."""
    return REGISTRY.get(op, platform)


def chosen_backends(platform: str | None = None) -> dict[str, OpBackend | None]:
    """Which backend each op got in the process-wide registry."""
    return REGISTRY.chosen_backends(platform)


def describe(platform: str | None = None) -> str:
    """A table of the process-wide registry's choices (see :meth:`OpRegistry.describe`)."""
    return REGISTRY.describe(platform)
