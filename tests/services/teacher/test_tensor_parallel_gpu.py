"""Two GPUs: a tensor-parallel teacher group (NCCL) writes both ranks' vocab columns of a
cuda_ipc ring slot on rank 0's GPU; its logits equal one teacher's within bf16 rounding, and a
large preset built shard by shard on each GPU serves."""

from __future__ import annotations

import pytest
import torch

from tests.services.teacher.tp_ranks import TOKENIZER, serve_cuda_ipc_group, spawn_group

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_two_gpu_group_writes_one_teachers_logits_into_a_cuda_ipc_slot(tmp_path):
    out = tmp_path / "saved.pt"
    spawn_group(serve_cuda_ipc_group, 2, str(out))
    saved = torch.load(out)
    from xtoken_core.tokenizers import load_tokenizer

    vocab = int(load_tokenizer(TOKENIZER).vocab_size)
    got, want = saved["tiny"], saved["one:tiny"]
    assert got.shape == want.shape == (2, 11, vocab)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2**-6 * scale  # bf16 compute, other reductions
    assert saved["tiny:verified"] and saved["qwen3-1.7b:verified"]  # checksums of whole slots
    big = saved["qwen3-1.7b"]
    assert big.shape == (2, 11, vocab) and torch.isfinite(big).all() and big.abs().max() > 0
    assert saved["tiny:compiled"] and saved["qwen3-1.7b:compiled"]  # no fall back to eager
