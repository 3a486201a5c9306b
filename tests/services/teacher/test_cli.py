"""`xtoken teacher` refuses bad input with exit code 2 and a message, fast (no hang)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def closed_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    return proc, time.monotonic() - start


def test_an_unreachable_queue_exits_2_naming_the_address_and_the_setting():
    address = f"tcp://127.0.0.1:{closed_port()}"
    proc, seconds = run_cli(
        "teacher", "--queue", address, "--queue-timeout-s", "1", "--model", "tiny",
        "--tokenizer", "smollm2",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"queue {address} is unreachable: no reply within 1s" in proc.stderr
    assert "--queue-timeout-s" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert seconds < 30  # imports + one second, not a hang


def test_a_held_out_file_without_text_exits_3_before_touching_the_queue(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    address = f"tcp://127.0.0.1:{closed_port()}"
    proc, _ = run_cli(
        "teacher", "--queue", address, "--queue-timeout-s", "30", "--heldout", str(blank),
        "--model", "tiny", "--tokenizer", "smollm2",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert f"held-out corpus '{blank}' has no usable text" in proc.stderr
    assert "unreachable" not in proc.stderr


def test_a_bad_flag_value_exits_2_naming_it():
    proc, _ = run_cli("teacher", "--slots", "1", "--model", "tiny")
    assert proc.returncode == 2
    assert "slots=1: the ring needs >= 2 slots" in proc.stderr


def test_a_negative_teacher_index_exits_2_naming_it():
    proc, _ = run_cli("teacher", "--teacher", "-1", "--model", "tiny")
    assert proc.returncode == 2
    assert "teacher=-1: must be an int >= 0" in proc.stderr


def test_each_teachers_groups_have_names_of_their_own():
    from services.teacher.config import teacher_name

    assert [teacher_name(0, 1), teacher_name(1, 0), teacher_name(2, 3)] == [
        "teacher1", "t1.teacher0", "t2.teacher3"
    ]  # fmt: skip
