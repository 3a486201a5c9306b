"""A run resumes only its own checkpoint: the fingerprint (derived from the fields' marks),
--resume, --fresh, "already complete" (the plan alone, then `xtoken run` as a user starts it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import leaf_paths, marks
from services.supervise.config import RunConfig, run_config_from_dict
from services.supervise.driver import _inputs_written
from services.supervise.preflight import Inputs
from services.supervise.resume import FINGERPRINT_FILE, fingerprint, plan_start
from services.trainer.config import TrainerConfig
from tests.sections import merged

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny.yaml"


def _config(run_dir: Path, sections: dict | None = None, **trainer):
    """A tiny CE run of 10 steps; ``trainer``: its trainer's sections merged in
    (``schedule={"max_steps": 20}``), ``sections``: the run config's."""
    base = {"student": {"model": "tiny"}, "schedule": {"max_steps": 10}, "loss": {"mode": "ce"}}
    data = {"run_dir": str(run_dir), "trainer": merged(base, trainer)}
    for key, value in (sections or {}).items():
        if key == "trainer":
            data[key] = merged(data[key], value)
        elif isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return run_config_from_dict(data)


def _checkpoint(run_dir: Path, step: int, epoch: int = 0) -> None:
    """What the trainer leaves of a checkpoint that the start reads: ``latest`` and rank0.json
    (``epoch``: the epochs done when it was written; a run whose data ended wrote its last one
    with every epoch done)."""
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "rank0.json").write_text(json.dumps({"step": step, "epoch": epoch}))
    (run_dir / "checkpoints" / "latest").write_text(path.name)


def _finish(run_dir: Path, step: int, epoch: int = 0) -> None:
    summary = {"step": step, "epoch": epoch, "stopped": False}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_every_field_of_every_section_says_whether_it_changes_what_is_trained():
    marked = marks(RunConfig, "trained")
    unmarked = [key for key in leaf_paths(RunConfig) if key not in marked]
    assert not unmarked, f"mark these fields 'trained': True or False: {unmarked}"
    assert {key for key, value in marked.items() if not isinstance(value, bool)} == set()


def test_the_fingerprint_holds_every_data_loss_optimizer_and_model_setting():
    keys = set(fingerprint(_config(Path("r"))))
    expected = {
        key
        for key in leaf_paths(RunConfig)
        if key.startswith(("data.", "trainer.optim.", "trainer.loss."))
    } - {"trainer.loss.projection", "trainer.loss.backend", "trainer.loss.check_inputs"}
    assert expected <= keys, sorted(expected - keys)
    assert {
        "pack",
        "data.on_policy_fraction",
        "data.heldout",
        "trainer.eval.texts",
        "trainer.student.model",
        "teacher.model",
        "student_tokenizer",
        "trainers",
    } <= keys
    # what may change on a resume: the steps, cadence, timeouts, devices, compute, the projection
    assert not keys & {
        "trainer.schedule.max_steps",
        "trainer.schedule.checkpoint_every",
        "trainer.schedule.eval_every",
        "trainer.teacher.timeout_s",
        "trainer.compute.device",
        "teacher.device",
        "trainer.compute.dtype",
        "trainer.compute.compile",
        "trainer.loss.projection",
        "run_dir",
    }


@pytest.mark.parametrize(
    ("sections", "change"),
    [
        ({"pack": True}, "pack: False -> True"),
        ({"trainer": {"eval": {"texts": 8}}}, "trainer.eval.texts: 32 -> 8"),
        ({"data": {"heldout": "held.jsonl"}}, "data.heldout: None -> 'held.jsonl'"),
        ({"trainer": {"optim": {"lr": 0.003}}}, "trainer.optim.lr: 0.001 -> 0.003"),
    ],
    ids=["pack", "eval-texts", "heldout", "lr"],
)
def test_a_setting_that_changes_what_is_trained_refuses_the_resume_naming_it(
    tmp_path, sections, change
):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError) as refused:
        plan_start(_config(tmp_path, sections))
    assert change in str(refused.value)


def test_the_refusal_is_one_line_naming_each_changed_key_with_its_two_values(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    changed = {
        "pack": True,
        "collator": {"batch": 8},
        "data": {"limit": 50, "seed": 3},
        "trainer": {"student": {"seed": 7}, "optim": {"lr": 0.003}},
    }
    with pytest.raises(ValueError) as refused:
        plan_start(_config(tmp_path, changed))
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "{" not in message
    for change in (
        "collator.batch: 16 -> 8",
        "pack: False -> True",
        "data.limit: None -> 50",
        "data.seed: None -> 3",
        "trainer.optim.lr: 0.001 -> 0.003",
        "trainer.student.seed: 0 -> 7",
    ):
        assert change in message


def _old_fingerprint(config) -> dict:
    """A fingerprint as the hand-written key list of earlier versions wrote it: the optimizer as
    one dict, no collator, on-policy or held-out keys."""
    new = fingerprint(config)
    old = {k: v for k, v in new.items() if k.split(".")[0] in ("trainer", "teacher")}
    old = {k: v for k, v in old.items() if not k.startswith(("trainer.optim.", "trainer.on_"))}
    old = {k: v for k, v in old.items() if k != "trainer.eval.texts"}
    old["trainer.optim"] = {k.rsplit(".", 1)[1]: v for k, v in new.items() if ".optim." in k}
    old.update({k: new[k] for k in ("student_tokenizer", "trainers", "data.train")})
    return old


def test_a_fingerprint_of_an_earlier_version_is_compared_on_the_keys_it_records(tmp_path):
    config = _config(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / FINGERPRINT_FILE).write_text(json.dumps(_old_fingerprint(config)))
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match=r"trainer\.optim\.lr: 0\.001 -> 0\.003"):
        plan_start(_config(tmp_path, {"trainer": {"optim": {"lr": 0.003}}}))
    plan = plan_start(_config(tmp_path))  # the same on what it records: its own run
    assert (plan.action, plan.message) == ("resume", "resuming step 4 of 10")
    recorded = json.loads((tmp_path / FINGERPRINT_FILE).read_text())
    assert recorded == fingerprint(config)  # recorded whole from now on


def _flat_fingerprint(config) -> dict:
    """A fingerprint as the version whose trainer settings were flat keys wrote it
    (``trainer.student``, ``trainer.seed``, ``trainer.eval_texts``)."""
    old_key = {f"trainer.{new}": f"trainer.{old}" for old, new in TrainerConfig.MOVED_KEYS.items()}
    return {old_key.get(k, k): v for k, v in fingerprint(config).items()}


def test_a_run_directory_of_flat_trainer_keys_is_compared_under_their_new_names(tmp_path):
    config = _config(tmp_path)
    flat = _flat_fingerprint(config)
    assert flat["trainer.student"] == "tiny" and "trainer.student.model" not in flat
    assert "trainer.micro_batch" in flat and "trainer.feed.micro_batch" not in flat
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / FINGERPRINT_FILE).write_text(json.dumps(flat))
    (tmp_path / "config").mkdir()
    run = {
        "data": {"train": "/data/train.jsonl", "heldout": None},
        "trainer": {"student": "tiny", "micro_batch": 4, "max_steps": 10,
                    "loss": {"mode": "ce", "projection": None}},
    }  # fmt: skip
    (tmp_path / "config" / "run.json").write_text(json.dumps(run))
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match=r"trainer\.optim\.lr: 0\.001 -> 0\.003"):
        plan_start(_config(tmp_path, {"trainer": {"optim": {"lr": 0.003}}}))
    # a moved key's change is named by its new key
    with pytest.raises(ValueError, match=r"\(trainer\.feed\.micro_batch: 4 -> 2\)"):
        plan_start(_config(tmp_path, {"trainer": {"feed": {"micro_batch": 2}}}))
    plan = plan_start(_config(tmp_path))  # the same on the keys both record: its own run
    assert (plan.action, plan.message) == ("resume", "resuming step 4 of 10")
    assert json.loads((tmp_path / FINGERPRINT_FILE).read_text()) == fingerprint(config)
    # a re-attached run of that version reads its settled inputs from the old run.json
    assert _inputs_written(tmp_path) == Inputs("/data/train.jsonl", None, None)


def test_a_new_directory_starts_fresh_and_records_the_fingerprint(tmp_path):
    plan = plan_start(_config(tmp_path / "run"))
    assert plan.action == "fresh" and plan.message == ""
    recorded = json.loads((tmp_path / "run" / FINGERPRINT_FILE).read_text())
    assert recorded["trainer.student.model"] == "tiny"


def test_the_same_config_resumes_its_checkpoint_and_says_where(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    plan = plan_start(
        _config(tmp_path, schedule={"checkpoint_every": 2, "eval_every": 1})
    )  # cadence may change
    assert (plan.action, plan.message) == ("resume", "resuming step 4 of 10")


def test_another_config_is_refused_naming_what_differs_and_both_flags(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    with pytest.raises(
        ValueError, match=r"trainer\.student\.model: 'tiny' -> 'student-25m'.*--resume.*--fresh"
    ):
        plan_start(_config(tmp_path, student={"model": "student-25m"}))


def test_a_checkpoint_without_a_fingerprint_is_refused(tmp_path):
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match="records no fingerprint"):
        plan_start(_config(tmp_path))


def test_resume_takes_another_runs_checkpoint_and_records_the_new_fingerprint(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    plan = plan_start(_config(tmp_path, student={"seed": 7}), resume=True)
    assert plan.action == "resume" and "changed config" in plan.message
    assert (
        plan_start(_config(tmp_path, student={"seed": 7})).action == "resume"
    )  # now it is this run's


def test_fresh_moves_the_old_run_aside_and_deletes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 4)
    (run_dir / "notes.txt").write_text("mine")
    plan = plan_start(_config(run_dir, student={"model": "student-25m"}), fresh=True)
    assert plan.action == "fresh" and plan.moved_to is not None
    assert (plan.moved_to / "notes.txt").read_text() == "mine"
    assert (plan.moved_to / "checkpoints" / "latest").is_file()
    assert [p.name for p in run_dir.iterdir()] == [FINGERPRINT_FILE]


def test_a_finished_run_is_complete_and_a_longer_one_resumes(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 10)
    _finish(tmp_path, 10)
    assert plan_start(_config(tmp_path)).action == "complete"
    plan = plan_start(_config(tmp_path, schedule={"max_steps": 20}))  # extended: trains on
    assert (plan.action, plan.message) == ("resume", "resuming step 10 of 20")
    plan = plan_start(
        _config(tmp_path, schedule={"max_steps": 0})
    )  # until the data ends: trains on
    assert (plan.action, plan.message) == ("resume", "resuming step 10")


def test_a_run_whose_data_ended_before_max_steps_is_complete(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4, epoch=1)  # one epoch of 4 steps: every epoch done
    _finish(tmp_path, 4, epoch=1)
    plan = plan_start(_config(tmp_path))
    assert (plan.action, plan.message) == ("complete", f"already complete: 4 steps in {tmp_path}")
    assert (
        plan_start(_config(tmp_path, schedule={"max_steps": 20})).action == "complete"
    )  # no data left
    assert plan_start(_config(tmp_path, schedule={"max_steps": 0})).action == "complete"


def test_a_stopped_run_resumes_whatever_its_steps(tmp_path):
    plan_start(_config(tmp_path))
    _checkpoint(tmp_path, 4)
    (tmp_path / "summary.json").write_text(json.dumps({"step": 4, "epoch": 0, "stopped": True}))
    assert plan_start(_config(tmp_path)).action == "resume"


def test_resume_and_fresh_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="exclude each other"):
        plan_start(_config(tmp_path), resume=True, fresh=True)


def _xtoken_run(config: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), "--no-progress", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_xtoken_run_of_a_finished_run_says_already_complete_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 10)
    _finish(run_dir, 10)
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_dir: {run_dir}\ntrainer:\n  student: {{model: tiny}}\n  schedule: {{max_steps: 10}}\n"
        "  loss:\n    mode: ce\n"
    )
    proc = _xtoken_run(path)
    assert proc.returncode == 0, proc.stderr
    assert "already complete: 10 steps" in proc.stderr
    assert not (run_dir / "logs").exists()  # no process started


def test_xtoken_run_with_pack_toggled_on_a_run_directory_exits_2_naming_the_change(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 4)
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_dir: {run_dir}\ntrainer:\n  student: {{model: tiny}}\n  schedule: {{max_steps: 10}}\n"
        "  loss:\n    mode: ce\n"
    )
    proc = _xtoken_run(path, "--set", "pack=true", "--set", "trainer.optim.lr=0.003")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "another run (pack: False -> True, " in proc.stderr
    assert ", trainer.optim.lr: 0.001 -> 0.003)" in proc.stderr
    assert not (run_dir / "logs").exists()


def test_xtoken_run_of_another_config_on_a_run_directory_exits_2_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    plan_start(_config(run_dir))
    _checkpoint(run_dir, 4)
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {run_dir}\ntrainer:\n  student: {{model: student-25m}}\n")
    proc = _xtoken_run(path)
    assert proc.returncode == 2
    assert "holds a checkpoint (step 4) of another run" in proc.stderr
    assert not (run_dir / "logs").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_xtoken_run_again_after_the_data_ended_says_already_complete_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    flags = ("--set", "trainer.schedule.checkpoint_every=3", "--run-dir", str(run_dir))
    first = _xtoken_run(TINY, *flags, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = json.loads((run_dir / "summary.json").read_text())["step"]
    logs = {p.name: p.read_bytes() for p in (run_dir / "logs").iterdir()}
    # the same run, then one asking for more steps than its one epoch of data holds
    for more in ((), ("--set", f"trainer.schedule.max_steps={steps + 6}")):
        again = _xtoken_run(TINY, *flags, *more)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"already complete: {steps} steps in {run_dir}" in again.stderr
        assert {p.name: p.read_bytes() for p in (run_dir / "logs").iterdir()} == logs
