"""The step profiler traces the steps it is asked for, the time between them included, and writes
a gzipped chrome trace and an operator table per rank."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from services.common.config import ConfigError, from_dict
from services.trainer.config import TrainerConfig
from services.trainer.profiling import StepProfiler


def _work(n: int) -> None:
    a = torch.randn(64, 64)
    for _ in range(n):
        a = torch.tanh(a @ a)


def test_traces_only_the_chosen_steps_and_writes_trace_and_table(tmp_path):
    profiler = StepProfiler(start=2, steps=2, out_dir=tmp_path / "profile", rank=1, device="cpu")
    for step in range(1, 6):
        profiler.step_begins(step)
        with torch.profiler.record_function(f"step{step}"):
            _work(3)
        profiler.step_ended(step)
    profiler.close()  # already written: nothing more
    trace = tmp_path / "profile" / "trainer.rank1.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step2", "step3"} <= names
    assert not names & {"step1", "step4", "step5"}
    assert "aten::mm" in (tmp_path / "profile" / "trainer.rank1.ops.txt").read_text()
    # with Python stacks: the lines of code under each operation
    frames = {e["name"] for e in events if e.get("cat") == "python_function"}
    assert any("test_profiling.py(" in f and ": _work" in f for f in frames)


def test_a_run_that_ends_inside_the_traced_steps_still_writes_its_trace(tmp_path):
    profiler = StepProfiler(start=1, steps=10, out_dir=tmp_path, rank=0, device="cpu")
    profiler.step_begins(1)
    _work(1)
    profiler.step_ended(1)
    profiler.close()
    assert (tmp_path / "trainer.rank0.trace.json.gz").exists()


def test_zero_steps_trace_nothing(tmp_path):
    profiler = StepProfiler(start=1, steps=0, out_dir=tmp_path / "p", rank=0, device="cpu")
    profiler.step_begins(1)
    profiler.step_ended(1)
    profiler.close()
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"observe": {"profile_steps": -1}}, "profile_steps=-1"),
        ({"observe": {"profile_start": 0}}, "profile_start=0"),
    ],
)
def test_bad_profile_settings_are_refused_naming_the_value(settings, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        from_dict(TrainerConfig, settings)


def test_a_traced_step_shows_each_timed_phase_as_a_named_range(tmp_path):
    from services.trainer.step import PhaseClock

    profiler = StepProfiler(start=1, steps=1, out_dir=tmp_path, rank=0, device="cpu")
    profiler.step_begins(1)
    clock = PhaseClock(torch.device("cpu"))
    with clock.phase("teacher_wait"):
        _work(2)
    with clock.phase("forward", gpu=True):
        _work(2)
    profiler.step_ended(1)
    events = json.loads(gzip.decompress((tmp_path / "trainer.rank0.trace.json.gz").read_bytes()))
    names = {e.get("name") for e in events["traceEvents"]}
    assert {"phase:teacher_wait", "phase:forward"} <= names
    assert clock.seconds()["teacher_wait"] > 0 and clock.seconds()["forward"] > 0
