"""Collator progress lines: fraction read, ETA and the state (tokenizers, full or gone queue)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time

import pytest

from services.collator.progress import CorpusProgress, Eta, count_units, format_duration
from tests.services.collator.conftest import ROOT, collator_cmd
from tests.services.queue.conftest import ServerProcess


def test_units_are_lines_with_or_without_a_final_newline(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("1\n2\n3\n", encoding="utf-8")
    b.write_text("1\n\n3", encoding="utf-8")
    assert count_units(a) == 3 and count_units(b) == 3


def test_progress_is_the_line_of_the_last_key_over_all_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("x\n" * 30, encoding="utf-8")
    b.write_text("x\n" * 10, encoding="utf-8")
    progress = CorpusProgress([a, b])
    deadline = time.monotonic() + 5
    while progress.fraction() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    progress.seen(0, "3f2a9c1b7d4e/a.jsonl:10")
    assert progress.fraction() == pytest.approx(0.25)
    progress.seen(1, "3f2a9c1b7d4e/b.jsonl:10")
    assert progress.fraction() == 1.0 and progress.total == 40


def test_eta_counts_from_the_first_ready_worker():
    eta = Eta()
    assert eta.left_s(0.5, now=10.0) is None
    eta.begin(0.1, now=10.0)
    assert eta.left_s(0.3, now=20.0) == pytest.approx(35.0)  # 0.2 in 10 s, 0.7 left
    assert [format_duration(s) for s in (45, 192, 7500)] == ["45s", "3m12s", "2h05m"]


class _Lines:
    """Collect a process's stderr lines in a thread; wait for one containing a text."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(stream), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} in {timeout}s:\n{''.join(self.lines)}")


@pytest.fixture
def small_queue(tmp_path):
    """A queue of ~4 samples that nobody consumes: puts park once it is full."""
    srv = ServerProcess(tmp_path, "--capacity", "96KiB", "--shm-pool-free", "0")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_progress_lines_name_tokenizers_a_full_queue_and_an_unreachable_one(
    small_queue, corpus_slice
):
    srv = small_queue
    cmd = collator_cmd(
        srv.address, corpus_slice, "progress", "--batch", "1", "--put-timeout-s", "120"
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines = _Lines(proc.stderr)
        lines.wait_for("loading tokenizers")
        line = lines.wait_for("blocked on a full queue")
        assert "% done" in line and "KiB" in line and "--capacity" in line
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            lines.wait_for("queue unreachable", timeout=30)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_progress_line_shows_the_fraction_done(queue_server, corpus_slice):
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(
            collator_cmd(queue_server.address, corpus_slice, "progress-pct"),
            cwd=ROOT,
            stderr=err,
            timeout=120,
        )
        err.seek(0)
        log = err.read()
    assert proc.returncode == 0, log
    assert "loading tokenizers" in log and "% done" in log, log


def test_rows_of_a_hugging_face_dataset_are_its_units(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(7)]}).save_to_disk(str(tmp_path))
    files = sorted(tmp_path.glob("*.arrow"))
    assert sum(count_units(f) for f in files) == 7
