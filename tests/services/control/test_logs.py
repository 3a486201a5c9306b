"""A process's log as the API serves it: its last lines read from the file's end in bounded memory,
what was appended since in bounded chunks, and both off the event loop (/healthz answers while a
log is read)."""

from __future__ import annotations

import threading
import tracemalloc

import httpx
import pytest

from services.control import logs
from tests.services.control.conftest import serve_app, tiny_config


def _write(path, text: str) -> None:
    path.write_bytes(text.encode())


@pytest.mark.parametrize(
    ("text", "lines", "expected"),
    [
        ("a\nb\nc\n", 2, "b\nc\n"),
        ("a\nb\nc", 2, "b\nc\n"),
        ("a\nb\n", 5, "a\nb\n"),
        ("a\n\n\nb\n", 3, "\n\nb\n"),
        ("", 3, ""),
        ("only\n", 1, "only\n"),
    ],
    ids=["newline-end", "no-newline-end", "fewer-than-asked", "blank-lines", "empty", "one"],
)
def test_the_tail_is_the_last_lines_of_the_log(tmp_path, text, lines, expected):
    path = tmp_path / "x.log"
    _write(path, text)
    data, end = logs.tail(path, lines)
    assert data.decode() == expected
    assert end == len(text.encode())


def test_the_tail_of_a_log_that_is_not_there_is_empty(tmp_path):
    assert logs.tail(tmp_path / "missing.log", 10) == (b"", 0)


def test_the_last_lines_of_a_large_log_are_read_from_its_end_in_bounded_memory(tmp_path):
    path = tmp_path / "big.log"
    with open(path, "wb") as fh:  # 64 MiB, sparse: no disk, but a whole read would hold it all
        fh.truncate(64 << 20)
        fh.seek(0, 2)
        fh.write(b"".join(b"line %d\n" % i for i in range(100)))
    tracemalloc.start()
    try:
        data, _ = logs.tail(path, 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.decode().splitlines() == [f"line {i}" for i in range(90, 100)]
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB held to read 10 lines"


def test_a_tail_past_its_byte_budget_starts_on_a_whole_line(tmp_path):
    path = tmp_path / "wide.log"
    _write(path, "".join(f"{i:04d}" + "x" * 95 + "\n" for i in range(1000)))  # 100 bytes a line
    data, _ = logs.tail(path, 1000, max_bytes=1050)
    got = data.decode().splitlines()
    assert got == [f"{i:04d}" + "x" * 95 for i in range(990, 1000)]


def test_following_reads_what_was_appended_in_bounded_chunks(tmp_path):
    path = tmp_path / "grow.log"
    _write(path, "old\n")
    _, pos = logs.tail(path, 5)
    with open(path, "ab") as fh:
        fh.write(b"n" * 2500)
    chunks = []
    while True:
        chunk, pos = logs.read_new(path, pos, max_bytes=1000)
        if not chunk:
            break
        chunks.append(chunk)
    assert [len(c) for c in chunks] == [1000, 1000, 500]
    assert logs.read_new(tmp_path / "missing.log", 0) == (b"", 0)


def test_healthz_answers_while_a_log_is_being_read(make, tmp_path, monkeypatch):
    from services.control.app import create_app
    from services.control.settings import Settings

    sup = make({})
    run_dir = tmp_path / "runs" / "r1"
    sup.store.create_run("r1", "r1", {**tiny_config(), "run_dir": str(run_dir)}, str(run_dir))
    sup.store.put_process("r1", "trainer0", role="trainer", host="h", state="exited")
    reading, release = threading.Event(), threading.Event()

    def slow_tail(path, lines, max_bytes=logs.TAIL_MAX_BYTES):
        reading.set()
        release.wait(30)  # a log on a slow disk, or a huge one read whole
        return b"the tail\n", 9

    monkeypatch.setattr(logs, "tail", slow_tail)
    settings = Settings(runs_root=tmp_path / "runs", data_root=[tmp_path / "data"])
    with serve_app(create_app(settings, supervisor=sup)) as url, httpx.Client(
        base_url=url, timeout=30
    ) as c:
        reply: dict = {}
        reader = threading.Thread(
            target=lambda: reply.update(
                r=c.get("/v1/runs/r1/logs", params={"process": "trainer0"})
            )
        )
        reader.start()
        try:
            assert reading.wait(30)
            health = c.get("/healthz", timeout=10)  # only a stuck event loop makes this fail
            assert health.status_code == 200
        finally:
            release.set()
            reader.join(30)
    assert reply["r"].status_code == 200 and reply["r"].text == "the tail\n"
