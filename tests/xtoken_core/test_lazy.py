"""Packages whose public names load on first use: every listed name loads, an unknown one is an
AttributeError, and importing the package alone imports no torch."""

import importlib
import subprocess
import sys

import pytest

LAZY_PACKAGES = ["xtoken_core.models", "xtoken_core.wire", "xtoken_core.losses", "services.protocol"]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_of_a_lazy_package_loads_from_its_module(package):
    module = importlib.import_module(package)
    homes = module.__lazy_homes__
    assert sorted(module.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_an_unknown_name_of_a_lazy_package_is_an_attribute_error_naming_it(package):
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_importing_a_lazy_package_imports_no_torch(package):
    code = f"import sys, {package}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
