"""The rollout process with real subprocesses (a queue and the rollout; the test publishes as the
trainer does): a weights descriptor damaged mid-run is waited out, the process lives on and
samples with the next publication."""

from __future__ import annotations

import signal

import pytest

from services.common.metrics import read_jsonl
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
from xtoken_core.ipc.policy_weights import DESCRIPTOR, WeightPublisher

# msgpack's map whose first key is a str of 2 bytes that are no UTF-8 (0xb6 0xb6)
DAMAGED = b"\x82\xa2\xb6\xb6\x01\xa6format\x01"


@pytest.mark.slow  # a queue and a rollout process: ~20-50 s on two cores
@pytest.mark.timeout(180)
def test_a_damaged_descriptor_mid_run_is_waited_out_and_the_next_publication_is_sampled_with(
    procs, tmp_path, demo  # noqa: F811 (fixtures)
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
