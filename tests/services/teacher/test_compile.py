"""The teacher's compiled forward on CPU: off unless asked, set from flags and YAML, a compile
that fails falls back to eager with one warning, a compiled teacher matches eager."""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch

from services import protocol as proto
from services.common import config as cfg
from services.teacher.compile import decoder_layers
from services.teacher.config import TeacherConfig, resolve_compile, resolve_cuda_graphs
from services.teacher.worker import TeacherWorker
from xtoken_core.models import load_model

TOKENIZER = "smollm2"
VOCAB = 49152  # the smollm2 tokenizer's


def _config(**overrides) -> TeacherConfig:
    fields = dict(model="tiny", tokenizer=TOKENIZER, max_batch=2, max_length=32, seed=3)
    fields.update(overrides)
    return TeacherConfig(**fields)


def _request(lengths: list[int], key: str, pad_id: int, seed: int = 0) -> proto.Request:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    return proto.decode_request(key, proto.request_fields(rows, 0), 0, pad_id)


def _compile_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "teacher.compile" in r.getMessage()]


def test_compile_flag_off_on_cpu_by_default():
    assert TeacherConfig().compile is None
    assert resolve_compile(None, "cpu") is False
    assert resolve_compile(None, "cuda:1") is True
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cuda") is False
    with TeacherWorker(_config()) as worker:
        assert not worker.compiled.active
        assert all(layer._compiled_call_impl is None for layer in worker.model.model.layers)


def test_cuda_graphs_are_off_unless_asked_and_asked_run_only_on_compiled_cuda_layers():
    assert TeacherConfig().cuda_graphs is False
    assert resolve_cuda_graphs(True, True, "cuda:0") is True
    assert resolve_cuda_graphs(False, True, "cuda") is False
    assert resolve_cuda_graphs(False, False, "cpu") is False
    with TeacherWorker(_config(compile=True)) as worker:  # compiled on cpu: no graphs
        assert worker.compiled.active and not worker.compiled.cuda_graphs


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(cuda_graphs=True), "not a cuda device"),
        (dict(cuda_graphs=True, compile=False, device="cuda"), "teacher.compile is off"),
    ],
)
def test_cuda_graphs_asked_where_they_cannot_run_are_refused_naming_the_setting(overrides, named):
    with pytest.raises(ValueError, match=named) as err:
        _config(**overrides)
    assert "set teacher.cuda_graphs: false" in str(err.value)


@pytest.mark.parametrize(
    ("argv", "yaml", "want"),
    [
        ([], None, None),
        (["--compile"], None, True),
        (["--no-compile"], None, False),
        ([], "compile: false\n", False),
        ([], "compile: null\n", None),
        (["--compile"], "compile: false\n", True),  # a flag overrides the file
    ],
)
def test_compile_is_unset_true_or_false_from_flags_and_yaml(tmp_path, argv, yaml, want):
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, TeacherConfig)
    if yaml is not None:
        path = tmp_path / "teacher.yaml"
        path.write_text(yaml)
        argv = [*argv, "--config", str(path)]
    config = cfg.from_args(TeacherConfig, parser.parse_args(argv))
    assert config.compile is want
    assert cfg.from_dict(TeacherConfig, cfg.to_dict(config)).compile is want  # run.py's hand-off


class _BranchOnData(torch.nn.Module):
    """A decoder layer behind a branch on a tensor's value: ``.item()`` breaks dynamo's graph,
    so the layer cannot be traced whole (``fullgraph=True``)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.abs().max().item() > 1e30:  # never true: eager runs the plain layer
            hidden_states = hidden_states.clamp(-1e30, 1e30)
        return self.layer(hidden_states, *args, **kwargs)


def test_compile_failure_falls_back_to_eager_with_one_warning(caplog):
    model = load_model("tiny", vocab_size=VOCAB, seed=3)
    layers = decoder_layers(model)
    model.model.layers = torch.nn.ModuleList(_BranchOnData(layer) for layer in layers)
    eager_model = copy.deepcopy(model)
    config = _config(compile=True, transport="hidden", logits_dtype="float32")
    with caplog.at_level(logging.INFO), TeacherWorker(config, model=model) as worker:
        assert worker.compiled.active  # compiled lazily: the first forward finds out
        requests = [_request([12, 5], f"k:{i}", worker.pad_id, seed=i) for i in range(3)]
        got = [worker.compute(r)[proto.hidden_field(0)].values for r in requests]
        assert not worker.compiled.active

    warnings = _compile_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "compiling the decoder layers failed" in warnings[0]
    assert "the teacher runs eager" in warnings[0]
    assert "compiled the teacher in" not in caplog.text
    with TeacherWorker(_config(compile=False, transport="hidden", logits_dtype="float32"),
                       model=eager_model) as eager:  # fmt: skip
        for request, values in zip(requests, got, strict=True):
            assert torch.equal(values, eager.compute(request)[proto.hidden_field(0)].values)


@pytest.mark.slow  # the first forward compiles the layers with inductor: ~30 s on 2 CPU cores
def test_compiled_teacher_on_cpu_matches_eager_and_logs_its_compile_seconds(caplog):
    from torch._dynamo.utils import counters

    model = load_model("tiny", vocab_size=VOCAB, seed=3)
    eager_model = copy.deepcopy(model)
    config = _config(compile=True, logits_dtype="float32", transport="hidden")
    with (
        caplog.at_level(logging.INFO),
        TeacherWorker(config, model=model) as compiled,
        TeacherWorker(_config(compile=False), model=eager_model) as eager,
    ):
        graphs = []
        for i, U in enumerate((9, 17, 12, 30, 23)):
            request = _request([U, U - 3], f"k:{i}", compiled.pad_id, seed=i)
            got = compiled.logits(request)
            torch.testing.assert_close(got, eager.logits(request), rtol=1e-4, atol=1e-4)
            graphs.append(counters["stats"]["unique_graphs"])
        assert compiled.compiled.active and compiled.compiled.compile_s is not None
    assert graphs[1:] == [graphs[1]] * 4, graphs  # no recompile after the first two lengths
    assert "[teacher] compiled the teacher in" in caplog.text
    assert _compile_warnings(caplog) == []
