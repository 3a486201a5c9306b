"""GPU: the teacher's logits reach the trainer bitwise (cuda_ipc) or within bf16 rounding (hidden)."""

from __future__ import annotations

import pytest
import torch

from services.teacher import protocol as proto
from services.teacher.worker import TeacherConfig, TeacherWorker

pytestmark = pytest.mark.gpu


def _request(worker: TeacherWorker, B: int = 2, U: int = 48, rank: int = 0) -> proto.Request:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([U, U - 7][:B])
    ids = torch.randint(3, worker.width, (B, U), generator=g)
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:] = worker.pad_id
    return proto.Request(key="k:1", rank=rank, ids_BU=ids, lengths_B=lengths)


def _result(fields: dict, rank: int = 0) -> proto.Result:
    return proto.Result.from_blob(fields[proto.result_field(rank)], "k:1")


def test_cuda_ipc_slot_equals_direct_forward_bitwise():
    from xtoken_core.ipc.logit_ring import LogitRingReader

    cfg = TeacherConfig(
        model="tiny",
        tokenizer="mistral",
        device="cuda",
        transport="cuda_ipc",
        max_batch=2,
        max_length=64,
        checksum=True,
    )
    with TeacherWorker(cfg) as worker:
        req = _request(worker)
        result = _result(worker.compute(req))
        reader = LogitRingReader(device="cuda")
        view = reader.view(result.descriptor, result.handle)
        direct = worker.logits(req).to(view.dtype)
        assert view.shape == direct.shape
        assert torch.equal(view, direct)
        assert reader.verify(view, result.handle)
        reader.release(result.descriptor, result.handle)
        reader.close()


def test_hidden_transport_matches_direct_logits_within_bf16_rounding():
    from xtoken_core.models import load_output_layer

    cfg = TeacherConfig(
        model="tiny",
        tokenizer="mistral",
        device="cuda",
        transport="hidden",
        dtype="float32",
        max_batch=2,
        max_length=64,
    )
    with TeacherWorker(cfg) as worker:
        req = _request(worker)
        fields = worker.compute(req)
        B, U = req.ids_BU.shape
        hidden_BUd = proto.hidden_from_column(fields[proto.hidden_field(0)], B, U, "k:1").cuda()
        assert hidden_BUd.dtype == torch.bfloat16
        head = load_output_layer("tiny", vocab_size=worker.width, device="cuda")
        logits = head(hidden_BUd.float())
        direct = worker.logits(req).float()
        scale = direct.abs().max()
        assert (logits - direct).abs().max() <= 2**-7 * scale * 4
