"""`xtoken queue`: size parsing, `stats` table and JSON against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from services import cli
from services.common.lifecycle import read_ready
from services.queue import cli as queue_cli
from services.queue.cli import format_stats
from services.queue.client import QueueClient
from services.queue.config import format_size, parse_size
from tests.services.queue.conftest import ROOT


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("1e9", 10**9),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        ("1.5KiB", 1536),
        ("16 kib", 16384),
    ],
)
def test_parse_size_understands_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "8XB", "0", "-1GiB"])
def test_parse_size_rejects_nonsense_naming_the_format(text):
    with pytest.raises(ValueError, match="512MiB|must be > 0"):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (119.5 * 2**20, "119.5 MiB"),
        (2**31, "2.0 GiB"),
    ],
)
def test_format_size_prints_binary_units(nbytes, text):
    assert format_size(nbytes) == text
    assert nbytes < 1024 or parse_size(text.replace(" ", "")) == pytest.approx(nbytes, rel=0.05)


def test_bad_capacity_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["queue", "serve", "--capacity", "lots"])
    assert exc.value.code == 2 and "512MiB" in capsys.readouterr().err


def test_stats_command_prints_json_and_a_table(server):
    with QueueClient(server.address) as client:
        client.put("cli-part", ["a", "b"], {"x": torch.zeros(2, 8)})
        lease = client.claim("cli-part", "trainer", ["x"], 1)
        client.ack("cli-part", "trainer", lease["lease_id"])
    cmd = [sys.executable, "-m", "services.cli", "queue", "stats", "--queue", server.address]
    proc = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    part = stats["partitions"]["cli-part"]
    assert part["samples"] == 2 and part["tasks"]["trainer"]["consumed"] == 1
    table = format_stats(stats)
    row = next(line for line in table.splitlines() if line.startswith("cli-part"))
    assert row.split()[1:] == ["2", *format_size(part["bytes"]).split(), "trainer", "1", "0"]
    pool = next(line for line in table.splitlines() if line.startswith("shm pool"))
    assert pool.split()[2:4] == [str(stats["shm_pool"]["segments"]), "segments"]


def test_stats_command_fails_cleanly_without_a_server(capsys):
    args = cli.build_parser().parse_args(
        ["queue", "stats", "--queue", "tcp://127.0.0.1:1", "--timeout-s", "0.3"]
    )
    assert queue_cli.run(args) == 1
    assert "timeout" in capsys.readouterr().err


def test_serve_announces_a_json_ready_record_and_removes_it_after_sigterm(make_server):
    srv = make_server()
    assert read_ready(srv.ready_path) == {
        "pid": srv.proc.pid,
        "name": "queue",
        "endpoint": srv.address,
    }
    assert srv.terminate() == 0
    assert not srv.ready_path.exists()
    assert "[queue] stopped (SIGTERM), exit code 0" in srv.log()


def test_serve_reads_its_section_file_and_binds_the_run_context_queue(tmp_path):
    address = f"ipc://{tmp_path}/q.sock"
    context = tmp_path / "context.json"
    context.write_text(
        json.dumps(
            {
                "queue": address,
                "partition": "p",
                "student_tokenizer": "s",
                "teacher_tokenizer": "t",
                "run_dir": str(tmp_path),
            }
        )
    )
    section = tmp_path / "queue.json"
    section.write_text(json.dumps({"capacity_bytes": "64MiB", "heartbeat_s": 0}))
    ready = tmp_path / "ready"
    cmd = ["queue", "serve", "--config", str(section), "--context", str(context)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *cmd, "--ready-file", str(ready)], cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        assert read_ready(ready)["endpoint"] == address
        with QueueClient(address, timeout_s=10) as client:
            assert client.stats()["capacity_bytes"] == 64 * 2**20
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


def test_a_bad_key_in_the_queue_section_exits_two_naming_key_and_file(tmp_path):
    section = tmp_path / "queue.json"
    section.write_text(json.dumps({"capacity": "64MiB"}))
    proc = _xtoken("queue", "serve", "--config", str(section))
    assert proc.returncode == 2, proc.stderr
    assert "unknown key 'capacity'" in proc.stderr and "capacity_bytes" in proc.stderr
    assert str(section) in proc.stderr and "Traceback" not in proc.stderr


def test_serve_with_bad_settings_exits_two_with_the_message_only():
    cmd = [sys.executable, "-m", "services.cli", "queue", "serve", "--lease-s", "-1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "[queue] error: lease_s=-1.0: must be > 0 (--lease-s)" in proc.stderr
    assert "Traceback" not in proc.stderr


def _xtoken(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_on_a_port_in_use_says_so_and_names_the_flag():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        proc = _xtoken("queue", "serve", "--bind", address)
    assert proc.returncode == 2, proc.stderr  # a bad setting
    assert "already in use" in proc.stderr and "--bind" in proc.stderr, proc.stderr
    assert address in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("queue", "serve", "--bind", "127.0.0.1:5555"), "--bind"),
        (("queue", "stats", "--queue", "127.0.0.1:5555"), "--queue"),
        (("queue", "stats", "--queue", "tcp://127.0.0.1"), "--queue"),
    ],
)
def test_an_address_without_scheme_or_port_is_a_usage_error_naming_the_flag(args, flag):
    proc = _xtoken(*args)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "tcp://" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_stats_timeout_names_the_timeout_flag():
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _xtoken("queue", "stats", "--queue", f"tcp://127.0.0.1:{port}", "--timeout-s", "0.3")
    assert proc.returncode == 1, proc.stderr
    assert "--timeout-s" in proc.stderr, proc.stderr
    assert "timeout_s" not in proc.stderr and "retries" not in proc.stderr, proc.stderr


def test_stats_into_a_closed_pipe_exits_quietly(server):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "queue",
            "stats",
            "--queue",
            server.address,
            "--json",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head` that has read enough
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err  # 128 + SIGPIPE, what a shell reports for `cat | head`
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err
