"""Trainer process shell: process group, device, queue feed, epochs, checkpoints, metrics, export.

torchrun-compatible: the rank, world size and local rank come from ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` (``MASTER_ADDR`` / ``MASTER_PORT`` for the rendezvous); NCCL on CUDA, gloo on CPU.
Every rank runs the same loop and agrees at each step boundary (one small all-reduce) on
whether anyone has data and whether anyone was asked to stop, so all ranks stop at the same
step and write one checkpoint together.

Files under ``run_dir``: ``metrics/trainer.rank<r>.jsonl`` (steps, evals), ``keys/
trainer.rank<r>.jsonl`` (the keys trained per step), ``checkpoints/``, ``final/`` (the exported
student with its tokenizer and model card, rank 0), ``summary.json`` (rank 0), and the trackers'
files of ``report_to`` (``tensorboard/``, ``wandb/``; rank 0, see tracking.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.common import lifecycle
from services.common.lifecycle import Lifecycle
from services.common.metrics import JsonlWriter
from services.queue.client import connect
from services.queue.errors import QueueError
from services.trainer import checkpoint, tracking
from services.trainer.collector import CollectorClock, CollectorSchedule
from services.trainer.config import TrainerConfig
from services.trainer.feed import TeacherFeed
from services.trainer.model_card import card_facts, write_model_card
from services.trainer.policy import PolicyPublisher
from services.trainer.profiling import StepProfiler
from services.trainer.worker import PhaseClock, TrainerWorker
from xtoken_core.data.corpus import read_texts

logger = logging.getLogger(__name__)


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment (0, 1, 0 without it)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world, local


def _all_reduce_flags(flags: list[float], device: torch.device, world: int) -> list[float]:
    """Sum the ranks' step flags (has data, stop). On the host (gloo) where there is a host group
    (:func:`_host_group`): an NCCL sum read back would wait for the GPU work queued before it,
    the step before's included, and leave the GPU idle while the next step is claimed."""
    if world == 1:
        return flags
    on_host = _HOST_GROUP is not None or device.type != "cuda"
    t = torch.tensor(flags, dtype=torch.float64, device="cpu" if on_host else device)
    dist.all_reduce(t, group=_HOST_GROUP)
    return t.tolist()


_HOST_GROUP: Any = None  # a gloo group of the trainer ranks beside their NCCL one


def _host_group(device: torch.device) -> None:
    """Make the host group of the step flags (collective; on CUDA only: CPU runs are gloo)."""
    global _HOST_GROUP
    if device.type != "cuda":
        return
    try:
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    except Exception as e:  # no usable network interface for gloo: the flags go by NCCL
        logger.warning("[trainer] no gloo group for the step flags (%s); using NCCL", e)


def serve(config: TrainerConfig, lc: Lifecycle) -> int:
    """Train until ``max_steps``, the end of the data (all epochs) or a stop; returns 0."""
    rank, world, local = dist_env()
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local if device.index is None else device.index)
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=max(600.0, 2 * config.teacher_timeout_s)),
        )
        _host_group(device)
    try:
        return _train(config, lc, rank, world, device)
    finally:
        global _HOST_GROUP
        _HOST_GROUP = None
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def teacher_output_layer(config: TrainerConfig, device: torch.device) -> torch.nn.Module:
    """The output layer of ``config.teacher_model`` for the hidden transport, built as the teacher
    builds its model (a preset: the teacher tokenizer's vocab and ``teacher_seed``).

    Raises:
        ValueError: as ``xtoken_core.models.load_output_layer``.
    """
    from xtoken_core.models import load_output_layer
    from xtoken_core.tokenizers import load_tokenizer

    vocab = config.teacher_vocab_size or load_tokenizer(config.teacher_tokenizer).vocab_size
    return load_output_layer(
        config.teacher_model,
        vocab_size=vocab,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device,
        seed=config.teacher_seed,
    )


def _train(config: TrainerConfig, lc: Lifecycle, rank: int, world: int, device) -> int:
    run_dir = Path(config.run_dir)
    # under FSDP every rank takes part in the eval forward (the parameters are sharded)
    sharded = world > 1 and config.parallel == "fsdp"
    evaluates = rank == 0 or sharded
    heldout = read_texts(config.heldout, config.eval_texts) if evaluates and config.heldout else []
    client = connect(config.queue, timeout_s=config.queue_timeout_s, name=f"trainer{rank}")
    worker = TrainerWorker(config, rank=rank, world_size=world, device=device)
    reader = output_layer = None
    if config.loss.uses_teacher:
        from xtoken_core.ipc.logit_ring import LogitRingReader

        reader = LogitRingReader(device=device, dead_after_s=config.teacher_dead_after_s)
        if config.teacher_model:
            output_layer = teacher_output_layer(config, device)
    # Retention: a run that reads its partition once registers its consumer task, so that the
    # queue drops each sample once a checkpoint holds it and a corpus larger than its
    # --capacity streams through it (feed.py). A run of several epochs reads every sample
    # again: it registers nothing, and the queue must hold the whole corpus.
    register = config.epochs == 1
    epoch, task_start, trained = 0, 0, set()
    summary: dict[str, Any] = {"rank_count": world}
    latest = checkpoint.latest_checkpoint(run_dir)
    if latest is not None:
        state = checkpoint.load(worker, latest)
        epoch, trained = state["epoch"], state["trained"]
        task_start = worker.step  # a fresh consumer task: every untrained sample comes again
        if state["student_before"] is not None:
            summary["student_before"] = state["student_before"]
    summary["resumed_from"] = worker.step
    metrics = JsonlWriter(run_dir / "metrics" / f"trainer.rank{rank}.jsonl", rank=rank)
    if rank == 0 and config.report_to:  # TensorBoard, W&B: fed the same records
        metrics = tracking.tracked_metrics(metrics, config, run_dir, start_step=worker.step)
    keys_log = JsonlWriter(run_dir / "keys" / f"trainer.rank{rank}.jsonl", rank=rank)
    lc.ready(rank=rank, world_size=world, step=worker.step)
    lifecycle.pause_progress()  # a compile of unknown length is no hang
    if worker.compiled:
        metrics.write("compile", state="start")
        if rank == 0:
            logger.info("[trainer] compiling the student...")
    compile_s = worker.warm_up()
    if compile_s is not None:
        metrics.write(
            "compile", state="done", seconds=round(compile_s, 3), compiled=worker.compiled
        )
        summary["compile_s"] = round(compile_s, 3)
        if rank == 0:
            logger.info(
                "[trainer] start-up step %s in %.1f s",
                "(compile)" if worker.compiled else "(eager)",
                compile_s,
            )

    def evaluate(tag: str) -> None:
        if heldout:
            result = worker.evaluate(heldout)
        if rank == 0 and heldout:
            metrics.write("eval", step=worker.step, tag=tag, who="student", **result)
            summary[f"student_{tag}"] = result
            logger.info(
                "[trainer] eval %s at step %d: %.4f bits/byte",
                tag,
                worker.step,
                result["bits_per_byte"],
            )
        if world > 1:
            dist.barrier()

    def save_checkpoint() -> None:
        """Checkpoint the epoch as it stands (collective), with the summary's eval before."""
        checkpoint.save(
            worker,
            run_dir,
            epoch=epoch,
            task_start=task_start,
            trained=trained,
            before=summary.get("student_before"),
        )

    if worker.step == 0:
        evaluate("before")
    # on-policy samples: the rollout workers sample with these weights, then with each update
    publisher = PolicyPublisher.create(worker, config, run_dir, rank=rank, world=world)
    if publisher is not None:
        publisher.publish()
    profiler = StepProfiler(
        config.profile_start, config.profile_steps, run_dir / "profile", rank, device
    )
    unwritten: list[dict[str, Any]] = []  # the last step, its record not written yet
    gc_clock, gc_schedule = CollectorClock(), CollectorSchedule(config.gc_every)
    gc_schedule.start()  # the start-up heap frozen, collections on the schedule from here
    if gc_schedule.start_report is not None:
        metrics.write("gc", **gc_schedule.start_report)
    gc_clock.install()  # the steps' collections (not the start's)

    def write_steps() -> None:
        """Write the record of the step not written yet (reads its figures from the GPU)."""
        while unwritten:
            entry = unwritten.pop(0)
            result, on_policy = entry.pop("result"), entry.pop("on_policy")
            step_s = sum(result.times.values())
            metrics.write(
                "step",
                step=result.step,
                skipped=result.skipped,
                step_s=round(step_s, 6),
                tokens_per_s=round(result.metrics["tokens"] / step_s, 2) if step_s else None,
                times={k: round(v, 6) for k, v in result.times.items()},
                memory_mb=_memory_mb(device),
                recompiles=worker.recompiles(),
                **entry,
                **({} if on_policy is None else {"on_policy": on_policy}),
                **{k: round(v, 6) for k, v in result.metrics.items()},
            )
            if rank == 0:
                logger.info(
                    "[trainer] step %d loss %.4f (kd %.4f ce %.4f) %.0f tok/s",
                    result.step,
                    result.metrics.get("loss", float("nan")),
                    result.metrics.get("kl_loss", 0.0),
                    result.metrics.get("ce_loss", 0.0),
                    result.metrics["tokens"] / step_s if step_s else 0.0,
                )

    stopped = False
    last_ckpt = worker.step
    # this launch's name in its consumer tasks: no earlier launch used it, so what a dead launch
    # held leased is pending for this one at once (its leases lapse unseen)
    launch = _launch_id(world)
    feed = None
    if epoch >= config.epochs:
        logger.info(
            "[trainer] the checkpoint at step %d holds every epoch (%d): nothing to train",
            worker.step,
            config.epochs,
        )
    while epoch < config.epochs and not stopped:
        task = f"trainer/e{epoch}/s{task_start}/{launch}"
        feed = TeacherFeed(
            client,
            config,
            rank,
            worker,
            task,
            trained,
            reader=reader,
            output_layer=output_layer,
            stop=lc.stop,
            register=register,
            replaces=f"trainer/e{epoch}/",
        )
        logger.info(
            "[trainer] rank %d epoch %d (task %s, %d trained, %s)",
            rank,
            epoch,
            feed.samples.task,
            len(trained),
            "registered: the queue drops what a checkpoint holds"
            if register
            else f"not registered: {config.epochs} epochs read every sample again",
        )
        clock = None
        while True:
            lifecycle.progress()  # the heartbeat shows a loop that moves (a hung one is restarted)
            if config.max_steps and worker.step >= config.max_steps:
                break
            profiler.step_begins(worker.step + 1)
            # one clock until a step trains: the waits of the tries that found no data (a
            # missing on-policy share, an empty queue) count in that step's data wait
            clock = clock or PhaseClock(device)
            with clock.phase("data_wait"):
                mbs = feed.next_step(config.grad_accum)
            with clock.phase("sync"):
                has_data, stop = _all_reduce_flags(
                    [float(bool(mbs)), float(lc.stop.is_set())], device, world
                )
            if stop:
                feed.give_back(mbs)
                stopped = True
                break
            if not has_data:
                write_steps()  # no step follows soon: the last one's record waits no longer
                if feed.ended or config.idle_timeout_s is not None:
                    break
                gc_schedule.when_idle()  # a trainer that waits for hours stays bounded
                continue
            result, clock = worker.train_step(mbs, clock), None
            feed.ack(mbs)
            if publisher is not None:
                publisher.after_step()
            keys_log.write("trained", step=result.step, epoch=epoch, keys=result.keys)
            # the step before's record: its figures are read now, while this step runs on the
            # GPU (reading them at once would leave the GPU idle until the next step is queued)
            write_steps()
            unwritten.append(
                {
                    "result": result,
                    "epoch": epoch,
                    "feed": dict(feed.counters),
                    "on_policy": feed.on_policy_stats(),
                    **gc_clock.read(),  # the collections since the step before
                }
            )
            gc_schedule.after_step(result.step)  # while the GPU runs the step just queued
            profiler.step_ended(result.step)
            if config.checkpoint_every and worker.step % config.checkpoint_every == 0:
                write_steps()
                lifecycle.pause_progress()  # a save (or eval) of unknown length is no hang
                save_checkpoint()
                feed.commit()  # retention: what the checkpoint holds may be dropped now
                last_ckpt = worker.step
            if config.eval_every and worker.step % config.eval_every == 0:
                write_steps()
                lifecycle.pause_progress()
                evaluate(f"step{worker.step}")
        if stopped or (config.max_steps and worker.step >= config.max_steps):
            break
        feed.give_back()
        epoch, task_start, trained = epoch + 1, worker.step, set()
    if feed is not None:
        feed.give_back()
    write_steps()
    profiler.close()
    gc_schedule.close()
    gc_clock.remove()
    lifecycle.pause_progress()
    if worker.step != last_ckpt or stopped:
        save_checkpoint()
        try:
            if feed is not None:
                feed.commit()
        except QueueError as e:  # saved: a resumed launch consumes them (replaces), or a clear
            logger.warning("[trainer] could not ack the samples of the last checkpoint: %s", e)
    if not stopped and config.max_steps and worker.step < config.max_steps and rank == 0:
        logger.warning(
            "[trainer] the data ended at step %d, before trainer.max_steps=%d (%d epoch%s of "
            "the corpus): raise trainer.epochs or give more data to train longer",
            worker.step,
            config.max_steps,
            config.epochs,
            "" if config.epochs == 1 else "s",
        )
        summary["data_ended_before_max_steps"] = True
    if not stopped:
        evaluate("after")
        if config.export:
            worker.export(run_dir / "final")
            if rank == 0:
                facts = card_facts(config, run_dir, summary, step=worker.step, world_size=world)
                write_model_card(run_dir / "final", facts)
    if rank == 0:
        summary.update(step=worker.step, epoch=epoch, stopped=stopped, skipped=worker.skipped_steps)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if publisher is not None:
        publisher.close()
    metrics.close()
    keys_log.close()
    client.close()
    if reader is not None:
        reader.close()
    return 0


def _launch_id(world: int) -> str:
    """A name for this launch of the trainer group, the same on every rank (rank 0's, sent to
    the others): a fresh process-instance id (``<pid>-<8 hex>``)."""
    from services.protocol.names import new_instance

    ids = [new_instance()]
    if world > 1:
        dist.broadcast_object_list(ids, src=0, group=_HOST_GROUP)
    return ids[0]


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except ImportError:  # pragma: no cover
        return 0.0
