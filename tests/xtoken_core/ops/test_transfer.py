"""Host tensors reach a GPU through pinned memory without a host wait
(``xtoken_core.ops.transfer.to_device``)."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.ops.transfer import to_device


def test_on_the_cpu_it_is_a_plain_move_and_cast():
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    out = to_device(t, "cpu", torch.int64)
    assert out.dtype == torch.int64 and torch.equal(out, t.long())
    assert to_device(t, torch.device("cpu")) is t  # already there, same dtype: itself


@pytest.mark.gpu
def test_a_host_copy_to_the_gpu_does_not_wait_for_the_kernels_queued_before_it():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    host = torch.randn(4, 1 << 20)  # 16 MB, pageable: a plain copy waits for the stream
    to_device(host, "cuda")  # the pinned block is allocated once
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the copy
    out = to_device(host, "cuda", torch.float32)
    assert (
        not torch.cuda.current_stream().query()
    )  # the host came back before the GPU's sleep ended
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host)
