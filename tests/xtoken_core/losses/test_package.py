"""The package's public names: each one loads from the module that defines it."""

from __future__ import annotations

import importlib

import xtoken_core.losses as losses


def test_every_public_name_resolves_from_its_module():
    assert sorted(losses.__all__) == sorted(losses._PUBLIC)
    for name, module in losses._PUBLIC.items():
        assert getattr(losses, name) is getattr(importlib.import_module(module), name)
    assert set(losses.__all__) <= set(dir(losses))
