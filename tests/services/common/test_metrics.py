"""A process's peak memory figures: off CUDA the peak RSS and no reserved figure; on a GPU what
PyTorch allocated and what its allocator reserved (at least as much)."""

import pytest
import torch

from services.common.metrics import device_memory_mb, device_reserved_mb


def test_off_cuda_the_peak_is_the_processes_rss_and_nothing_is_reserved():
    assert device_memory_mb("cpu") > 0
    assert device_reserved_mb("cpu") is None
    assert device_reserved_mb(torch.device("cpu")) is None


@pytest.mark.gpu
def test_on_a_gpu_the_allocator_reserves_at_least_what_it_allocated():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    allocated, reserved = device_memory_mb("cuda:0"), device_reserved_mb("cuda:0")
    assert allocated >= 64 and reserved >= allocated
    del x
