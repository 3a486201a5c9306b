"""The durable log's writer process: it dies with its server, it and its server lock the data
directory, the server stops when it dies, a SIGTERM drains it in time, and logs written before
it existed still replay."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from services.queue.client import QueueClient
from services.queue.durable import DurableLog, log_files
from tests.services.queue.conftest import ServerProcess
from tests.services.queue.durable_logs import open_log
from xtoken_core.wire import JaggedColumn

# A log written by the writer thread of 17fce79 (register, put of 2 samples, ack, clear).
THREAD_ERA_LOG = base64.b64decode(
    "WFRLUUxPRzFYVEtS3zjHbUgAAAAAAAAAAgAAABAAAAAAAAAAJAAAAAAAAABYVEtXAQACAAAAAAAAAAAAg6JvcKhyZWdp"
    "c3RlcqlwYXJ0aXRpb26hcKR0YXNrpXRyYWluWFRLUmwuJVapAAAAAAAAAAIAAAAQAAAAAAAAAIUAAAAAAAAAWFRLVwEA"
    "AgAAAAAAAAAAAISib3CjcHV0qXBhcnRpdGlvbqFwpGtleXOSomswomsxpmZpZWxkc4GjaWRzx1YClqVpbnQ2NJACBsQw"
    "AAAAAAAAAAABAAAAAAAAAAIAAAAAAAAACgAAAAAAAAALAAAAAAAAAAwAAAAAAAAAxBgAAAAAAAAAAAMAAAAAAAAABgAA"
    "AAAAAABYVEtSHO24WkwAAAAAAAAAAgAAABAAAAAAAAAAKAAAAAAAAABYVEtXAQACAAAAAAAAAAAAhKJvcKNhY2upcGFy"
    "dGl0aW9uoXCkdGFza6V0cmFpbqRrZXlzkaJrMFhUS1LuSmjkQAAAAAAAAAACAAAAEAAAAAAAAAAcAAAAAAAAAFhUS1cB"
    "AAIAAAAAAAAAAACDom9wpWNsZWFyqXBhcnRpdGlvbqFxpGtleXPA"
)


def ids(keys):
    return {"ids": JaggedColumn.from_rows([torch.arange(5) + int(k[1:]) for k in keys])}


def gone(pid: int) -> bool:
    """The process exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def writer_pid(server: ServerProcess) -> int:
    return int(re.search(r"log writer pid (\d+)", server.log()).group(1))


def test_the_writer_dies_with_a_sigkilled_server(tmp_path):
    server = ServerProcess(tmp_path, "--data-dir", str(tmp_path / "data"))
    try:
        pid = writer_pid(server)
        assert not gone(pid)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert wait_for(lambda: gone(pid), 5)
    finally:
        server.stop()


def test_the_writer_exits_when_the_server_end_of_its_liveness_pair_closes(tmp_path):
    # what ends it where PR_SET_PDEATHSIG does not exist (or its parent thread lives on)
    log, _ = open_log(tmp_path)
    pid = log.writer_pid
    log._live.close()
    assert wait_for(lambda: log._proc.poll() is not None, 5)
    assert log._proc.returncode == 0
    log._live = None
    log.close()  # finds it gone
    assert "exited (exit code 0)" in str(log.error)
    assert gone(pid)


def test_sigterm_drains_the_log_and_exits_within_5s(tmp_path):
    args = ("--data-dir", str(tmp_path / "data"), "--fsync", "never")
    server = ServerProcess(tmp_path, *args)
    pid = writer_pid(server)
    keys = [f"k{i}" for i in range(64)]
    big = {"ids": JaggedColumn.from_rows([torch.arange(50_000) + i for i in range(64)])}
    with QueueClient(server.address, timeout_s=30) as c:
        for r in range(4):  # 100 MB, answered before written (--log-lag 256 MiB)
            c.put(f"p{r}", keys, big)
    t0 = time.monotonic()
    assert server.terminate(timeout=10) == 0
    assert time.monotonic() - t0 < 5
    assert gone(pid)
    server.stop()
    again = ServerProcess(tmp_path, *args)
    try:
        with QueueClient(again.address, timeout_s=30) as c:
            assert c.stats()["samples"] == 4 * 64
    finally:
        again.stop()


def test_a_server_stops_when_its_writer_dies(tmp_path):
    server = ServerProcess(tmp_path, "--data-dir", str(tmp_path / "data"))
    try:
        with QueueClient(server.address, timeout_s=5, retries=0) as c:
            c.put("p", ["k1"], ids(["k1"]))
            c.clear("other")  # answered once written: the put before it is written too
            pid = writer_pid(server)
            os.kill(pid, signal.SIGKILL)
            assert server.proc.wait(10) == 1
        log = server.log()
        assert f"the log writer (pid {pid}) exited (killed by SIGKILL)" in log
        assert "changes not written are not answered" in log
    finally:
        server.stop()
    again = ServerProcess(tmp_path, "--data-dir", str(tmp_path / "data"))
    try:
        with QueueClient(again.address, timeout_s=5) as c:
            assert c.list("p")["keys"] == ["k1"]
    finally:
        again.stop()


def test_a_server_refuses_a_data_dir_another_process_locks(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'writer {os.getpid()}\\n'.encode())\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
            str(data / "lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not start") as e:
            ServerProcess(tmp_path, "--data-dir", str(data))
        assert time.monotonic() - t0 >= 5  # it waited for the lock first
        message = str(e.value)
        assert f"is held by pid {holder.pid} (the log writer of a queue server, running)" in message
        assert "stop that process or use another --data-dir" in message
        assert log_files(str(data)) == []  # nothing replayed, nothing created
    finally:
        holder.kill()
        holder.wait()


def test_a_second_log_on_a_directory_in_use_fails_naming_both_holders(tmp_path):
    first, _ = open_log(tmp_path)
    try:
        with pytest.raises(ValueError, match="is in use") as e:
            DurableLog(str(tmp_path), lock_wait_s=0.2).replay(lambda b: None)
        assert f"pid {os.getpid()} (a queue server, running)" in str(e.value)
        assert f"pid {first.writer_pid} (the log writer of a queue server, running)" in str(e.value)
    finally:
        first.close()
    second, _ = open_log(tmp_path, lock_wait_s=0.2)  # released by the close
    second.close()


def test_the_writer_alone_keeps_the_directory_locked(tmp_path):
    log, _ = open_log(tmp_path)
    try:
        log._lock.release()  # as if the server were gone and its writer were not
        with pytest.raises(ValueError, match="is in use"):
            DurableLog(str(tmp_path), lock_wait_s=0.2).replay(lambda b: None)
    finally:
        log.close()
    again, _ = open_log(tmp_path, lock_wait_s=0.2)  # the writer exited: free
    again.close()


def test_a_dead_writer_fails_the_log_loudly(tmp_path):
    log, _ = open_log(tmp_path)
    seq = log.append("register", {"partition": "p", "task": "a"})
    os.kill(log.writer_pid, signal.SIGKILL)
    assert wait_for(lambda: log.poll() or log.error is not None, 5)
    assert "killed by SIGKILL" in str(log.error)
    with pytest.raises(RuntimeError, match="failed"):
        log.append("register", {"partition": "p", "task": "b"})
    log.close()
    assert log.written <= seq


def test_an_append_after_the_writer_died_fails_instead_of_blocking(tmp_path):
    log, _ = open_log(tmp_path)
    os.kill(log.writer_pid, signal.SIGKILL)
    log._proc.wait()
    time.sleep(0.2)  # zmq notices the closed connection
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        log.append("register", {"partition": "p", "task": "a"})
    log.close()


def test_a_log_of_the_writer_thread_era_replays(tmp_path):
    (tmp_path / f"log.{1:016d}").write_bytes(THREAD_ERA_LOG)
    log, bodies = open_log(tmp_path)
    assert [b["op"] for b in bodies] == ["register", "put", "ack", "clear"]
    assert bodies[1]["keys"] == ["k0", "k1"]
    assert bodies[1]["fields"]["ids"].values.tolist() == [0, 1, 2, 10, 11, 12]
    seq = log.append("register", {"partition": "p", "task": "b"})
    log.close()
    assert log.written == seq
    log, bodies = open_log(tmp_path)
    log.close()
    assert [b["op"] for b in bodies] == ["register", "put", "ack", "clear", "register"]
