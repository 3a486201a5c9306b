"""The trainer: epochs of steps over the queue's samples, with checkpoints, evals and the export."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common import lifecycle
from services.common.config import to_dict
from services.common.metrics import JsonlWriter, device_memory_mb, device_reserved_mb
from services.protocol.names import new_instance
from services.queue import errors as codes
from services.queue.errors import QueueError
from services.trainer import checkpoint as checkpoints
from services.trainer import tracking
from services.trainer.collector import CollectorClock, CollectorSchedule
from services.trainer.config import TrainerConfig
from services.trainer.feed import TeacherFeed
from services.trainer.model_card import card_facts, write_model_card
from services.trainer.policy import PolicyPublisher
from services.trainer.profiling import StepProfiler
from services.trainer.startup import start_up_brief, warm_up
from services.trainer.step import LossTeacher, MicroBatch, PhaseClock, StudentStep, build_loss
from services.trainer.student import Student

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer group and the group's host collectives (the shell's).

    Attributes:
        rank: this trainer rank.
        world: the number of trainer ranks.
        sum: the ranks' sum of a few floats (the step flags: has data, stop).
        barrier: waits for every rank.
    """

    rank: int = 0
    world: int = 1
    sum: Callable[[list[float]], list[float]] = lambda flags: flags
    barrier: Callable[[], None] = lambda: None


def build_step(
    config: TrainerConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
    model: torch.nn.Module | None = None,
) -> StudentStep:
    """The student of ``config.student`` computing as ``config.compute`` says, and its step, with
    the loss of ``config.loss`` and its teachers (``teacher`` and each of ``extra_teachers``:
    each one's projection checked against the student's tokenizer and its own, its vocab
    ``vocab_size`` or its tokenizer's, its weight).

    Args:
        config: the trainer settings.
        rank, world_size: data-parallel rank and size (> 1 needs an initialized process group).
        device: this rank's device (default: ``config.compute.device``).
        model: an already built student (tests); default: loaded from ``config.student.model``.

    Raises:
        ValueError: vocab mismatches between the student, its tokenizer and the projection; a
            setting that cannot run here (names it).
    """
    from xtoken_core.tokenizers import load_tokenizer

    student = Student(
        config.student.model,
        config.student_tokenizer,
        **settings_of(
            Student, config.student, config.compute, device=device or config.compute.device,
            rank=rank, world_size=world_size, module=model, pack=config.pack, optim=config.optim,
            max_steps=config.schedule.max_steps,
        ),
    )  # fmt: skip
    loss_fn = None
    if config.loss.uses_teacher:
        teachers = config.teachers()
        tokenizers = [load_tokenizer(t.tokenizer) for t in teachers]
        loss_fn = build_loss(
            config.loss,
            student_vocab=student.vocab,
            teachers=[
                LossTeacher(
                    t.projection,
                    t.link.vocab_size or tokenizer.vocab_size,
                    t.link.weight,
                    t.tokenizer,
                    t.projection_key,
                )
                for t, tokenizer in zip(teachers, tokenizers)
            ],
            tokenizers=(student.tokenizer, *tokenizers),
        )
    return StudentStep(student, loss_fn, grad_clip=config.optim.grad_clip)


def settings_of(component: Callable[..., Any], *sections: Any, **given: Any) -> dict:
    """The keyword arguments of ``component`` that are settings of the same name in its own
    sections of the trainer config, and ``given`` over them (the values the trainer settles
    itself: the context's, a sibling section's, the rank's).

    Args:
        component: the class or function built.
        sections: the config sections it is built from (``config.student``,
            ``config.compute``); no two of them name the same setting.
        given: keyword arguments passed as they are.
    """
    parameters = inspect.signature(component).parameters
    taken: dict[str, Any] = {}
    for section in sections:
        for f in dataclasses.fields(section):
            if f.name in parameters:
                assert f.name not in taken, f"{f.name}: a setting of two sections"
                taken[f.name] = getattr(section, f.name)
    return {**taken, **given}


def teacher_output_layer(
    model: str,
    *,
    tokenizer: str,
    vocab_size: int | None,
    seed: int,
    device: torch.device,
) -> torch.nn.Module:
    """The output layer of the teacher model for the hidden transport, built as the teacher
    builds its model (a preset: the teacher tokenizer's vocab and the teacher's seed).

    Args:
        model: the teacher model spec (``trainer.teacher.model``).
        tokenizer: the teacher tokenizer (a preset's vocab, unless ``vocab_size``).
        vocab_size: vocab of a preset teacher, or None: the tokenizer's.
        seed: seed of a preset teacher.
        device: this rank's device.

    Raises:
        ValueError: as ``xtoken_core.models.load_output_layer``.
    """
    from xtoken_core.models import load_output_layer
    from xtoken_core.tokenizers import load_tokenizer

    return load_output_layer(
        model,
        vocab_size=vocab_size or load_tokenizer(tokenizer).vocab_size,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device,
        seed=seed,
    )


class Trainer:
    """One trainer rank: epochs of optimizer steps over the samples its feed claims, until
    ``schedule.max_steps``, the end of the data (every epoch) or a stop.

    Built (the set-up) with the student, its step, the teacher link, the state of the last
    checkpoint and the metrics files; :meth:`train` then runs the named steps: :meth:`start` (the
    start-up step, the eval before), :meth:`run_epoch` per epoch, :meth:`step` per optimizer step,
    :meth:`checkpoint` and :meth:`evaluate` on their schedules, :meth:`finish`.

    Files under ``run_dir``: ``metrics/trainer.rank<r>.jsonl`` (steps, evals), ``keys/
    trainer.rank<r>.jsonl`` (the keys trained per step), ``checkpoints/``, ``final/`` (the
    exported student with its tokenizer and model card, rank 0), ``summary.json`` (rank 0), and
    the trackers' files of ``observe.report_to`` (``tensorboard/``, ``wandb/``; rank 0, see
    tracking.py).

    Exactly once: each launch claims under a consumer task no earlier launch used
    (``trainer/e<epoch>/s<step>/<launch>``), skips the keys its checkpoint trained, and acks a
    step's samples after its optimizer step (or, when the run registers its task for retention,
    once a checkpoint holds them). Every rank agrees at each step boundary (the flags' sum) on
    whether anyone has data and whether anyone was asked to stop, so all ranks stop at the same
    step and write one checkpoint together. A rank whose queue went away while it stops (its
    client's ``stopping``: ``QueueError("stopped")``) sends it nothing more: what it held leased
    is served again once the lease runs out; found between two step boundaries, the rank ends
    there without the stop's checkpoint (its step's samples may be neither trained nor acked, the
    other ranks elsewhere), and the next launch resumes from the last one.

    Args:
        config: the trainer settings.
        client: a QueueClient (the feed's).
        heldout: the held-out texts this rank evaluates ([]: none).
        ranks: the trainer group (default: one rank).
        device: this rank's device (default: ``config.compute.device``).
        stop: set to stop at the next step boundary (default: never set).
        launch: this launch's name in its consumer tasks, the same on every rank (default: a
            fresh one).
    """

    def __init__(
        self,
        config: TrainerConfig,
        client: Any,
        *,
        heldout: Sequence[str] = (),
        ranks: Ranks | None = None,
        device: torch.device | str | None = None,
        stop: threading.Event | None = None,
        launch: str | None = None,
    ) -> None:
        from xtoken_core.data.collator import resolve_pad_id
        from xtoken_core.tokenizers import load_tokenizer

        self.config = config
        self.client = client
        self.heldout = list(heldout)
        self.ranks = ranks or Ranks()
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self.device = torch.device(device or config.compute.device)
        self.stop = stop or threading.Event()
        self.launch = launch or new_instance()
        self.run_dir = Path(config.run_dir)
        self.student_step = build_step(
            config, rank=self.rank, world_size=self.world, device=self.device
        )
        self.student: Student = self.student_step.student
        # each teacher's rows padded with its own pad id (a list of one per teacher with several)
        pad_ids = [resolve_pad_id(load_tokenizer(t.tokenizer)) for t in config.teachers()]
        teacher_pad_id = pad_ids[0] if len(pad_ids) == 1 else pad_ids
        self.pads = {
            "student_pad_id": self.student.pad_id,
            "teacher_pad_id": teacher_pad_id,
            "make_seq_div_by_student": config.compute.length_multiple,
        }
        self.readers, self.output_layers = self._teacher_links()
        # per teacher, the width of the cache that serves it (None: a live teacher)
        self.cached_widths = [cache_width(t.link.cache) for t in config.teachers()]
        # Retention: a run that reads its partition once registers its consumer task, so that the
        # queue drops each sample once a checkpoint holds it and a corpus larger than its
        # --capacity streams through it (feed.py). A run of several epochs reads every sample
        # again: it registers nothing, and the queue must hold the whole corpus.
        self.register = config.schedule.epochs == 1
        self.epoch, self.task_start, self.trained = 0, 0, set()
        self.summary: dict[str, Any] = {"rank_count": self.world}
        self._resume()
        self.summary["resumed_from"] = self.student.step
        self.metrics, self.keys_log = self._open_logs()
        self.feed: TeacherFeed | None = None
        self.publisher: PolicyPublisher | None = None
        self.profiler: StepProfiler | None = None
        self.gc_clock = CollectorClock()
        self.gc_schedule = CollectorSchedule(config.compute.gc_every)
        self.stopped = False
        self.queue_gone = False  # the queue went away while this rank stopped: nothing more sent
        self._last_checkpoint = self.student.step
        self._last_eval: tuple[int, dict[str, Any]] | None = None  # (step, result) of the last eval
        self._unwritten: list[dict[str, Any]] = []  # the last step, its record not written yet

    def _teacher_links(self) -> tuple[list[Any], list[Any]]:
        """``(ring readers, teacher output layers)``, one of each per teacher of a loss that
        reads teachers: the reader of the teacher's logit rings (its own ``dead_after_s``), and
        the output layer the hidden transport applies (with the teacher's ``model``, else
        None); empty lists for the student's CE alone."""
        config = self.config
        if not config.loss.uses_teacher:
            return [], []
        from xtoken_core.ipc.logit_ring import LogitRingReader

        readers, output_layers = [], []
        for teacher in config.teachers():
            link = teacher.link
            readers.append(LogitRingReader(device=self.device, dead_after_s=link.dead_after_s))
            output_layer = None
            if link.model:
                output_layer = teacher_output_layer(
                    **settings_of(
                        teacher_output_layer, link, tokenizer=teacher.tokenizer,
                        device=self.device,
                    )
                )  # fmt: skip
            output_layers.append(output_layer)
        return readers, output_layers

    def _open_logs(self) -> tuple[Any, JsonlWriter]:
        """``(metrics, keys log)``: this rank's metrics records, teed on rank 0 into the trackers
        of ``observe.report_to`` (TensorBoard, W&B: fed the same records, with the run config as
        their hyperparameters), and its keys trained."""
        name = f"trainer.rank{self.rank}.jsonl"
        metrics = JsonlWriter(self.run_dir / "metrics" / name, rank=self.rank)
        if self.rank == 0 and self.config.observe.report_to:
            metrics = tracking.tracked_metrics(
                metrics,
                self.config.observe,
                self.run_dir,
                tracking.run_hparams(to_dict(self.config), self.run_dir),
                start_step=self.student.step,
            )
        return metrics, JsonlWriter(self.run_dir / "keys" / name, rank=self.rank)

    def _resume(self) -> None:
        """Take the state of the run's latest checkpoint, if any: the weights, the step, the
        epoch and what it trained (a fresh consumer task: every untrained sample comes again)."""
        latest = checkpoints.latest_checkpoint(self.run_dir)
        if latest is None:
            return
        state = checkpoints.load(self.student, latest)
        self.student_step.skipped_steps = state["skipped_steps"]
        self.epoch, self.trained = state["epoch"], state["trained"]
        self.task_start = self.student.step
        if state["student_before"] is not None:
            self.summary["student_before"] = state["student_before"]

    # ------------------------------------------------------------------ the named steps

    def train(self) -> None:
        """Train until ``schedule.max_steps``, the end of the data (every epoch) or a stop, then
        finish: the last checkpoint, the eval after, the export and the summary (a stop whose
        queue went away mid-step: no checkpoint, see the class)."""
        epochs = self.config.schedule.epochs
        self.start()
        if self.epoch >= epochs:
            logger.info(
                "[trainer] the checkpoint at step %d holds every epoch (%d): nothing to train",
                self.student.step,
                epochs,
            )
        try:
            while self.epoch < epochs and self.run_epoch():
                self.epoch, self.task_start, self.trained = self.epoch + 1, self.student.step, set()
        except QueueError as e:
            # between two step boundaries: a checkpoint now might hold a step whose keys it
            # lacks, and the other ranks are elsewhere; the next launch resumes from the last one
            last = self._last_checkpoint
            then = f"no checkpoint at this stop: the next launch resumes from step {last}"
            if not self._went_away(e, then):
                raise
            self.finish(checkpoint=False)
            return
        self.finish()

    def start(self) -> None:
        """Before the first step: the start-up step (the compile), the eval before training, the
        first weights for the rollout workers, the profiler and the collector's schedule."""
        config, student = self.config, self.student
        lifecycle.pause_progress()  # a compile of unknown length is no hang
        if student.compiled:
            self.metrics.write("compile", state="start")
            if self.rank == 0:
                logger.info("[trainer] compiling the student...")
        start_up: dict = {}  # where the start-up step's seconds went (warm_up fills it)
        compile_s = warm_up(
            student,
            micro_batch=config.feed.micro_batch,
            max_length=config.student.max_length,
            head=self.student_step.head,
            length_multiple=config.compute.length_multiple,
            shortest=config.compute.warm_shortest,
            report=start_up,
        )
        if compile_s is not None:
            self.metrics.write(
                "compile", state="done", seconds=round(compile_s, 3), compiled=student.compiled,
                **start_up,
            )  # fmt: skip
            self.summary["compile_s"] = round(compile_s, 3)
            self.summary["start_up"] = start_up
            if self.rank == 0:
                logger.info(
                    "[trainer] start-up step %s in %.1f s%s",
                    "(compile)" if student.compiled else "(eager)",
                    compile_s,
                    start_up_brief(start_up) if student.compiled else "",
                )
        if student.step == 0:
            self.evaluate("before")
        # on-policy samples: the rollout workers sample with these weights (from the first step to
        # publish, after an off-policy start), then with each update
        self.publisher = PolicyPublisher.create(student, config.on_policy, self.run_dir)
        if self.publisher is not None:
            self.publisher.start()
        self.profiler = StepProfiler(
            config.observe.profile_start, config.observe.profile_steps,
            self.run_dir / "profile", self.rank, self.device,
        )  # fmt: skip
        self.gc_schedule.start()  # the start-up heap frozen, collections on the schedule from here
        if self.gc_schedule.start_report is not None:
            self.metrics.write("gc", **self.gc_schedule.start_report)
        self.gc_clock.install()  # the steps' collections (not the start's)

    def run_epoch(self) -> bool:
        """Train the steps of the current epoch (``self.epoch``) under a fresh consumer task.

        Returns:
            True when the epoch's data ended (the next epoch follows); False on a stop or at
            ``schedule.max_steps``.
        """
        feed_config = self.config.feed
        self.feed = feed = self._open_feed()
        clock = None
        while True:
            lifecycle.progress()  # the heartbeat shows a loop that moves (a hung one is restarted)
            if self._at_max_steps():
                break
            self.profiler.step_begins(self.student.step + 1)
            # one clock until a step trains: the waits of the tries that found no data (a
            # missing on-policy share, an empty queue) count in that step's data wait
            clock = clock or PhaseClock(self.device)
            with clock.phase("data_wait"):
                micro_batches = feed.next_step(feed_config.grad_accum)
            with clock.phase("sync"):
                has_data, stop = self.ranks.sum(
                    [float(bool(micro_batches)), float(self.stop.is_set())]
                )
            if stop:
                self._give_back(micro_batches)
                self.stopped = True
                break
            if not has_data:
                self._write_steps()  # no step follows soon: the last one's record waits no longer
                if feed.ended or feed_config.idle_timeout_s is not None:
                    break
                self.gc_schedule.when_idle()  # a trainer that waits for hours stays bounded
                continue
            self.step(micro_batches, clock)
            clock = None
        if self.stopped or self._at_max_steps():
            return False
        self._give_back()
        return not self.queue_gone

    def step(self, micro_batches: list[MicroBatch], clock: PhaseClock) -> None:
        """One optimizer step over this rank's micro-batches, then their acks, the weights for
        the rollout workers, the keys trained, the step before's record, and a checkpoint or an
        eval when one is due.

        Args:
            micro_batches: this rank's micro-batches (empty when another rank has data only).
            clock: the step's phase clock, holding its data wait.
        """
        schedule, student, feed = self.config.schedule, self.student, self.feed
        result = self.student_step.run(micro_batches, clock)
        feed.ack(micro_batches)
        if self.publisher is not None:
            self.publisher.after_step()
        self.keys_log.write("trained", step=result.step, epoch=self.epoch, keys=result.keys)
        # the step before's record: its figures are read now, while this step runs on the
        # GPU (reading them at once would leave the GPU idle until the next step is queued)
        self._write_steps()
        self._unwritten.append(
            {
                "result": result,
                "epoch": self.epoch,
                "started": round(clock.started, 6),
                "feed": dict(feed.counters),
                "on_policy": feed.on_policy_stats(),
                **self.gc_clock.read(),  # the collections since the step before
            }
        )
        self.gc_schedule.after_step(result.step)  # while the GPU runs the step just queued
        self.profiler.step_ended(result.step)
        if schedule.checkpoint_every and student.step % schedule.checkpoint_every == 0:
            self._write_steps()
            lifecycle.pause_progress()  # a save (or eval) of unknown length is no hang
            self.checkpoint()
            feed.commit()  # retention: what the checkpoint holds may be dropped now
        if schedule.eval_every and student.step % schedule.eval_every == 0:
            self._write_steps()
            lifecycle.pause_progress()
            self.evaluate(f"step{student.step}")

    def checkpoint(self) -> None:
        """Checkpoint the epoch as it stands (collective), with the summary's eval before."""
        checkpoints.save(
            self.student,
            self.run_dir,
            epoch=self.epoch,
            task_start=self.task_start,
            trained=self.trained,
            skipped_steps=self.student_step.skipped_steps,
            before=self.summary.get("student_before"),
        )
        self._last_checkpoint = self.student.step

    def evaluate(self, tag: str) -> None:
        """The student's held-out bits per byte, recorded as ``student_<tag>`` (rank 0; every
        rank under FSDP, whose eval is collective); the ranks wait for each other. An eval at the
        step of the last one (the eval after training, when the last step was a periodic eval's)
        takes that result: the weights are the same, and an eval is a pass over every held-out
        text."""
        if self.heldout:
            step = self.student.step
            again = self._last_eval is not None and self._last_eval[0] == step
            if again:
                result = self._last_eval[1]
            else:
                result = self.student.evaluate(self.heldout, self.config.eval.ctx)
                self._last_eval = (step, result)
            if self.rank == 0:
                self.metrics.write("eval", step=step, tag=tag, who="student", **result)
                self.summary[f"student_{tag}"] = result
                logger.info(
                    "[trainer] eval %s at step %d: %.4f bits/byte%s",
                    tag,
                    step,
                    result["bits_per_byte"],
                    " (this step's eval: the same weights)" if again else "",
                )
        self.ranks.barrier()

    def finish(self, checkpoint: bool = True) -> None:
        """After the last step: give back what was claimed, write the last records and the last
        checkpoint; without a stop the eval after training and the export; the summary (rank 0);
        close the files.

        Args:
            checkpoint: False: no checkpoint (the queue went away between two step boundaries).
        """
        schedule, student = self.config.schedule, self.student
        if self.feed is not None:
            self._give_back()
        self._write_steps()
        self.profiler.close()
        self.gc_schedule.close()
        self.gc_clock.remove()
        lifecycle.pause_progress()
        wanted = schedule.final_checkpoint  # off: no checkpoint at the end, a stop's neither
        if checkpoint and wanted and (student.step != self._last_checkpoint or self.stopped):
            self.checkpoint()
            try:
                if self.feed is not None and not self.queue_gone:
                    self.feed.commit()
            except QueueError as e:  # saved: a resumed launch consumes them (replaces), or a clear
                logger.warning("[trainer] could not ack the samples of the last checkpoint: %s", e)
        ended_early = schedule.max_steps and student.step < schedule.max_steps
        if not self.stopped and ended_early and self.rank == 0:
            logger.warning(
                "[trainer] the data ended at step %d, before trainer.schedule.max_steps=%d (%d "
                "epoch%s of the corpus): raise trainer.schedule.epochs or give more data to train "
                "longer",
                student.step,
                schedule.max_steps,
                schedule.epochs,
                "" if schedule.epochs == 1 else "s",
            )
            self.summary["data_ended_before_max_steps"] = True
        if not self.stopped:
            self.evaluate("after")
            if schedule.export:
                self.export()
        if self.rank == 0:
            self.summary.update(
                step=student.step,
                epoch=self.epoch,
                stopped=self.stopped,
                skipped=self.student_step.skipped_steps,
            )
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=1))
        if self.publisher is not None:
            self.publisher.close()
        self.metrics.close()
        self.keys_log.close()
        for reader in self.readers:
            reader.close()

    def export(self) -> None:
        """The student as a Hugging Face folder, ``run_dir/final``, with its model card (rank 0)."""
        final = self.run_dir / "final"
        self.student.export(final)
        if self.rank == 0:
            facts = card_facts(
                self.config, self.run_dir, self.summary, step=self.student.step,
                world_size=self.world,
            )  # fmt: skip
            write_model_card(final, facts)

    # ------------------------------------------------------------------ helpers

    def _open_feed(self) -> TeacherFeed:
        """The feed of the current epoch, under this launch's consumer task."""
        config = self.config
        feed = TeacherFeed(
            self.client,
            config.feed,
            [teacher.link for teacher in config.teachers()],
            self.rank,
            f"trainer/e{self.epoch}/s{self.task_start}/{self.launch}",
            self.trained,
            pads=self.pads,
            device=self.device,
            ranks=self.world,
            version=lambda: self.student.step,
            teacher_vocab=_teacher_vocab(self.student_step.loss_fn),
            readers=self.readers or None,
            output_layers=self.output_layers or None,
            cached_widths=self.cached_widths if config.loss.uses_teacher else None,
            partition=config.partition,
            pack=config.pack,
            uses_teacher=config.loss.uses_teacher,
            on_policy=config.on_policy,
            stop=self.stop,
            register=self.register,
            checkpoint_every=config.schedule.checkpoint_every,
            replaces=f"trainer/e{self.epoch}/",
        )
        logger.info(
            "[trainer] rank %d epoch %d (task %s, %d trained, %s)",
            self.rank,
            self.epoch,
            feed.samples.task,
            len(self.trained),
            "registered: the queue drops what a checkpoint holds"
            if self.register
            else f"not registered: {config.schedule.epochs} epochs read every sample again",
        )
        return feed

    def _give_back(self, micro_batches: list[MicroBatch] = ()) -> None:
        """Give back what the feed holds (:meth:`TeacherFeed.give_back`), unless the queue went
        away while this rank stops."""
        if self.queue_gone:
            return
        try:
            self.feed.give_back(micro_batches)
        except QueueError as e:
            if not self._went_away(e, f"it stops at step {self.student.step}"):
                raise

    def _went_away(self, error: QueueError, then: str) -> bool:
        """Whether ``error`` says the queue went away while this rank stops (a stop, not a
        failure): then it is logged, in one line saying what follows (``then``), and nothing
        more is sent to the queue."""
        if error.code != codes.STOPPED or not self.stop.is_set():
            return False
        logger.info(
            "[trainer] the queue went away while stopping: %s; %s, and what rank %d held leased "
            "is served again once its lease runs out",
            error,
            then,
            self.rank,
        )
        self.queue_gone = self.stopped = True
        return True

    def _at_max_steps(self) -> bool:
        max_steps = self.config.schedule.max_steps
        return bool(max_steps and self.student.step >= max_steps)

    def _write_steps(self) -> None:
        """Write the record of the step not written yet (reads its figures from the GPU)."""
        while self._unwritten:
            entry = self._unwritten.pop(0)
            result, on_policy = entry.pop("result"), entry.pop("on_policy")
            step_s = sum(result.times.values())
            self.metrics.write(
                "step",
                step=result.step,
                skipped=result.skipped,
                step_s=round(step_s, 6),
                tokens_per_s=round(result.metrics["tokens"] / step_s, 2) if step_s else None,
                times={k: round(v, 6) for k, v in result.times.items()},
                memory_mb=device_memory_mb(self.device),
                memory_reserved_mb=device_reserved_mb(self.device),
                recompiles=self.student.recompiles(),
                **entry,
                **({} if on_policy is None else {"on_policy": on_policy}),
                **{k: round(v, 6) for k, v in result.metrics.items()},
            )
            if self.rank == 0:
                metrics = result.metrics
                # several teachers: each one's KD term after the total's ("kd 0.41 [0.38 0.45]")
                each = [metrics.get(f"teacher{i}_kl_loss") for i in range(len(self.readers))]
                several = len(each) > 1 and None not in each
                kd_each = f" [{' '.join(f'{v:.4f}' for v in each)}]" if several else ""
                logger.info(
                    "[trainer] step %d loss %.4f (kd %.4f%s ce %.4f) %.0f tok/s",
                    result.step,
                    metrics.get("loss", float("nan")),
                    metrics.get("kl_loss", 0.0),
                    kd_each,
                    metrics.get("ce_loss", 0.0),
                    metrics["tokens"] / step_s if step_s else 0.0,
                )


def cache_width(directory: str | None) -> int | None:
    """The logits' width W of the teacher cache in ``directory`` (None: no cache).

    Raises:
        SettingsError: no teacher cache there.
    """
    if directory is None:
        return None
    from xtoken_core.cache.manifest import read_manifest
    from xtoken_core.errors import SettingsError

    manifest = read_manifest(directory)
    if manifest is None:
        raise SettingsError(f"teacher.cache {directory} holds no teacher cache (no manifest)")
    return int(manifest["width"])


def _teacher_vocab(loss_fn: Any) -> int | None:
    """The teacher vocab the loss reads (the logits' columns), or None without a loss."""
    return None if loss_fn is None else loss_fn.config.teacher_vocab_size[0]
