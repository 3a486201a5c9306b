"""`xtoken trainer` refuses bad input with exit code 2 and a message, fast (no hang)."""

from __future__ import annotations

from tests.services.teacher.test_cli import closed_port, run_cli


def _trainer(address: str, *extra: str):
    return run_cli(
        "trainer", "--queue", address, "--student.model", "tiny", "--student-tokenizer", "mistral",
        "--loss.mode", "ce", *extra,
    )  # fmt: skip


def test_an_unreachable_queue_exits_2_naming_the_address_and_the_setting(tmp_path):
    address = f"tcp://127.0.0.1:{closed_port()}"
    proc, seconds = _trainer(address, "--feed.queue-timeout-s", "1", "--run-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert f"queue {address} is unreachable: no reply within 1s" in proc.stderr
    assert "--feed.queue-timeout-s" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert seconds < 30  # imports + one second, not a hang


def test_a_held_out_file_without_text_exits_3_before_touching_the_queue(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    address = f"tcp://127.0.0.1:{closed_port()}"
    proc, _ = _trainer(address, "--feed.queue-timeout-s", "30", "--eval.heldout", str(blank))
    assert proc.returncode == 3, proc.stderr
    assert f"held-out corpus '{blank}' has no usable text" in proc.stderr
    assert "unreachable" not in proc.stderr


def test_a_pkl_trainer_without_a_projection_exits_2_naming_the_fix():
    proc, _ = run_cli("trainer", "--loss.mode", "pkl")
    assert proc.returncode == 2
    assert "loss.mode=pkl needs loss.projection" in proc.stderr


def test_a_config_file_with_a_moved_key_exits_2_naming_its_new_key(tmp_path):
    path = tmp_path / "trainer.json"
    path.write_text('{"student": "tiny", "loss": {"mode": "ce"}}')
    proc, _ = run_cli("trainer", "--config", str(path))
    assert proc.returncode == 2
    assert "error: student moved to student.model" in proc.stderr
    assert "Traceback" not in proc.stderr
