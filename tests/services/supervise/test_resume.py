"""A run resumes only its own checkpoint: the fingerprint, --resume, --fresh, "already complete"
(the plan alone, then `xtoken run` as a user starts it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.supervise.config import run_config_from_dict
from services.supervise.resume import FINGERPRINT_FILE, plan_start

ROOT = Path(__file__).resolve().parents[3]


def _config(run_dir: Path, **trainer):
    return run_config_from_dict(
        {
            "run_dir": str(run_dir),
            "trainer": {"student": "tiny", "max_steps": 10, "loss": {"mode": "ce"}, **trainer},
        }
    )


def _checkpoint(run_dir: Path, step: int) -> None:
    """What the trainer leaves of a checkpoint that the start reads: ``latest`` and rank0.json."""
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "rank0.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "latest").write_text(path.name)


def _finish(run_dir: Path, step: int) -> None:
    (run_dir / "summary.json").write_text(json.dumps({"step": step, "stopped": False}))


def test_a_new_directory_starts_fresh_and_records_the_fingerprint(tmp_path):
    plan = plan_start(_config(tmp_path / "run"))
    assert plan.action == "fresh" and plan.message == ""
    assert json.loads((tmp_path / "run" / FINGERPRINT_FILE).read_text())["trainer.student"] == (
        "tiny"
    )


def test_the_same_config_resumes_its_checkpoint_and_says_where(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    plan = plan_start(_config(tmp_path, checkpoint_every=2, eval_every=1))  # cadence may change
    assert (plan.action, plan.message) == ("resume", "resuming step 4 of 10")


def test_another_config_is_refused_naming_what_differs_and_both_flags(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    with pytest.raises(
        ValueError, match=r"trainer\.student: 'tiny' -> 'student-25m'.*--resume.*--fresh"
    ):
        plan_start(_config(tmp_path, student="student-25m"))


def test_a_checkpoint_without_a_fingerprint_is_refused(tmp_path):
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match="records no fingerprint"):
        plan_start(_config(tmp_path))


def test_resume_takes_another_runs_checkpoint_and_records_the_new_fingerprint(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    plan = plan_start(_config(tmp_path, seed=7), resume=True)
    assert plan.action == "resume" and "changed config" in plan.message
    assert plan_start(_config(tmp_path, seed=7)).action == "resume"  # now it is this run's


def test_fresh_moves_the_old_run_aside_and_deletes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 4)
    (run_dir / "notes.txt").write_text("mine")
    plan = plan_start(_config(run_dir, student="student-25m"), fresh=True)
    assert plan.action == "fresh" and plan.moved_to is not None
    assert (plan.moved_to / "notes.txt").read_text() == "mine"
    assert (plan.moved_to / "checkpoints" / "latest").is_file()
    assert [p.name for p in run_dir.iterdir()] == [FINGERPRINT_FILE]


def test_a_finished_run_is_complete_and_a_longer_one_resumes(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 10)
    _finish(tmp_path, 10)
    assert plan_start(_config(tmp_path)).action == "complete"
    plan = plan_start(_config(tmp_path, max_steps=20))  # extended: trains on
    assert (plan.action, plan.message) == ("resume", "resuming step 10 of 20")


def test_resume_and_fresh_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="exclude each other"):
        plan_start(_config(tmp_path), resume=True, fresh=True)


def _xtoken_run(config: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), "--no-progress", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_xtoken_run_of_a_finished_run_says_already_complete_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 10)
    _finish(run_dir, 10)
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_dir: {run_dir}\ntrainer:\n  student: tiny\n  max_steps: 10\n  loss:\n    mode: ce\n"
    )
    proc = _xtoken_run(path)
    assert proc.returncode == 0, proc.stderr
    assert "already complete: 10 steps" in proc.stderr
    assert not (run_dir / "logs").exists()  # no process started


def test_xtoken_run_of_another_config_on_a_run_directory_exits_2_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 4)
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {run_dir}\ntrainer:\n  student: student-25m\n")
    proc = _xtoken_run(path)
    assert proc.returncode == 2
    assert "holds a checkpoint (step 4) of another run" in proc.stderr
    assert not (run_dir / "logs").exists()
