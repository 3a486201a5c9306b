"""The protocol package: each name it lists is its module's own, and an unknown one is refused."""

from __future__ import annotations

import importlib

import pytest

import services.protocol as protocol


@pytest.mark.parametrize("name", protocol.__all__)
def test_every_listed_name_is_the_one_its_module_defines(name):
    home = importlib.import_module(f"services.protocol.{protocol._HOMES[name]}")
    assert getattr(protocol, name) is getattr(home, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        protocol.nope  # noqa: B018
