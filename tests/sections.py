"""Test configs from nested settings: a base mapping with a test's overrides over it, where a
section given as a mapping is merged key by key (``feed={"grad_accum": 2}`` keeps the base's
``feed.micro_batch``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` over it, a section (a mapping in both) merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = {**out[key], **value} if both else value
    return out


def build(cls: type, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> Any:
    """The config ``cls`` of ``base`` with ``overrides`` over it (:func:`merged`), loaded as a
    config file is (``services.common.config.from_dict``)."""
    from services.common.config import from_dict

    return from_dict(cls, merged(base, overrides))
