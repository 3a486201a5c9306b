"""Finished runs written the way the control plane and the trainer leave them (a record and events
in the runs root's SQLite store, rank 0's metrics file, the queue-depth history), for tests of the
views over finished runs: comparison, "updated", events as sentences, the dashboard."""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

from services.common.metrics import JsonlWriter
from services.control.queue_history import QueueHistory, history_path
from services.control.store import Store
from tests.services.control.conftest import tiny_config


def write_finished_run(
    runs_root: pathlib.Path,
    *,
    name: str,
    steps: int,
    start: float,
    config: dict[str, Any] | None = None,
    loss0: float = 18.0,
    memory_mb: float = 900.0,
    tokens: float = 256.0,
    replay_from: int | None = None,
    evals: tuple[int, ...] = (0,),
    events: tuple[tuple[str, dict[str, Any]], ...] = (),
    queue_samples: int = 0,
    state: str = "SUCCEEDED",
    on_policy: bool = False,
    teachers: int = 1,
) -> str:
    """A finished run as the control plane leaves it: its record and events in the runs root's
    store (``control.db``, what ``xtoken control serve --runs-root`` opens), rank 0's metrics file
    written with the trainer's JsonlWriter and record fields (one step per second from ``start``),
    and ``queue_samples`` queue-depth samples kept by the control plane's QueueHistory.

    Args:
        replay_from: after the last step, the trainer restarts from the checkpoint of this step
            and writes the steps after it again (a replay), then one more.
        evals: the steps after which a held-out eval is written (0: the ``before`` eval).
        events: (kind, data) recorded after the state events.
        on_policy: step records carry the on-policy figures (2 samples, staleness 1.5, one
            more sample dropped as stale every 10 steps, teacher log-prob -2 - step / 100).
        teachers: a run of several teachers: step records carry each teacher's own figures as
            the loss names them (``teacher{i}_kl_loss`` = ``kl_loss * 2 (i + 1) / (teachers + 1)``,
            whose mean is ``kl_loss``: equal teacher weights ``1 / teachers``).

    Returns:
        The run's id.
    """
    run_id = uuid.uuid4().hex[:12]
    run_dir = runs_root / run_id
    config = {**(config or tiny_config()), "run_dir": str(run_dir)}
    writer = JsonlWriter(run_dir / "metrics" / "trainer.rank0.jsonl", rank=0)
    clock = iter(start + i for i in range(10**6))

    def eval_after(step: int) -> None:
        writer.write(
            "eval",
            time=next(clock),
            step=step,
            tag="before" if step == 0 else f"step{step}",
            who="student",
            bits_per_byte=round(5.0 - 0.1 * step, 4),
            bytes=257893,
            tokens=84849,
            accuracy=0.01,
        )

    def per_teacher(kl: float) -> dict[str, float]:
        figures = {}
        for i in range(teachers if teachers > 1 else 0):
            share = 2 * (i + 1) / (teachers + 1)
            figures[f"teacher{i}_kl_loss"] = round(kl * share, 6)
            figures[f"teacher{i}_kl_common"] = round(kl * share, 6)
            figures[f"teacher{i}_l1_uncommon"] = 0.0
            figures[f"teacher{i}_proj_accuracy"] = 0.004
            figures[f"teacher{i}_num_valid_chunks"] = 40.0 + i
        return figures

    def step_record(step: int) -> None:
        kl, ce = 0.6 * loss0 / (1 + 0.2 * step), 0.4 * loss0 / (1 + 0.1 * step)
        times = {
            "data_wait": 0.01,
            "teacher_wait": 0.1,
            "forward": 0.05,
            "loss": 0.2,
            "backward": 0.25,
            "optimizer": 0.01,
        }
        step_s = sum(times.values())
        writer.write(
            "step",
            time=next(clock),
            step=step,
            epoch=0,
            skipped=False,
            step_s=round(step_s, 6),
            tokens_per_s=round(tokens / step_s, 2),
            times=times,
            memory_mb=round(memory_mb + 10 * step, 1),
            recompiles=None,
            feed={"stale": 0, "checksum_mismatch": 0, "orphans": 0, "re_requests": 0},
            accuracy=0.01,
            ce_loss=round(ce, 6),
            kl_common=round(kl, 6),
            kl_loss=round(kl, 6),
            l1_uncommon=0.0,
            loss=round(kl + ce, 6),
            proj_accuracy=0.004,
            tokens=tokens,
            micro_batches=1.0,
            grad_norm=1.2,
            lr=config["trainer"]["optim"]["lr"],
            **(
                {
                    "on_policy": {
                        "samples": 2,
                        "mean_staleness": 1.5,
                        "dropped_stale": step // 10,
                        "wait_s": 0.0,
                        "teacher_logprob_per_byte": round(-2 - step / 100, 4),
                    }
                }
                if on_policy
                else {}
            ),
            **per_teacher(kl),
        )
        if step in evals:
            eval_after(step)

    if 0 in evals:
        eval_after(0)
    for step in range(1, steps + 1):
        step_record(step)
    if replay_from is not None:
        for step in range(replay_from + 1, steps + 2):
            step_record(step)
    writer.close()
    if queue_samples:
        history = QueueHistory(history_path(run_dir))
        for i in range(queue_samples):
            history.add(
                {
                    "samples": 10 + i,
                    "bytes_used": 4096 * i,
                    "leases": i % 3,
                    "parked_claims": 1,
                    "parked_puts": 0,
                },
                at=start + 2 * i,
            )
        history.save()

    store = Store(runs_root / "control.db")
    try:
        store.create_run(run_id, name, config, str(run_dir))
        for s in ("PENDING", "STARTING", "RUNNING"):
            store.add_event(run_id, "state", {"state": s})
        for kind, data in events:
            store.add_event(run_id, kind, data)
        store.add_event(run_id, "state", {"state": state, "reason": "every trainer rank finished"})
        store.update_run(run_id, state=state, reason="every trainer rank finished")
    finally:
        store.close()
    return run_id
