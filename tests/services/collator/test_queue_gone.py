"""A collator whose queue died exits within 5 s of a SIGTERM, with the stopped exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from services.queue.client import QueueClient
from tests.services.collator.conftest import collator_cmd
from tests.services.queue.conftest import ROOT, ServerProcess

EXIT_STOPPED = 4


def test_sigterm_stops_a_collator_whose_queue_is_gone_within_five_seconds(tmp_path, corpus_slice):
    server = ServerProcess(tmp_path, "--capacity", "256MiB")
    cmd = collator_cmd(server.address, corpus_slice, "gone", "--workers", "1", "--batch", "1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 90
        with QueueClient(server.address, timeout_s=10) as client:
            while not client.list("gone")["keys"]:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "collator put nothing in 90 s"
                time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        time.sleep(0.5)  # the workers' next puts go nowhere
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
    assert took < 5.0, f"took {took:.1f}s: {err[-2000:]}"
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
