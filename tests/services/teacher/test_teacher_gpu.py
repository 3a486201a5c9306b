"""GPU: the teacher's logits reach the trainer bitwise (cuda_ipc) or within bf16 rounding (hidden)."""

from __future__ import annotations

import pytest
import torch

from services import protocol as proto
from services.teacher.config import TeacherConfig
from services.teacher.worker import TeacherWorker
from tests.extras import require_tokenizers

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tokenizer_installed():
    """Every teacher here reads the mistral tokenizer (an optional package)."""
    require_tokenizers("mistral")


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


def test_compiled_teacher_matches_eager_within_bf16_and_compiles_no_more_after_two_lengths(caplog):
    """teacher.compile is on by default on CUDA (here with teacher.cuda_graphs): requests of five
    lengths, then three of them again (replayed CUDA graphs), through cuda_ipc slots match an
    eager teacher of the same weights within bf16 rounding, and after the first two lengths no
    request compiles a new graph."""
    import copy
    import logging

    from torch._dynamo.utils import counters

    from xtoken_core.ipc.logit_ring import LogitRingReader
    from xtoken_core.models import load_model

    model = load_model("tiny", vocab_size=32768, dtype=torch.bfloat16, device="cuda", seed=0)
    eager_model = copy.deepcopy(model)
    common = dict(model="tiny", tokenizer="mistral", device="cuda", max_batch=2, max_length=128)
    cfg = TeacherConfig(transport="cuda_ipc", cuda_graphs=True, **common)
    assert cfg.compile is None  # auto: on for cuda
    graphs = []
    with (
        caplog.at_level(logging.INFO),
        TeacherWorker(cfg, model=model) as worker,
        TeacherWorker(TeacherConfig(compile=False, **common), model=eager_model) as eager,
        LogitRingReader(device="cuda") as reader,
    ):
        assert worker.compiled.active and not eager.compiled.active
        assert worker.compiled.cuda_graphs and not eager.compiled.cuda_graphs
        for U in (40, 57, 64, 23, 90, 40, 57, 40):
            req = _request(worker, B=2, U=U)
            result = _result(worker.compute(req))
            got = reader.view(result.descriptor, result.handle).float()
            want = eager.logits(req).float()
            assert got.shape == want.shape == (2, U, worker.width)
            scale = want.abs().max()
            assert (got - want).abs().max() <= 2**-6 * scale, (U, (got - want).abs().max())
            reader.release(result.descriptor, result.handle)
            graphs.append(counters["stats"]["unique_graphs"])
        assert worker.compiled.compile_s is not None
    assert graphs[1:] == [graphs[1]] * 7, f"graphs compiled after each request: {graphs}"
    assert "[teacher] compiled the teacher in" in caplog.text
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "teacher.compile" in m], messages  # no fall back to eager
