"""The start-up step's messages: a step that does not fit names the settings to lower and the
other processes on the GPU; out of memory under another name is told from a compile failure."""

from __future__ import annotations

import torch

from services.trainer.startup import is_allocation_failure, startup_oom_message


def test_a_startup_step_that_does_not_fit_names_the_settings_and_the_other_processes():
    alone = startup_oom_message(4, 2048, "cuda:0", 80 * 2**30, int(0.6 * 2**30))
    assert alone == (
        "a student step of micro_batch=4 x 2048 tokens does not fit in cuda:0's memory (80 GiB): "
        "lower trainer.feed.micro_batch, or set trainer.compute.activation_checkpointing: true"
    )
    shared = startup_oom_message(4, 2048, "cuda:0", 80 * 2**30, 54 * 2**30)
    assert shared.startswith(alone)
    assert "other processes hold 54.0 GiB of it (a teacher, rollout workers" in shared
    assert startup_oom_message(1, 64, "cpu", None, None).endswith(
        "cpu's memory: lower trainer.feed.micro_batch, or set "
        "trainer.compute.activation_checkpointing: true"
    )


def test_a_step_with_the_whole_logits_that_does_not_fit_names_the_fused_head():
    text = startup_oom_message(16, 4096, "cuda:0", 140 * 2**30, 0, fused_head=False)
    assert text.endswith(
        "lower trainer.feed.micro_batch, or set trainer.compute.fused_head: true (the output "
        "layer and the loss by row blocks, never the whole logits) or "
        "trainer.compute.activation_checkpointing: true"
    )


def test_out_of_memory_under_another_name_is_told_from_a_compile_failure():
    cublas = RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    assert is_allocation_failure(cublas)
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("Inductor: compiling the backward failed") from oom
    except RuntimeError as wrapped:
        assert is_allocation_failure(wrapped)
    assert not is_allocation_failure(RuntimeError("Dynamo cannot trace this call"))
