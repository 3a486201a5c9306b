"""Packages whose public names load on first use (PEP 562), so that importing one light module of
the package (a config, the dtype names, the wire's error codes) does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, public: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names load on first use.

    Args:
        package: the package's ``__name__``.
        public: public name -> the module that defines it.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's ``__init__``.
    """
    namespace = importlib.import_module(package).__dict__
    namespace["__lazy_homes__"] = dict(public)  # name -> module, for tests and readers

    def getattr_(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *public})

    return getattr_, dir_
