"""`xtoken demo`: its run directory is cleared only where the demo made it (anything else is
refused); its --set overrides are checked like a run config's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.cli.demo import MARKER, fresh_run_dir

ROOT = Path(__file__).resolve().parents[3]


def test_a_new_directory_is_made_and_marked_as_the_demos(tmp_path):
    run_dir = fresh_run_dir(tmp_path / "runs" / "demo")
    assert run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == [MARKER]


def test_the_demos_own_directory_is_cleared_but_for_its_marker(tmp_path):
    run_dir = fresh_run_dir(tmp_path / "demo")
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "trainer.rank0.jsonl").write_text("{}\n")
    (run_dir / "summary.json").write_text("{}")
    fresh_run_dir(run_dir)
    assert [p.name for p in run_dir.iterdir()] == [MARKER]


@pytest.mark.parametrize("setup", ["foreign file", "foreign folder"])
def test_a_directory_the_demo_did_not_make_is_refused_and_kept(tmp_path, setup):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    keep = run_dir / "notes.txt" if setup == "foreign file" else run_dir / "src"
    if setup == "foreign file":
        keep.write_text("mine")
    else:
        keep.mkdir()
    with pytest.raises(ValueError, match="not made by the demo.*new or empty directory"):
        fresh_run_dir(run_dir)
    assert keep.exists() and not (run_dir / MARKER).exists()


def test_a_file_as_run_directory_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        fresh_run_dir(path)
    assert path.read_text() == "x"


def test_xtoken_demo_on_a_working_tree_exits_2_and_deletes_nothing(tmp_path):
    (tmp_path / "README.md").write_text("a user's work")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not made by the demo" in proc.stderr
    assert (tmp_path / "README.md").read_text() == "a user's work"


def test_demo_overrides_apply_after_its_options_and_are_checked():
    from services.cli import build_parser
    from services.cli.demo import demo_config
    from services.common.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(["demo", "--steps", "5", "--set", "trainer.schedule.max_steps=7"])
    assert demo_config(args).trainer.schedule.max_steps == 7  # a later --set wins over --steps
    args = parser.parse_args(["demo", "--set", "trainer.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'trainer\.optim\.lr'\?"):
        demo_config(args)


def test_demo_steps_0_trains_until_the_data_ends_and_a_negative_count_is_refused(capsys):
    from services.cli import build_parser
    from services.cli.demo import demo_config

    parser = build_parser()
    assert demo_config(parser.parse_args(["demo", "--steps", "0"])).trainer.schedule.max_steps == 0
    assert demo_config(parser.parse_args(["demo"])).trainer.schedule.max_steps == 36
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["demo", "--steps", "-1"])
    assert exc.value.code == 2
    assert "--steps: -1 is not a step count" in capsys.readouterr().err


def test_the_ce_only_run_is_the_same_run_without_the_teacher():
    from services.cli import build_parser
    from services.cli.demo import BASELINE_DIR, baseline_data, demo_config
    from services.supervise.config import run_config_from_dict

    args = build_parser().parse_args(["demo", "--steps", "3", "--run-dir", "runs/d"])
    kd, ce = demo_config(args), run_config_from_dict(baseline_data(args))
    assert ce.trainer.loss.mode == "ce" and kd.trainer.loss.mode == "xtoken"
    assert ce.run_dir == f"runs/d/{BASELINE_DIR}" and not ce.trainer.schedule.export
    # the ordered data mode: both runs train the same micro-batches in the same steps
    assert kd.data.ordered and (ce.data, ce.trainer.schedule.max_steps) == (
        kd.data,
        kd.trainer.schedule.max_steps,
    )
    assert (
        ce.trainer.optim == kd.trainer.optim
        and ce.trainer.student.model == kd.trainer.student.model
    )


def test_the_held_out_table_shows_kd_beside_ce_only_and_their_signed_difference():
    from services.cli import build_parser
    from services.cli.demo import demo_config, format_table

    config = demo_config(build_parser().parse_args(["demo"]))
    kd = {"teacher": 0.95, "student_before": 4.0, "student_after": 2.5, "steps": 36}
    table = format_table(kd, {"student_after": 2.75}, config).splitlines()
    assert table[0] == (
        "held-out bits/byte, lower is better (run runs/demo, 36 steps of 2 x 128 tokens)"
    )
    assert table[3].split() == ["student", "after", "KD", "(xtoken)", "2.5000"]
    assert table[4].split() == ["student", "after", "CE", "only", "2.7500"]
    assert table[5].split() == ["KD", "minus", "CE", "only", "-0.2500"]
    assert len({len(line) for line in table[1:6]}) == 1  # the figures end in one column
    behind = format_table({**kd, "student_after": 3.0}, {"student_after": 2.75}, config)
    assert behind.splitlines()[5].split()[-1] == "+0.2500"
    assert len(format_table(kd, None, config).splitlines()) == 4  # --no-baseline
