"""The rollout process with real subprocesses (a queue and the rollout; the test publishes as the
trainer does): a weights descriptor damaged mid-run is waited out, the process lives on and
samples with the next publication; a rollout stopped while its queue dies returns at once."""

from __future__ import annotations

import signal
import threading
import time
import types

import pytest
import torch

from services.common.metrics import read_jsonl
from services.queue.client import QueueClient
from services.rollout import main as rollout_main
from services.rollout.config import RolloutConfig
from tests.e2e.conftest import (
    STUDENT_TOKENIZER,
    TEACHER_TOKENIZER,
    corpus_parts,
    demo,  # noqa: F401 (fixture)
    free_port,
    procs,  # noqa: F401 (fixture)
    wait_for,
    write_config,
)
from tests.services.queue.conftest import ServerProcess, stop_with_queue
from xtoken_core.ipc.policy_weights import DESCRIPTOR, WeightPublisher

# msgpack's map whose first key is a str of 2 bytes that are no UTF-8 (0xb6 0xb6)
DAMAGED = b"\x82\xa2\xb6\xb6\x01\xa6format\x01"


@pytest.mark.slow  # a queue and a rollout process: ~20-50 s on two cores
@pytest.mark.timeout(180)
def test_a_damaged_descriptor_mid_run_is_waited_out_and_the_next_publication_is_sampled_with(
    procs,  # noqa: F811 (fixture)
    tmp_path,
    demo,  # noqa: F811 (fixture)
):
    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    queue = f"tcp://127.0.0.1:{free_port()}"
    procs.start("queue", ["queue", "serve", "--bind", queue, "--capacity", "256MiB"]).wait_ready(60)
    paths, _ = corpus_parts(demo, tmp_path / "data", n=12, parts=1)
    config = RolloutConfig(
        queue=queue,
        partition="train",
        student="tiny",
        student_tokenizer=STUDENT_TOKENIZER,
        teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=64,
        ctx_teacher=64,
        weights=str(tmp_path / "policy"),
        prompts=str(paths[0]),
        prompt_tokens=8,
        max_new_tokens=8,
        batch=2,
        max_pending=1000,
        poll_s=0.05,
    )
    run_dir = tmp_path / "run"
    argv = ["rollout", "--config", str(write_config(tmp_path / "rollout.json", config)),
            "--run-dir", str(run_dir)]  # fmt: skip
    metrics = run_dir / "metrics" / "rollout0.jsonl"
    model = load_model("tiny", vocab_size=load_tokenizer(STUDENT_TOKENIZER).vocab_size, seed=3)
    descriptor = tmp_path / "policy" / DESCRIPTOR

    def versions() -> set[int]:
        return {r["version"] for r in read_jsonl(metrics)} if metrics.exists() else set()

    with WeightPublisher(config.weights, model.named_parameters(), transport="shm") as pub:
        pub.publish(model.named_parameters(), version=0)
        rollout = procs.start("rollout", argv)
        rollout.wait_ready(120)
        wait_for(lambda: 0 in versions(), 120, "a batch sampled with version 0")
        descriptor.write_bytes(DAMAGED)
        wait_for(lambda: "is damaged" in rollout.log(), 60, "the rollout to see the damage")
        pub.publish(model.named_parameters(), version=2)  # writes the descriptor again
        wait_for(lambda: 2 in versions(), 120, "a batch sampled with version 2")
        assert rollout.poll() is None, rollout.tail()
        rollout.signal(signal.SIGTERM)
        assert rollout.wait(60) == 0, rollout.tail()
    log = rollout.log()
    assert f"{descriptor} is damaged (UnicodeDecodeError" in log, log
    assert log.count("is damaged") == 1 and "Traceback" not in log


class _Sampled:
    """A rollout worker of fixed samples (what it samples does not matter here): 1 MiB each."""

    version, device, tokenizer = 0, "cpu", None

    def __init__(self, config: RolloutConfig) -> None:
        self.batches = 0

    def refresh(self) -> None:
        return None

    def rollout(self, batch, stop):
        self.batches += 1
        keys = [f"b{self.batches}.{i}" for i in range(len(batch))]
        return keys, {"x": torch.zeros(len(batch), 1 << 20, dtype=torch.uint8)}, {}


def test_a_rollout_stopped_while_its_put_waits_on_a_dying_queue_returns_at_once(
    tmp_path, monkeypatch
):
    """Its put waits for room at a full queue when the run stops and the queue dies: the put is
    not sent again (to a queue that went away, each try waiting up to put_timeout_s), the worker
    logs the queue gone and returns 0; the prompts of the batch are sampled again by a restart."""
    server = ServerProcess(tmp_path, "--capacity", "1MiB")
    prompts = [types.SimpleNamespace(position=(0, i)) for i in range(100)]
    monkeypatch.setattr(rollout_main, "RolloutWorker", _Sampled)
    monkeypatch.setattr(rollout_main, "PromptSource", lambda *a, **kw: prompts)
    config = RolloutConfig(
        queue=server.address, partition="train", student="tiny",
        student_tokenizer=STUDENT_TOKENIZER, teacher_tokenizer=TEACHER_TOKENIZER,
        ctx_student=64, ctx_teacher=64, weights=str(tmp_path / "policy"), prompts="prompts",
        prompt_tokens=8, max_new_tokens=8, batch=1, state_dir=str(tmp_path / "state"),
        queue_timeout_s=10.0, put_timeout_s=60.0,
    )  # fmt: skip
    lc = types.SimpleNamespace(stop=threading.Event(), ready=lambda **info: None)
    result: dict = {}

    def serve():
        try:
            result["code"] = rollout_main.serve(config, lc)
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with QueueClient(server.address, timeout_s=10) as probe:
            deadline = time.monotonic() + 60
            while not probe.stats().get("parked_puts"):  # the second batch waits for room
                assert time.monotonic() < deadline and thread.is_alive(), result
                time.sleep(0.05)
        stop_s = stop_with_queue(lc.stop, server, thread)  # a SIGTERM with the queue's SIGKILL
    finally:
        lc.stop.set()
        server.stop()
    assert result == {"code": 0}, result
    assert stop_s < 5.0, stop_s
    assert (tmp_path / "state" / "worker0.json").read_text() == '{"pass": 0, "index": 1}'
