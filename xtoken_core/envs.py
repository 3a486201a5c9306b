"""Every environment switch xtoken_core reads, in one place; each is read when asked (not at
import), so a test or a worker process can set it for its own scope.

| variable | read by | meaning |
|---|---|---|
| ``TRITON_INTERPRET`` | kernels | run Triton kernels in the CPU interpreter (tests) |
| ``XTOKEN_CACHE`` | tokenizers, models, data | root of the xtoken cache: tokenizers, models, projections, the demo corpus (default ``~/.cache/xtoken``) |
| ``TOKENIZERS_PARALLELISM`` | tokenizers | ``false``: encode batches on one thread |
| ``CUDA_VISIBLE_DEVICES`` | ipc | quoted in errors about a GPU this process cannot see |
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return default


def triton_interpret() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET``, default off).

    Returns:
        True when the variable is set to a true value.
    """
    return _flag("TRITON_INTERPRET", False)


def xtoken_cache() -> str | None:
    """The cache root set by ``XTOKEN_CACHE`` (None when unset or blank).

    Returns:
        The path as written, or None.
    """
    return os.environ.get("XTOKEN_CACHE", "").strip() or None


def tokenizers_parallelism_off() -> bool:
    """Whether ``TOKENIZERS_PARALLELISM`` turns batch tokenization off (a false value).

    Returns:
        True for 0/false/off/no.
    """
    return os.environ.get("TOKENIZERS_PARALLELISM", "").strip().lower() in _FALSE


def cuda_visible_devices() -> str:
    """``CUDA_VISIBLE_DEVICES`` as set, or ``"<unset>"`` (for messages).

    Returns:
        The value.
    """
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
