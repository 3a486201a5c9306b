"""trace_gaps: the GPU's busy time over merged streams, its idle gaps longest first with the host
work running when each began, and a file that is not a trace refused with exit 2."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.e2e import trace_gaps  # noqa: E402


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


EVENTS = [
    _event("kernel", "gemm", 0, 100),
    _event("kernel", "softmax", 50, 100),  # overlaps the gemm (another stream): merged
    _event("kernel", "gemm", 400, 100),  # after a 250 us gap
    _event("gpu_memcpy", "Memcpy HtoD", 560, 40),  # after a 60 us gap
    _event("cpu_op", "aten::to", 140, 300),
    _event("python_function", "feed.py(340): _decode", 120, 330),
    _event("cuda_runtime", "cudaStreamSynchronize", 145, 250),
]


def test_busy_time_merges_streams_and_gaps_come_longest_first_with_their_host_work():
    window, busy, found = trace_gaps.gaps(EVENTS, min_us=50)
    assert (window, busy) == (600, 290)  # 0-150, 400-500, 560-600
    assert [(g.start_us, g.length_us) for g in found] == [(150, 250), (500, 60)]
    assert found[0].host == ("feed.py(340): _decode", "aten::to", "cudaStreamSynchronize")
    assert found[1].host == ()
    assert trace_gaps.gaps(EVENTS, min_us=100)[2][0].length_us == 250


def test_the_cli_reads_a_gzipped_trace_and_refuses_a_file_that_is_not_one(tmp_path, capsys):
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert trace_gaps.main([str(trace), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "window 0.6 ms, GPU busy 0.3 ms (48%), 2 gaps >= 50 us: 0.3 ms"
    assert out[1].split() == [
        "0.25", "ms", "at", "+", "0.1", "ms", "feed.py(340):", "_decode", ">", "aten::to", ">",
        "cudaStreamSynchronize",
    ]  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert trace_gaps.main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not a chrome trace")
    empty = tmp_path / "cpu.json"
    empty.write_text(json.dumps({"traceEvents": [_event("cpu_op", "aten::mm", 0, 5)]}))
    assert trace_gaps.main([str(empty)]) == 2


def test_the_runtime_calls_that_held_the_host_come_longest_first_with_their_operations():
    calls = trace_gaps.long_runtime_calls(EVENTS, min_us=100)
    assert calls == [
        (250.0, "cudaStreamSynchronize", ("feed.py(340): _decode", "aten::to")),
    ]
    assert trace_gaps.long_runtime_calls(EVENTS, min_us=251) == []


def test_a_call_is_named_with_the_projects_innermost_frame_under_it(tmp_path, capsys):
    events = [
        _event("kernel", "gemm", 0, 100),
        _event("kernel", "gemm", 600, 100),
        _event("python_function", "/src/services/trainer/step.py(338): run", 50, 530),
        _event("python_function", "/src/xtoken_core/losses/loss.py(236): count_valid", 60, 510),
        _event("python_function", "torch/_tensor.py(40): wrapped", 65, 500),
        _event("cpu_op", "aten::to", 70, 490),
        _event("cpu_op", "aten::copy_", 75, 480),
        _event("cuda_runtime", "cudaStreamSynchronize", 80, 470),  # the gap: 100-600
    ]
    host = ("/src/services/trainer/step.py(338): run", "torch/_tensor.py(40): wrapped")
    assert trace_gaps.our_frame(host) == "services/trainer/step.py(338): run"
    assert trace_gaps.our_frame(("torch/_tensor.py(40): wrapped", "aten::to")) is None
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert trace_gaps.main([str(trace), "--depth", "2", "--min-call-ms", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    frame = "[from xtoken_core/losses/loss.py(236): count_valid]"
    assert out[1].endswith("aten::copy_ > cudaStreamSynchronize  " + frame)
    assert out[-1].endswith("aten::copy_ > cudaStreamSynchronize  " + frame)
