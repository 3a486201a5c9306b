"""The A/B report of the scaled healing runs' time: pairs by setting, ratios, the report's
opening figures, a missing rows file refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality import scale_ab  # noqa: E402


def _row(arm, lr, wall, compile_s, train_s, bpb, mib=None, exit_code=0):
    return {
        "phase": "grid", "arm": arm, "seed": 0, "lr": lr, "kl_weight": None, "temperature": None,
        "exit": exit_code, "wall_s": wall, "compile_s": compile_s, "train_s": train_s,
        "command_s": [wall - 20.0, 20.0], "validation_bpb": bpb,
        "peak_memory_mib": {"trainer": mib, "teacher": None},
    }  # fmt: skip


def test_runs_pair_by_setting_and_the_report_opens_with_the_median_ratios(tmp_path):
    a = [
        _row("ce", 1e-3, 300.0, 80.0, 100.0, 0.7638, 20000.0),
        _row("ce", 5e-4, 300.0, 90.0, 100.0, 0.7756),
        _row("pkl", 5e-4, 320.0, 80.0, 120.0, 0.7675),  # not in B: unpaired
        _row("ce", 2e-3, 10.0, None, 0.0, None, exit_code=1),  # failed: never paired
    ]
    b = [
        _row("ce", 5e-4, 240.0, 45.0, 110.0, 0.7757),
        _row("ce", 1e-3, 210.0, 40.0, 90.0, 0.7636, 10000.0),
        _row("ce", 1e-3, 999.0, 1.0, 1.0, 0.1),  # trained again: the first row counts
        _row("ce", 2e-3, 200.0, 40.0, 90.0, 0.78),
    ]
    result = scale_ab.compare(a, b)
    assert [p["setting"][1:4] for p in result["pairs"]] == [["ce", 0, 1e-3], ["ce", 0, 5e-4]]
    first = result["pairs"][0]
    assert first["ratios"]["run s"] == pytest.approx(0.7)
    assert first["ratios"]["start-up step s"] == pytest.approx(0.5)
    assert first["ratios"]["trainer peak MiB"] == pytest.approx(0.5)
    assert "trainer peak MiB" not in result["pairs"][1]["ratios"]  # A's row has none
    assert result["medians"]["run s"] == pytest.approx((0.7 + 0.8) / 2)
    assert result["max_validation_diff"] == pytest.approx(0.0002)
    a[0].update(device="NVIDIA H200", commit="abc1234", command="python scale.py --x")
    b[0].update(device="NVIDIA H200", commit="abc1234", command="python scale.py --y")
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ab.md"
    argv = ["--a", str(tmp_path / "a.jsonl"), "--b", str(tmp_path / "b.jsonl"), "--label-a",
            "ladder", "--label-b", "one rung", "--out", str(out)]  # fmt: skip
    assert scale_ab.main(argv) == 0
    md = out.read_text().splitlines()
    assert md[0] == "# The scaled healing runs' time: one rung against ladder"
    assert md[2].startswith("**Current figures (one rung / ladder, medians of 2 paired runs): ")
    assert "run s 0.75x" in md[2] and "at most 0.0002" in md[2]
    assert md[4].startswith("Command: `python benchmarks/quality/scale_ab.py --a ")
    assert md[6] == (
        "Devices: NVIDIA H200; commits abc1234; A's rows by `python scale.py --x`; "
        "B's rows by `python scale.py --y`. Rows and figures: [a.jsonl](a.jsonl), "
        "[b.jsonl](b.jsonl), [ab.json](ab.json)."
    )
    assert json.loads(out.with_suffix(".json").read_text())["medians"]["start-up step s"] == 0.5


def test_no_pair_says_so_and_a_missing_rows_file_is_refused_in_one_line(tmp_path, capsys):
    assert "none (no setting is scored in both" in scale_ab.markdown(
        scale_ab.compare([], []), "A", "B", "cmd"
    )
    code = scale_ab.main(["--a", str(tmp_path / "no.jsonl"), "--b", "x", "--out", "o.md"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"scale_ab.py: no rows file {tmp_path / 'no.jsonl'}; give two quality_scale.jsonl"
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [("{not json\n", "is not JSON lines"), ('{"a": 1}\n', "holds lines that are not scale rows")],
)
def test_a_malformed_rows_file_is_refused_in_one_line_and_writes_nothing(
    tmp_path, capsys, text, says
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    out = tmp_path / "ab.md"
    assert scale_ab.main(["--a", str(bad), "--b", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and str(bad) in err[0]
    assert not out.exists()
