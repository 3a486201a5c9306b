"""Model dtypes by name: auto per device, float names, anything else refused naming the value."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.models.dtypes import resolve_dtype


def test_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_a_float_name_is_its_torch_dtype():
    assert resolve_dtype("float16", "cpu") == torch.float16


@pytest.mark.parametrize("name", ["int8", "nope"])
def test_a_name_that_is_not_a_float_dtype_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match=name):
        resolve_dtype(name, "cpu")
