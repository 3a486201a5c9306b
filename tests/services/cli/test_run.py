"""`xtoken run CONFIG --set KEY=VALUE`: overrides applied to the file and validated exactly like
it (the same messages, exit code 2, nothing started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from services.common.config import ConfigError
from services.common.overrides import parse_override
from services.supervise.config import load_run_config

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny.yaml"


def test_overrides_replace_the_files_values_and_keep_the_rest():
    config = load_run_config(
        TINY,
        [parse_override("trainer.optim.lr=1e-4"), parse_override("trainer.schedule.max_steps=100")],
    )
    assert config.trainer.optim.lr == 1e-4 and config.trainer.schedule.max_steps == 100
    assert config.trainer.feed.grad_accum == 2 and config.trainers == 2  # from the file


@pytest.mark.parametrize(
    ("file_text", "override"),
    [
        ("trainer:\n  optim:\n    lrr: 0.1\n", "trainer.optim.lrr=0.1"),
        ("trainer:\n  feed:\n    micro_batch: 2.5\n", "trainer.feed.micro_batch=2.5"),
        ("trainer:\n  micro_batch: 2\n", "trainer.micro_batch=2"),
        ("trainer:\n  loss:\n    mode: pkll\n", "trainer.loss.mode=pkll"),
        ("trainer:\n  optim: fast\n", "trainer.optim=fast"),
        ("heartbeat_s: 1\nhang_after_s: 1.5\n", "hang_after_s=1.5"),
    ],
    ids=[
        "unknown-key",
        "float-for-int",
        "moved-key",
        "bad-choice",
        "section-not-a-mapping",
        "cross-check",
    ],
)
def test_an_override_is_refused_with_the_message_the_file_gets(tmp_path, file_text, override):
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(file_text)
    with pytest.raises(ConfigError) as from_file:
        load_run_config(bad_file)
    base = tmp_path / "base.yaml"
    base.write_text("heartbeat_s: 1\n" if "hang_after_s" in override else "")
    with pytest.raises(ConfigError) as from_set:
        load_run_config(base, [parse_override(override)])
    assert str(from_set.value) == str(from_file.value)


def _run(tmp_path, capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["run", str(TINY), "--run-dir", str(tmp_path / "r"), *argv])
    return code, capsys.readouterr().err


def test_an_unknown_key_exits_2_in_one_short_line_naming_the_closest_keys_and_where_to_look(
    tmp_path, capsys
):
    code, err = _run(tmp_path, capsys, "--set", "trainer.max_step=10")
    assert code == 2
    assert err == (
        "xtoken run: unknown key 'trainer.max_step': did you mean 'trainer.schedule.max_steps'? "
        "(trainer's keys: services/trainer/config.py, services/supervise/config.py)\n"
    )
    assert not (tmp_path / "r").exists()  # nothing started, nothing written
    code, err = _run(tmp_path, capsys, "--set", "trainr.seed=1")
    assert err == (
        "xtoken run: unknown key 'trainr': did you mean 'trainer' or 'trainers'? "
        "(the keys of RunConfig: services/supervise/config.py, services/common/context.py)\n"
    )


def _xtoken_run(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """``xtoken run examples/tiny.yaml --run-dir tmp/r ARGV`` as a user starts it."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(TINY), "--no-progress",
         "--run-dir", str(tmp_path / "r"), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("data.train=missing.jsonl", "xtoken run: data.train='missing.jsonl' is not a file"),
        ("student_tokenizer=nope", "xtoken run: student_tokenizer: unknown tokenizer 'nope'"),
    ],
    ids=["missing-corpus", "unknown-tokenizer"],
)
def test_a_refused_run_leaves_no_directory_it_created(tmp_path, override, refusal):
    proc = _xtoken_run(tmp_path, "--set", override)
    assert proc.returncode == 2 and refusal in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_held_out_corpus_without_text_is_bad_data_exit_3_naming_the_key(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    proc = _xtoken_run(tmp_path, "--set", f"data.heldout={blank}")
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"xtoken run: data.heldout: corpus '{blank}' has no usable text; point it at a corpus "
        "with text"
    ]
    assert not (tmp_path / "r").exists()


def test_a_refused_run_leaves_a_directory_it_did_not_create_as_it_was(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    proc = _xtoken_run(tmp_path, "--set", "data.train=missing.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["notes.txt"]


def test_a_missing_corpus_is_refused_before_the_run_imports_its_engine_or_tokenizers(tmp_path):
    code = (
        "import sys; from services import cli\n"
        f"code = cli.main(['run', {str(TINY)!r}, '--run-dir', {str(tmp_path / 'r')!r}, "
        "'--set', 'data.train=missing.jsonl'])\n"
        "heavy = ['services.supervise.driver', 'services.trainer.checkpoint', 'transformers',"
        " 'xtoken_core.tokenizers.hf', 'services.launch.local']\n"
        "print(code, [m for m in heavy if m in sys.modules])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert "data.train='missing.jsonl' is not a file" in proc.stderr


def test_check_accepts_a_good_config_and_starts_nothing(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert cli.main(["run", str(TINY), "--run-dir", str(run_dir), "--check"]) == 0
    assert capsys.readouterr().out == (f"xtoken run: {TINY}: the config and its corpora are good\n")
    assert not run_dir.exists()


def test_check_refuses_a_bad_config_as_the_run_would(tmp_path, capsys):
    argv = ["run", str(TINY), "--run-dir", str(tmp_path / "r"), "--check"]
    assert cli.main([*argv, "--set", "data.train=missing.jsonl"]) == 2
    assert "data.train='missing.jsonl' is not a file" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_bad_value_exits_2_naming_the_key_the_type_and_the_value(tmp_path, capsys):
    code, err = _run(tmp_path, capsys, "--set", "trainer.schedule.max_steps=many")
    assert code == 2
    assert err == "xtoken run: trainer.schedule.max_steps: expected int, got 'many' (str)\n"


def test_a_set_without_a_value_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, capsys, "--set", "trainer.schedule.max_steps")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --set: 'trainer.schedule.max_steps': write KEY=VALUE" in err


def test_the_global_log_level_is_accepted_after_the_config(tmp_path, capsys):
    args = cli.build_parser().parse_args(
        ["run", str(TINY), "--set", "trainer.schedule.max_steps=1", "--log-level", "DEBUG"]
    )
    assert args.log_level == "DEBUG" and args.overrides[0].value == 1


def test_the_closing_report_names_teacher_0_as_the_one_that_evaluated_the_held_out_text(tmp_path):
    from services.cli.run import format_report, report

    (tmp_path / "metrics").mkdir()
    (tmp_path / "summary.json").write_text(
        '{"step": 6, "student_before": {"bits_per_byte": 4.0}, '
        '"student_after": {"bits_per_byte": 3.5}}'
    )
    eval_record = '{{"event": "eval", "who": "teacher", "bits_per_byte": {}}}\n'
    (tmp_path / "metrics" / "teacher.group0.jsonl").write_text(eval_record.format(3.25))
    (tmp_path / "metrics" / "t1.teacher.group0.jsonl").write_text(eval_record.format(9.0))
    table = report(tmp_path)
    assert table["teacher"] == 3.25  # teacher 0's figure, never a further teacher's
    two = format_report(table, "r", teachers=2).splitlines()
    assert two[1].split() == ["teacher", "0", "3.2500"]
    assert [line.split()[0] for line in two[2:]] == ["student", "student"]
    assert format_report(table, "r").splitlines()[1].split() == ["teacher", "3.2500"]
