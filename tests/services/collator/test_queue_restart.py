"""The queue server SIGKILLed and restarted under a running collator and a registered consumer
(a claim/ack loop): the collator re-puts what the new instance lacks and exits 0, the old
instance's leases are dead (their acks are a typed error), and every text arrives at least once,
exactly once per instance (memory-only queue: across a restart, delivery is at least once)."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess

import pytest

from services.queue.client import QueueClient
from services.queue.errors import StaleEpochError
from tests.services.collator.conftest import ROOT, collator_cmd
from tests.services.queue.conftest import ServerProcess
from xtoken_core.data.corpus import iter_texts

PARTITION = "train"
CLAIM_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 20.0  # no sample for this long: the consumer stops


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~2,900 texts (the demo corpus three times): a few seconds of collation."""
    from xtoken_core.data.corpus import build_demo_corpus

    tmp = tmp_path_factory.mktemp("restart")
    lines = build_demo_corpus(tmp / "demo", max_files=60).train_path.read_text().splitlines()
    path = tmp / "corpus.jsonl"
    path.write_text("\n".join(lines * 3) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_queue_sigkilled_and_restarted_under_a_collator_and_a_consumer(tmp_path, corpus):
    keys = {k for k, _ in iter_texts(str(corpus))}
    address = f"tcp://127.0.0.1:{free_port()}"
    servers = [ServerProcess(tmp_path, "--bind", address, "--capacity", "256MiB")]
    summary_path = tmp_path / "summary.json"
    collator = subprocess.Popen(
        collator_cmd(address, corpus, PARTITION, "--batch", "8", "--queue-timeout-s", "2")
        + ["--put-timeout-s", "2", "--summary-json", str(summary_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    got: dict[str, list[str]] = collections.defaultdict(list)  # instance -> keys, in order
    stale_acks = 0
    probe = None
    client = QueueClient(address, timeout_s=2, retries=6)
    try:
        idle_s = 0.0
        while idle_s < IDLE_TIMEOUT_S:
            lease = client.claim(
                PARTITION, "trainer", ["input_ids"], 16, timeout_s=CLAIM_TIMEOUT_S, register=True
            )
            if not lease["keys"]:
                idle_s += CLAIM_TIMEOUT_S
                continue
            idle_s = 0.0
            got[lease["epoch"]].extend(lease["keys"])
            try:
                client.ack(PARTITION, "trainer", lease["lease_id"])
            except StaleEpochError:
                stale_acks += 1
            if len(servers) == 1 and len(got[lease["epoch"]]) >= 400:
                probe = client.claim(PARTITION, "probe", ["input_ids"], 1, lease_s=600)
                os.kill(servers[0].proc.pid, signal.SIGKILL)
                servers[0].proc.wait(10)
                servers.append(ServerProcess(tmp_path, "--bind", address))
            if len(servers) == 2 and collator.poll() is not None:
                if keys <= {k for ks in got.values() for k in ks}:
                    break
        out = collator.communicate(timeout=120)[0]
        assert collator.returncode == 0, out
        assert probe is not None and probe["keys"]
        with pytest.raises(StaleEpochError):  # a lease of the killed instance: typed error
            client.ack(PARTITION, "probe", probe["lease_id"])
    finally:
        client.close()
        if collator.poll() is None:
            collator.kill()
            collator.wait(10)
        for srv in servers:
            srv.stop()
    summary = json.loads(summary_path.read_text())
    assert summary["restarts"] == 1 and summary["replayed"] > 0, summary
    assert len(got) == 2, list(got)
    old, new = list(got.values())
    assert len(new) == len(set(new)) and len(old) == len(set(old))  # once per instance
    assert set(old) | set(new) == keys  # every text arrived
    assert set(new) - set(old) == keys - set(old)
    print(
        f"{len(keys)} texts: {len(old)} consumed before the kill, {len(new)} after "
        f"({len(set(old) & set(new))} of them again), {summary['replayed']} re-put by the "
        f"collator, {stale_acks} stale acks"
    )
