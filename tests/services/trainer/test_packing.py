"""Packed micro-batches train exactly what their documents train unpacked: the same global
denominators, loss parts and gradients (fp32, CPU), the teacher logits of packed rows computed
with document-boundary attention."""

from __future__ import annotations

import pytest
import torch

from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup
from tests.services.trainer.dp_ranks import capture_step_gradients


def _step(projection: str, batch: dict, **config) -> tuple[dict, dict, dict]:
    step = build_step(setup.trainer_config(projection, **config))
    keys = [str(i) for i in range(batch["input_ids"].shape[0])]
    mb = setup.micro_batch(batch, keys)
    counts = {k: float(v.sum()) for k, v in step.count_valid([mb]).items()}
    grads, result = capture_step_gradients(step, [mb])
    return counts, grads, result.metrics


@pytest.mark.parametrize(
    "mode, extra",
    [("pkl", {}), ("gold", {}), ("pkl", {"compute": {"fused_head": True}})],
    ids=["pkl", "gold", "pkl-fused-head"],
)
def test_a_packed_micro_batch_trains_the_loss_and_gradients_of_its_documents_unpacked(
    projection, mode, extra
):
    unpacked = setup.pad(setup.samples())
    packed = setup.pad(setup.packed_samples())
    assert packed["input_ids"].shape[0] < unpacked["input_ids"].shape[0]  # rows were shared
    loss = {"mode": mode}
    want = _step(projection, unpacked, loss=loss)
    got = _step(projection, packed, loss=loss, pack=True, **extra)
    assert got[0] == want[0]  # global_valid_chunks and global_valid_tokens
    for name in ("loss", "ce_loss", "kl_loss"):
        assert got[2][name] == pytest.approx(want[2][name], rel=1e-5), name
    assert got[2]["tokens"] == want[2]["tokens"]
    for name, g in want[1].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-6 * max(scale, 1e-3))


def test_a_packed_ce_step_counts_one_target_less_per_document(projection):
    packed = setup.pad(setup.packed_samples())
    step = build_step(setup.trainer_config(None, pack=True))
    counts = step.count_valid([setup.micro_batch(packed, ["a", "b"], with_teacher=False)])
    documents = sum(int(s["sample_mask"]) for s in setup.samples())
    # each document's first token is the target of no logits, as in a row of its own
    assert float(counts["global_valid_tokens"]) == int(packed["input_lengths"].sum()) - documents
