"""A corpus ten times the queue's capacity flows through a collator and a registered consumer
exactly once, with the queue server's memory flat; a rerun of the collator puts nothing again."""

from __future__ import annotations

import json
import pathlib
import subprocess
import threading
import time

import pytest

from services.queue.client import QueueClient
from tests.services.collator.conftest import ROOT, collator_cmd, run_collator
from tests.services.queue.conftest import ServerProcess

CAPACITY = 1 << 20


def rss_bytes(pid: int) -> int:
    """Resident set of a process (anonymous + file + shared memory pages), from /proc."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> pathlib.Path:
    """About 960 texts: ~11 MB of samples at the test contexts, ~10x CAPACITY."""
    from xtoken_core.data.corpus import build_demo_corpus

    corpus = build_demo_corpus(tmp_path_factory.mktemp("big") / "demo", max_files=60)
    return corpus.train_path


@pytest.mark.slow
def test_a_corpus_ten_times_the_capacity_flows_through_once_with_flat_server_memory(
    tmp_path, big_corpus
):
    srv = ServerProcess(tmp_path, "--capacity", str(CAPACITY))
    try:
        texts = len(big_corpus.read_text(encoding="utf-8").splitlines())
        summary_path = tmp_path / "summary.json"
        collator = subprocess.Popen(
            collator_cmd(
                srv.address, big_corpus, "big", "--batch", "16", "--summary-json", str(summary_path)
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        got: list[str] = []
        rss: list[tuple[int, int]] = []  # (samples consumed, server RSS)
        done = threading.Event()

        def sample_rss():
            while not done.is_set():
                rss.append((len(got), rss_bytes(srv.proc.pid)))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample_rss)
        sampler.start()
        deadline = time.monotonic() + 300
        try:
            with QueueClient(srv.address, timeout_s=10) as client:
                while time.monotonic() < deadline:
                    reply = client.claim(
                        "big", "trainer", ["input_ids"], 32, timeout_s=0.5, register=True
                    )
                    if reply["keys"]:
                        got.extend(reply["keys"])
                        client.ack("big", "trainer", reply["lease_id"])
                    elif collator.poll() is not None:
                        break
                stats = client.stats()
        finally:
            done.set()
            sampler.join()
            out = collator.communicate(timeout=60)[0]
        assert collator.returncode == 0, out
        summary = json.loads(summary_path.read_text())
        assert summary["nbytes"] >= 9 * CAPACITY, summary  # the corpus is ~10x the capacity
        assert len(got) == len(set(got)) == texts == summary["written"]
        assert stats["partitions"]["big"]["dropped"] == texts and stats["bytes_used"] == 0

        # flat: after the first tenth of the corpus, the server's RSS grows by less than the
        # capacity, while the corpus that went through it is ~10x the capacity
        warm = [r for n, r in rss if n >= texts // 10]
        growth = max(warm) - warm[0]
        print(
            f"server RSS over {summary['nbytes'] / 1e6:.1f} MB through a {CAPACITY >> 20} MiB "
            f"queue: {warm[0] / 2**20:.1f} MiB after the first tenth, max "
            f"{max(warm) / 2**20:.1f} MiB, end {warm[-1] / 2**20:.1f} MiB"
        )
        assert growth < CAPACITY, f"server RSS grew {growth} bytes: {rss[::20]}"

        # a rerun of the collator re-puts nothing: every key is refused as consumed
        proc, again = run_collator(srv.address, big_corpus, "big", "--batch", "64")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert again["consumed"] == texts and again["written"] == 0
        with QueueClient(srv.address, timeout_s=10) as client:
            assert client.claim("big", "trainer", ["input_ids"], 8, timeout_s=0.2)["keys"] == []
    finally:
        srv.stop()
