"""Rollout process shell: weights, prompts, the queue, the loop, lifecycle, metrics.

The loop, one batch of ``batch`` prompts per turn:

1. at the batch boundary, take the trainer's newest published weights (none yet: wait);
2. wait while the rollout partition holds ``max_pending`` samples no trainer took;
3. sample a batch of at most ``batch`` prompts and the room left below ``max_pending``, and
   make its samples (:class:`~services.rollout.worker.RolloutWorker`);
4. put them in one message (a sample is stored whole or not at all), then keep the position
   after the batch's last prompt (:class:`~services.rollout.prompts.PromptState`).

A worker killed mid-batch loses nothing: the batch was not put, its position was not kept, so a
restarted worker samples the same prompts again under the same keys (a key put before its
position was kept is stored once: puts are idempotent, a consumed key is refused). SIGTERM ends
the generation in flight at the next token and exits without putting it.

Metrics (``run_dir``, from the run's context): ``RUN_DIR/metrics/rollout<worker>.jsonl``, one ``rollout`` record per
batch put: the weights' version, samples, generated tokens, the seconds of sampling and
collating, generated tokens/s and samples/s of the batch, the seconds waited for weights or for
room before it, and the partition's pending samples.
"""

from __future__ import annotations

import logging
import time
from itertools import islice
from pathlib import Path
from typing import Any

from services.common import lifecycle
from services.common.lifecycle import Lifecycle
from services.common.metrics import JsonlWriter, device_memory_mb
from services.protocol.names import ROLLOUT_TASK, rollout_partition
from services.queue.client import connect
from services.queue.errors import QueueError
from services.rollout.config import RolloutConfig
from services.rollout.prompts import PromptSource, PromptState
from services.rollout.worker import RolloutWorker
from xtoken_core.errors import SettingsError

logger = logging.getLogger(__name__)


def serve(config: RolloutConfig, lc: Lifecycle) -> int:
    """Sample batches until stopped; returns 0.

    Raises:
        SettingsError: no prompt corpus, or weights of another model (exit code 2, also once
            sampling).
        DataError: the corpus gives this worker no prompt (exit code 3).
        ValueError: unknown tokenizers or model (before the process serves: exit code 2).
    """
    if not config.prompts:
        raise SettingsError("no prompt corpus: pass --prompts FILE (xtoken run: data.train)")
    state = PromptState(config.state_dir, config.worker)
    start = state.load()
    worker = RolloutWorker(config)
    prompts = PromptSource(
        config.prompts,
        worker.tokenizer,
        config.prompt_tokens,
        worker=config.worker,
        workers=config.workers,
        text_field=config.text_field,
        prompt_field=config.prompt_field,
        limit=config.limit,
        start=start,
    )
    # stopping, it tries nothing twice: a put to a queue that went away costs no retries
    name = f"rollout{config.worker}"
    client = connect(config.queue, timeout_s=config.queue_timeout_s, name=name, stopping=lc.stop)
    metrics = None
    if config.run_dir:
        metrics = JsonlWriter(
            Path(config.run_dir) / "metrics" / f"rollout{config.worker}.jsonl",
            worker=config.worker,
        )
    partition = rollout_partition(config.partition)
    lc.ready(worker=config.worker, partition=partition)
    logger.info(
        "[rollout] worker %d of %d sampling %s into %s (%s on %s)%s",
        config.worker,
        config.workers,
        config.prompts,
        partition,
        config.student,
        config.device,
        f", from prompt {start}" if start else "",
    )
    try:
        _loop(client, worker, iter(prompts), state, partition, config, lc, metrics)
    except QueueError as e:
        if not lc.stop.is_set():
            raise
        logger.info("[rollout] the queue went away while stopping: %s", e)
    finally:
        if metrics is not None:
            metrics.close()
        client.close()
    return 0


def _loop(
    client: Any,
    worker: RolloutWorker,
    prompts: Any,
    state: PromptState,
    partition: str,
    config: RolloutConfig,
    lc: Lifecycle,
    metrics: JsonlWriter | None,
) -> None:
    waited_since = time.monotonic()
    told: set[str] = set()
    while not lc.stop.is_set():
        if worker.refresh() is not None and "sampling" not in told:
            logger.info(
                "[rollout] sampling with the trainer's weights (version %d)", worker.version
            )
            told.add("sampling")
        if worker.version is None:
            _wait(lc, config, told, "weights", "no weights published yet: waiting for the trainer")
            continue
        pending = int(client.status(partition, ROLLOUT_TASK)["pending"])
        if pending >= config.pending_bound:
            _wait(lc, config, told, "room", f"{pending} samples wait for the trainers: pausing")
            continue
        # no more than the room left: a sample that waits longer only grows stale
        batch = list(islice(prompts, min(config.batch, config.pending_bound - pending)))
        waited = time.monotonic() - waited_since
        keys, fields, counts = worker.rollout(batch, stop=lc.stop.is_set)
        if lc.stop.is_set():
            break  # cut short: never put (a restart samples these prompts again)
        reply = client.put(partition, keys, fields, timeout_s=config.put_timeout_s)
        state.save(batch[-1].position)
        lifecycle.progress()
        waited_since = time.monotonic()
        if metrics is not None:
            busy = counts["sample_s"] + counts["collate_s"]
            metrics.write(
                "rollout",
                version=counts["version"],
                samples=counts["samples"],
                generated_tokens=counts["generated_tokens"],
                sample_s=round(counts["sample_s"], 6),
                collate_s=round(counts["collate_s"], 6),
                tokens_per_s=round(counts["generated_tokens"] / busy, 2) if busy else None,
                samples_per_s=round(counts["samples"] / busy, 3) if busy else None,
                wait_s=round(waited, 6),
                pending=pending,
                written=int(reply.get("new_samples", reply.get("written", len(keys)))),
                consumed=int(reply.get("consumed", 0)),
                position=list(batch[-1].position),
                memory_mb=device_memory_mb(worker.device),
            )


def _wait(lc: Lifecycle, config: RolloutConfig, told: set[str], what: str, why: str) -> None:
    """One round of a wait on a peer (the trainer): alive, though no batch completes; ``why``
    is logged the first time the worker waits for ``what``."""
    if what not in told:
        logger.info("[rollout] %s", why)
        told.add(what)
    lifecycle.waiting()
    lc.stop.wait(config.poll_s)
